"""What a run prints: short lines and progress bars, and everything else with `--verbose`.

By default each stage says what it does in short lines (stage name, counts, rates, ETA); Ray's, Ray Train's and
vLLM's own INFO logs stay in Ray's log files (`/tmp/ray/session_latest/logs`). `raypipe ... --verbose` sets
RAYPIPE_VERBOSE=1 in the job's runtime env, so every Ray worker of the job reads it too, and prints them as well,
with the full result documents.

Progress bars are tqdm. On a terminal a bar redraws in place. Anywhere else (inside a Ray worker, whose output Ray
forwards to the driver line by line; under `ray job logs`; into a file) it prints one plain line every
`LINE_EVERY_S` seconds and one at the end, instead of a stream of carriage returns. `ray.experimental.tqdm_ray` is
not used: it draws on the driver only the bars of the driver's own job's workers (a Serve replica's never arrive),
and a driver without a terminal still writes carriage returns.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tqdm import tqdm

VERBOSE = "RAYPIPE_VERBOSE"
LINE_EVERY_S = 30.0


def verbose() -> bool:
    return os.environ.get(VERBOSE) == "1"


def job_env(verbose: bool) -> dict[str, str]:
    """Environment variables for every Ray worker of a job the CLI starts: the verbosity, and unless verbose, errors
    only from vLLM's logger and loguru's (speculators'), and no Hugging Face progress bars (transformers' bars
    while a checkpoint is saved, in carriage returns). One already set (by the user, or by the runtime env of
    `ray job submit`) is left as it is."""
    wanted = {
        VERBOSE: "1" if verbose else "0",
        "VLLM_LOGGING_LEVEL": "INFO" if verbose else "ERROR",
        "LOGURU_LEVEL": "INFO" if verbose else "ERROR",
        "HF_HUB_DISABLE_PROGRESS_BARS": "0" if verbose else "1",
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def quiet_train_worker() -> None:
    """In a Ray Train worker, unless verbose: Ray Train's INFO records (every report's metrics and checkpoint, logged
    by a logger named after its file, which `RunConfig(logging_config=...)` does not reach) stay in its log files."""
    if verbose():
        return
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.WARNING)


class _Lines:
    """tqdm's stream off a terminal: each redraw (a carriage return, the bar, padding) becomes one line."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.strip("\r\n").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _LineBar(tqdm):
    """A bar off a terminal: each count is written once (tqdm redraws the last one when it closes)."""

    written = -1

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is None and self.n == self.written:
            return True
        self.written = self.n
        return super().display(msg, pos)


def progress(total: int | None, desc: str, unit: str, **kwargs: Any) -> tqdm:
    """A progress bar with its rate and ETA: redrawn on a terminal, else a line every LINE_EVERY_S seconds."""
    stream = sys.stderr
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit=f" {unit}", file=stream, mininterval=0.5, dynamic_ncols=True, **kwargs)
    return _LineBar(
        total=total,
        desc=desc,
        unit=f" {unit}",
        file=_Lines(stream),
        mininterval=LINE_EVERY_S,
        miniters=1,  # no dynamic miniters: tqdm's monitor thread would redraw between the intervals
        bar_format="{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        **kwargs,
    )


def vllm_progress(desc: str, unit: str = "prompts") -> Callable[..., Any]:
    """For vLLM's `generate(use_tqdm=...)`: its bar of finished requests, named `desc`; none for rendering prompts."""

    def make(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
        if iterable is not None:  # vLLM's prompt rendering: quick, no bar
            return iterable
        return progress(kwargs["total"], desc, unit, postfix=kwargs.get("postfix"))

    return make


def duration(seconds: float) -> str:
    """`1:02:03`, `02:03`: how tqdm writes elapsed and remaining times."""
    return tqdm.format_interval(seconds)
