"""The Ray head a command would join, and whether its GCS answers: checked before `ray.init`, which waits for a dead
one.

`ray.init()` without an address joins the head that RAY_ADDRESS names, else the one the last `ray start --head` on
this machine recorded in Ray's current-cluster file (raypipe.compat.ray.current_cluster_file), else it starts a local
instance (RAY_ADDRESS=local always does). A head killed without `ray stop` leaves that file behind, and `ray.init`
then retries the dead GCS with a warning every few seconds, for minutes. One TCP connection to the GCS port, given a
few seconds, tells a dead head first (raypipe.cli before `ray.init`; `raypipe doctor` shows it).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Head:
    address: str  # as given: HOST:PORT of the GCS, or ray://HOST:PORT (Ray Client)
    source: str  # "RAY_ADDRESS", or the path of the current-cluster file that recorded it

    def describe(self) -> str:
        where = "RAY_ADDRESS" if self.source == "RAY_ADDRESS" else f"recorded in {self.source}"
        return f"the Ray head at {self.address} ({where})"

    def fix(self) -> str:
        if self.source == "RAY_ADDRESS":
            return "set RAY_ADDRESS to a running head's address, or RAY_ADDRESS=local for a fresh local Ray instance"
        return (
            f"`ray stop` (it removes {self.source}; it also stops every Ray process of this machine), or "
            "RAY_ADDRESS=local for a fresh local Ray instance, or RAY_ADDRESS=HOST:PORT of a running head"
        )


def head_to_join(environ: Mapping[str, str], cluster_file: Path) -> Head | None:
    """The head `ray.init()` joins in this environment, None where it starts a local instance (Ray 2.60's rule:
    RAY_ADDRESS, unless empty or `auto`; else the current-cluster file; RAY_ADDRESS=local starts one)."""
    given = environ.get("RAY_ADDRESS", "")
    if given == "local":
        return None
    if given and given != "auto":
        return Head(given, "RAY_ADDRESS")
    recorded = cluster_file.read_text().strip() if cluster_file.is_file() else ""
    return Head(recorded, str(cluster_file)) if recorded else None


def _host_port(address: str) -> tuple[str, int] | None:
    """(host, port) of `HOST:PORT`, `[IPv6]:PORT` or `scheme://HOST:PORT`; None for anything else (ray.init judges
    it)."""
    found = re.fullmatch(r"(?:[a-z]+://)?\[?([^\[\]/]+?)\]?:(\d+)/?", address.strip())
    return (found.group(1), int(found.group(2))) if found else None


def unreachable(head: Head, timeout_s: float = TIMEOUT_S) -> str | None:
    """Why the head's GCS port takes no connection within `timeout_s`, None when it takes one."""
    target = _host_port(head.address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return None
    except OSError as err:
        return str(err) or type(err).__name__


def check_head(environ: Mapping[str, str], cluster_file: Path, timeout_s: float = TIMEOUT_S) -> Head | None:
    """The head `ray.init()` would join (None: a local instance), or a ValueError naming it, where its address came
    from and the fix, when it does not answer."""
    head = head_to_join(environ, cluster_file)
    why = None if head is None else unreachable(head, timeout_s)
    if why is None:
        return head
    waits = "`ray.init()` would retry it for minutes"
    if head.source != "RAY_ADDRESS":
        waits = f"A head killed without `ray stop` leaves that file behind, and {waits}"
    raise ValueError(f"{head.describe()} does not answer: {why}. {waits}. Fix: {head.fix()}")
