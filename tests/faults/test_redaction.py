"""Credentials in storage_options never reach what is persisted, hashed, logged or shown; workers still get them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from raypipe.config import REDACTED, RaypipeConfig, TrainConfig, load_config, redact
from raypipe.pipeline import StageLog, eval_fingerprint, prepare_fingerprint, train_fingerprint
from raypipe.target import resolve_target
from raypipe.train.checkpoint import save_checkpoint
from raypipe.train.drafter import build_drafter
from raypipe.train.launcher import build_trainer
from raypipe.train.step import TrainState
from tests.helpers import serve_config

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"
KEY, SECRET, TOKEN = "AKIAEXAMPLEKEY0001", "s3cr3t-never-shown", "session-token-never-shown"


def options(secret: str = SECRET, endpoint: str = "http://127.0.0.1:9000") -> dict:
    return {
        "key": KEY,
        "secret": secret,
        "token": TOKEN,
        "client_kwargs": {"endpoint_url": endpoint, "aws_secret_access_key": secret},
    }


def config(tmp_path: Path, secret: str = SECRET, endpoint: str = "http://127.0.0.1:9000") -> RaypipeConfig:
    so = json.dumps(options(secret, endpoint))
    return load_config(
        "debug_cpu",
        [
            f"data.sources=[{{path: {SAMPLE}/openai/*.jsonl}}]",
            f"data.output={tmp_path}/prepared",
            f"data.storage_options={so}",
            f"train.output={tmp_path}/train",
            f"train.storage_options={so}",
        ],
    )


def hidden(text: str) -> bool:
    return all(s not in text for s in (KEY, SECRET, TOKEN))


def test_redact_hides_every_credential_under_storage_options_and_nothing_else(tmp_path: Path) -> None:
    doc = config(tmp_path).model_dump()
    public = redact(doc)
    assert hidden(json.dumps(public)) and not hidden(json.dumps(doc)), (
        "the dump itself still has them: workers need them"
    )
    assert public["train"]["storage_options"] == {
        "key": REDACTED,
        "secret": REDACTED,
        "token": REDACTED,
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9000", "aws_secret_access_key": REDACTED},
    }
    assert (
        public["train"]["drafter"]["mask_token_id"] == doc["train"]["drafter"]["mask_token_id"]
        and public["data"]["tokenizer"] == "builtin:qwen"
    )  # "token" outside options
    assert redact({"headers": {"Authorization": "x"}}) == {
        "headers": {"Authorization": "x"}
    }  # only under storage_options
    assert config(tmp_path).public_dump() == public


def test_fingerprints_ignore_a_rotated_secret_but_not_the_endpoint(tmp_path: Path) -> None:
    cfg, rotated, moved = (
        config(tmp_path),
        config(tmp_path, secret="rotated"),
        config(tmp_path, endpoint="http://10.0.0.1:9000"),
    )
    # Training's fingerprint covers what the drafter is trained on and with; where the run is stored is how it runs.
    assert (
        train_fingerprint(cfg, "m", "t") == train_fingerprint(rotated, "m", "t") == train_fingerprint(moved, "m", "t")
    )
    assert eval_fingerprint(cfg, "t") == eval_fingerprint(rotated, "t")
    assert prepare_fingerprint(cfg.data) == prepare_fingerprint(rotated.data) != prepare_fingerprint(moved.data)


def test_stage_log_records_carry_no_credentials(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    (tmp_path / "prepared").mkdir()
    (tmp_path / "prepared" / "manifest.json").write_text("{}\n")
    log = StageLog(cfg)
    for stage in ("train", "eval"):
        log.mark(stage, 1.0, {"output": cfg.train.output})
    records = list((tmp_path / "train" / "pipeline" / cfg.name).glob("*.json"))
    assert len(records) == 2 and all(hidden(p.read_text()) for p in records)
    assert log.done("train") is not None and StageLog(config(tmp_path, secret="rotated")).done("train") is not None


def test_checkpoint_config_json_is_redacted(tiny_target: str, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    target = resolve_target(serve_config(tiny_target))
    tc = TrainConfig(
        output="unused",
        drafter={"draft_layers": 1, "block_size": 4},
        objective={"max_anchors": 16},
        schedule={"step_tokens": 256},
        run={"use_gpu": False},
    )
    drafter = build_drafter(target, tc, None)
    state = TrainState.create(drafter, drafter, tc, torch.device("cpu"), total_steps=1)
    save_checkpoint(tmp_path, state, cfg.model_dump(), {"target_path": target.path}, write=True)
    saved = (tmp_path / "config.json").read_text()
    assert (
        hidden(saved)
        and json.loads(saved)["train"]["storage_options"]["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:9000"
    )


def test_ray_train_state_gets_no_config_while_the_workers_get_the_real_one(tmp_path: Path) -> None:
    trainer = build_trainer(config(tmp_path))
    assert (
        trainer.train_loop_config is None
    )  # Ray Train exports train_loop_config to its state (the dashboard's Train view)
    worker_config = trainer.train_loop_per_worker.args[0]["config"]
    assert worker_config["train"]["storage_options"]["secret"] == SECRET


def test_credentials_are_redacted_by_value_wherever_they_stand() -> None:
    """Before, only keys under storage_options were redacted: a URL's password (a proxy), a Cookie header, a SAS token
    under `sas` and presigned URLs (in sources, in plan.json's input keys) went out as they were."""
    presigned = (
        "https://b.s3.amazonaws.com/x.jsonl?X-Amz-Credential=AKIAEXAMPLE&X-Amz-Date=20261207&X-Amz-Signature=deadbeef"
    )
    sas = "https://a.blob.core.windows.net/c/f.jsonl?sv=2022-11-02&se=2026-12-08&sp=r&sig=SECRETSIG"
    doc = {
        "data": {
            "sources": [{"path": presigned}, {"path": sas}],
            "storage_options": {
                "sas": "sv=2022&sig=SECRETSAS",
                "client_kwargs": {"proxies": {"https": "http://me:PROXYPW@proxy:3128"}, "headers": {"Cookie": "s=C"}},
            },
        },
        "inputs": {presigned: {"size": 1}},
        "train": {
            "output": "s3://bucket/run",
            "storage_options": {"client_kwargs": {"endpoint_url": "http://s3:9000"}},
        },
    }
    out = json.dumps(redact(doc))
    for secret in ("AKIAEXAMPLE", "deadbeef", "SECRETSIG", "SECRETSAS", "PROXYPW", "s=C"):
        assert secret not in out, secret
    # What is not a secret stays, so a fingerprint still follows the data and the endpoint.
    for kept in ("b.s3.amazonaws.com/x.jsonl", "X-Amz-Date=20261207", "se=2026-12-08", "http://me:", "http://s3:9000"):
        assert kept in out, kept


def test_a_secret_given_by_reference_is_read_where_the_filesystem_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`{env: NAME}` and `{file: PATH}` in storage_options: the config, its records and the command line carry the
    reference; the filesystem gets the secret; preflight names a reference this machine cannot resolve."""
    from raypipe.preflight import problems
    from raypipe.storage import resolve_secrets

    (tmp_path / "secret").write_text("FROMFILE\n")
    monkeypatch.setenv("RAYPIPE_TEST_KEY", "FROMENV")
    options = {
        "key": {"env": "RAYPIPE_TEST_KEY"},
        "client_kwargs": {"headers": {"x": {"file": str(tmp_path / "secret")}}},
    }
    assert resolve_secrets(options) == {"key": "FROMENV", "client_kwargs": {"headers": {"x": "FROMFILE"}}}
    cfg = load_config("debug_cpu", [f"data.storage_options={json.dumps(options)}"])
    assert "FROMENV" not in json.dumps(cfg.public_dump()) and problems(cfg) == []
    monkeypatch.delenv("RAYPIPE_TEST_KEY")
    [line] = problems(cfg)
    assert "data.storage_options.key: the environment variable RAYPIPE_TEST_KEY is not set" in line
