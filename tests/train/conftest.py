"""Training fixtures: a small prepared dataset with needs_response rows, and the real vLLM hidden-state service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from raypipe.config import RaypipeConfig, load_config
from raypipe.layout import RunFolders
from raypipe.storage import Storage

SAMPLE = Path(__file__).resolve().parents[2] / "data" / "sample"


def run_config(data: Path, run: Path, *overrides: str) -> RaypipeConfig:
    """The debug_cpu recipe on the small dataset under `data`, training into `run`."""
    return load_config(
        "debug_cpu",
        [
            f"data.sources=[{{path: {data / 'src'}/*.jsonl}}]",
            f"data.output={data / 'prepared'}",
            "data.max_length=512",
            "serve.max_model_len=1024",
            f"train.output={run / 'train'}",
            "train.schedule.step_tokens=512",
            "train.objective.max_pack_anchors=16",
            "train.replies.max_tokens=16",
            # The tiny target's 151,936-token head is nearly all of a CPU step; with it the runs also check the draft
            # vocabulary through resumes, S3, FSDP2 and vLLM's greedy losslessness.
            "train.drafter.draft_vocab_size=4096",
            *overrides,
        ],
    )


def prepare_sample(root: Path, openai_rows: int, sharegpt_rows: int, *overrides: str) -> dict[str, Any]:
    """The bundled sample's first rows of each format under `root/src`, prepared by the real data stage; returns the
    manifest."""
    from raypipe.data.pipeline import run_prepare

    (root / "src").mkdir()
    for name, rows in (("openai", openai_rows), ("sharegpt", sharegpt_rows)):
        lines = (SAMPLE / name / "part-00000.jsonl").read_text().splitlines()[:rows]
        (root / "src" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return run_prepare(run_config(root, root, *overrides).data)


@pytest.fixture(scope="session")
def prepared(ray_cluster: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 raw rows of the bundled sample (prompt-only rows among them), prepared by the real data stage."""
    root = tmp_path_factory.mktemp("train_data")
    manifest = prepare_sample(root, 240, 160)
    assert manifest["counts"]["needs_response"] > 0
    return root


@pytest.fixture(scope="session")
def replies(prepared: Path, tmp_path_factory: pytest.TempPathFactory) -> Storage:
    """The reply pass, run once by the real engine over `prepared`: every training test trains on these rows with
    this target and sampling, so each takes a copy (`with_replies`) and its own pass finds nothing left to do, as a
    resumed run's does."""
    from raypipe.train.replies import run_replies

    cfg = run_config(prepared, tmp_path_factory.mktemp("replies"))
    assert run_replies(cfg)["replies"] > 0
    return RunFolders.of(cfg).replies


def with_replies(cfg: RaypipeConfig, replies: Storage) -> RaypipeConfig:
    """`cfg`, with the stored replies copied into its run folder (local or on S3)."""
    into = RunFolders.of(cfg).replies
    for name in replies.glob("*"):
        into.write(name, replies.read(name))
    return cfg


@pytest.fixture(scope="session")
def service(prepared: Path) -> Iterator[Any]:
    """The hidden-state service as the trainer finds it: the real vLLM engine on the tiny target, in a Serve replica."""
    from ray import serve

    from raypipe.serve.deployment import APP_NAME, build_app

    cfg = run_config(prepared, prepared)
    handle = serve.run(build_app(cfg.serve), name=APP_NAME, route_prefix=None)
    yield handle
    serve.delete(APP_NAME)
