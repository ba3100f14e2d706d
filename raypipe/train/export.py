"""Export: the trained drafter as a directory vLLM loads as a DFlash drafter for the target.

The drafter is taken from the run's latest checkpoint (as Ray Train recorded
it), written file by file atomically with `export.json`
last (provenance and the vLLM command), so a complete export is one whose
`export.json` exists.
"""

from __future__ import annotations

import json
from typing import Any

from raypipe.config import RaypipeConfig
from raypipe.storage import Storage, absolute
from raypipe.train.checkpoint import STATE_FILE
from raypipe.train.launcher import latest_checkpoint

EXPORT_DIR = "drafter"


def export_drafter(cfg: RaypipeConfig, output: str | None = None) -> dict[str, Any]:
    """Copy the latest checkpoint's drafter to `output` (default: {train.output}/drafter); returns export.json."""
    checkpoint = latest_checkpoint(cfg)
    out = Storage(absolute(output or f"{cfg.train.output}/{EXPORT_DIR}"), cfg.train.storage_options)
    files = [rel.split("/", 1)[1] for rel in checkpoint.glob("drafter/*")]
    for name in files:
        out.write(name, checkpoint.read(f"drafter/{name}"))
    drafter_config = json.loads(checkpoint.read("drafter/config.json"))
    spec_tokens = drafter_config["block_size"] - 1
    provenance = checkpoint.read_json("provenance.json")
    target = provenance["target_path"] if cfg.serve.model.startswith("builtin:") else cfg.serve.model
    doc = {
        "checkpoint": checkpoint.url,
        "training_state": checkpoint.read_json(STATE_FILE),
        "provenance": provenance,
        "files": sorted(files),
        "speculative_config": {"method": "dflash", "model": out.url, "num_speculative_tokens": spec_tokens},
        "vllm_command": (
            f"vllm serve {target} --speculative-config "
            + json.dumps({"method": "dflash", "model": out.url, "num_speculative_tokens": spec_tokens})
        ),
    }
    out.write_json("export.json", doc)
    return doc
