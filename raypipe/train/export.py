"""Export: the trained drafter as a directory vLLM loads as a DFlash drafter for the target.

The drafter is taken from the run's best checkpoint among those Ray Train kept
(raypipe.train.launcher): the highest τ in vLLM when it was measured during
training (`export.json` then records the τ curve), else the lowest mean
training loss of its interval. Its
serving contract with the target (raypipe.train.contract: what it trained
with against what vLLM will apply) is checked first: a mismatch refuses the
export, naming each field and its fix. The export is written whole into a
temporary sibling directory, `export.json` last (provenance, the contract and
the vLLM command), and only then put in place of the previous export: a
failed export leaves the previous one as it was, and a complete export is one
whose `export.json` exists. On a local filesystem the two directories are
exchanged in one step, so the path holds the previous export or the new one
at every instant, a process killed midway included.
"""

from __future__ import annotations

import ctypes
import errno
import os
import uuid
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from raypipe.config import RaypipeConfig
from raypipe.layout import RunFolders
from raypipe.serve.vllm_args import engine_args, serve_command
from raypipe.storage import Storage, absolute, sync_directory
from raypipe.target import resolve_model, resolve_target
from raypipe.train.checkpoint import DRAFTER_DIR, PROVENANCE_FILE, STATE_FILE
from raypipe.train.contract import Contract, TargetFacts, check_drafter
from raypipe.train.launcher import best_checkpoint, checkpoint_score
from raypipe.train.ledger import read_training_curve
from raypipe.train.tau_rule import TAU_PREFIX

DONE = "export.json"
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def export_drafter(cfg: RaypipeConfig, output: str | None = None) -> dict[str, Any]:
    """Export the best checkpoint's drafter to `output` (default: the run's drafter/); returns export.json."""
    return export_checkpoint(cfg, best_checkpoint(cfg), absolute(output) if output else RunFolders.of(cfg).export.url)


def export_checkpoint(cfg: RaypipeConfig, checkpoint: Storage, url: str) -> dict[str, Any]:
    """Export one checkpoint's drafter to `url`, replacing what is there only once the new export is complete; a
    drafter that breaks the serving contract is refused (ContractError) before anything is written."""
    target = resolve_target(cfg.serve)  # the run's target and layer ids: the launcher refuses checkpoints of others
    contract = check_drafter(
        checkpoint.child(DRAFTER_DIR),
        TargetFacts.load(target.path),
        configured_mask_token_id=cfg.train.drafter.mask_token_id,
        served_layer_ids=list(target.layer_ids),
    )
    contract.require()
    out = Storage(url, cfg.train.storage_options)
    staging = Storage(f"{out.url}.tmp-{uuid.uuid4().hex}", cfg.train.storage_options)
    try:
        files = [rel.split("/", 1)[1] for rel in checkpoint.glob(f"{DRAFTER_DIR}/*")]
        for name in files:
            staging.write(name, checkpoint.read(f"{DRAFTER_DIR}/{name}"))
        spec_tokens = checkpoint.read_json(f"{DRAFTER_DIR}/config.json")["block_size"] - 1
        speculative = {"method": "dflash", "model": out.url, "num_speculative_tokens": spec_tokens}
        doc = {
            "checkpoint": checkpoint.url,
            "training_state": checkpoint.read_json(STATE_FILE),
            "provenance": checkpoint.read_json(PROVENANCE_FILE),
            "files": sorted(files),
            "contract": contract.record(),
            "speculative_config": speculative,
            "chosen_by": checkpoint_score(cfg)[0],
            "tau_curve": tau_curve(RunFolders.of(cfg).ledger),
            # The evaluation's engine options, as a command for this machine (CPU: the API server module, the KV size).
            "vllm_command": serve_command(engine_args(target, cfg.serve), speculative),
        }
        staging.write_json(DONE, doc)
        _replace(staging, out, files)
    finally:
        if staging.fs.exists(staging.root):
            staging.fs.rm(staging.root, recursive=True)
    return doc


def tau_curve(ledger: Storage) -> list[dict[str, Any]]:
    """τ in vLLM measured during training, by step and temperature ([] when it was not measured)."""
    return [
        {"step": int(s["step"]), "tau": {k[len(TAU_PREFIX) :]: v for k, v in s.items() if k.startswith(TAU_PREFIX)}}
        for s in read_training_curve(ledger)
        if any(k.startswith(TAU_PREFIX) for k in s)
    ]


def check_export(directory: Storage, target: str | None = None) -> Contract:
    """The serving contract of the drafter in `directory` with `target` (a path, hub id or builtin name), by default
    the one its export.json names; the served layer ids and the configured mask token come from export.json too
    (unknown, so not checked or not counted as chosen, for a directory raypipe did not export)."""
    doc = directory.read_json(DONE) if directory.exists(DONE) else {}
    name = target or doc.get("provenance", {}).get("target")
    if name is None:
        raise ValueError(f"{directory.url} has no {DONE} naming its target: pass the target (--target PATH_OR_ID)")
    return check_drafter(
        directory,
        TargetFacts.load(resolve_model(name, "the target")),
        configured_mask_token_id=doc.get("contract", {}).get("inputs", {}).get("configured_mask_token_id"),
        served_layer_ids=doc.get("provenance", {}).get("layer_ids"),
    )


def _exchange(a: str, b: str) -> bool:
    """Swap two local paths in one step (Linux's renameat2 with RENAME_EXCHANGE); False where the C library or the
    filesystem cannot (NFS, for one)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a, None, b)


def _replace(staging: Storage, out: Storage, files: list[str]) -> None:
    """Put the complete `staging` export in place of `out`. On a local filesystem the two directories are exchanged
    in one step, and `staging` holds the previous export then (its caller removes it); where the filesystem cannot
    exchange, the previous export is renamed aside first, and a kill between the two renames leaves it beside the
    path (`<path>.old-<id>`). On object stores (no rename) file by file after the old `export.json` is gone, the new
    one last, so a mix of two exports never reads as complete."""
    fs = out.fs
    local = isinstance(fs, LocalFileSystem)
    old = f"{out.root}.old-{uuid.uuid4().hex}"
    out.refresh()
    exists = fs.exists(out.root)
    if local and exists and _exchange(staging.root, out.root):
        sync_directory(os.path.dirname(out.root))  # the names, as Storage.write syncs the files
        return
    if exists:
        if not local and fs.exists(out.path(DONE)):
            fs.rm(out.path(DONE))  # from here the old export reads as incomplete
        fs.mv(out.root, old, recursive=True)
    if local:
        fs.mv(staging.root, out.root, recursive=True)
        sync_directory(os.path.dirname(out.root))
    else:
        for name in [*files, DONE]:
            fs.mv(staging.path(name), out.path(name))
    if fs.exists(old):
        fs.rm(old, recursive=True)
