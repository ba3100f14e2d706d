"""The training tests' helpers: the debug_cpu recipe on a small dataset, the bundled sample's first rows prepared by
the real data stage, a run folder given stored replies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def prepare_sample(
    root: Path, openai_rows: int, sharegpt_rows: int, *overrides: str, extra_openai: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The bundled sample's first rows of each format under `root/src` (`extra_openai`: more OpenAI-format lines after
    them), prepared by the real data stage; returns the manifest."""
    from raypipe.data.pipeline import run_prepare

    (root / "src").mkdir()
    for name, rows in (("openai", openai_rows), ("sharegpt", sharegpt_rows)):
        lines = (SAMPLE / name / "part-00000.jsonl").read_text().splitlines()[:rows]
        lines += list(extra_openai) if name == "openai" else []
        (root / "src" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return run_prepare(run_config(root, root, *overrides).data)


def with_replies(cfg: RaypipeConfig, replies: Storage) -> RaypipeConfig:
    """`cfg`, with the stored replies copied into its run folder (local or on S3)."""
    into = RunFolders.of(cfg).replies
    for name in replies.glob("*"):
        into.write(name, replies.read(name))
    return cfg
