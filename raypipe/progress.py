"""Progress bars: a stage's counts with their rate and ETA (what else a run prints: raypipe.console).

Progress bars are tqdm. On a terminal a bar redraws in place. Anywhere else (inside a Ray worker, whose output Ray
forwards to the driver line by line; under `ray job logs`; into a file) it prints one plain line every
`LINE_EVERY_S` seconds and one at the end, instead of a stream of carriage returns. `ray.experimental.tqdm_ray` is
not used: it draws on the driver only the bars of the driver's own job's workers (a Serve replica's never arrive),
and a driver without a terminal still writes carriage returns.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from tqdm import tqdm

LINE_EVERY_S = 30.0


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
    """A bar off a terminal: each count is written once (tqdm redraws the last one when it closes), none at 0 (the
    stage says what it starts), and with `only_if_slow` nothing from a bar closed within LINE_EVERY_S (the evaluation's
    generate calls, a line each would be noise)."""

    written = -1
    only_if_slow = False

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is None and self.n in (self.written, 0):
            return True
        if self.only_if_slow and self.format_dict["elapsed"] < LINE_EVERY_S:
            return True
        self.written = self.n
        return super().display(msg, pos)


def progress(total: int | None, desc: str, unit: str, only_if_slow: bool = False, **kwargs: Any) -> tqdm:
    """A progress bar with its rate and ETA: redrawn on a terminal, else a line every LINE_EVERY_S seconds (with
    `only_if_slow`, none for a bar done sooner)."""
    stream = sys.stderr
    if stream.isatty():
        return tqdm(total=total, desc=desc, unit=f" {unit}", file=stream, mininterval=0.5, dynamic_ncols=True, **kwargs)
    bar = _LineBar(
        total=total,
        desc=desc,
        unit=f" {unit}",
        file=_Lines(stream),
        mininterval=LINE_EVERY_S,
        miniters=1,  # no dynamic miniters: tqdm's monitor thread would redraw between the intervals
        bar_format="{desc}: {n_fmt}/{total_fmt}{unit} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
        **kwargs,
    )
    bar.only_if_slow = only_if_slow
    return bar


def vllm_progress(desc: str, unit: str = "prompts") -> Callable[..., Any]:
    """For vLLM's `generate(use_tqdm=...)`: its bar of finished requests, named `desc`; none for rendering prompts."""

    def make(iterable: Iterable[Any] | None = None, **kwargs: Any) -> Any:
        if iterable is not None:  # vLLM's prompt rendering: quick, no bar
            return iterable
        return progress(kwargs["total"], desc, unit, only_if_slow=True, postfix=kwargs.get("postfix"))

    return make


def duration(seconds: float) -> str:
    """`1:02:03`, `02:03`: how tqdm writes elapsed and remaining times."""
    return tqdm.format_interval(seconds)
