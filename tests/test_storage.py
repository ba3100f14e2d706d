"""Storage's atomic writes: on a local filesystem, durable before they are visible."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from raypipe.storage import Storage


def _record_syncs_and_moves(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Every fsync (of the path its descriptor names) and every move, in order."""
    events: list[tuple[str, ...]] = []
    fsync, move = os.fsync, LocalFileSystem.mv

    def synced(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def moved(self: LocalFileSystem, source: str, target: str, **kwargs: Any) -> None:
        events.append(("move", source, target))
        move(self, source, target, **kwargs)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(LocalFileSystem, "mv", moved)
    return events


def test_a_local_write_reaches_the_disk_before_its_name_and_its_name_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash of the machine (not only of the process) after the rename must not leave a complete-looking file
    without its bytes: the file is synced before the rename, its directory (the new name) after."""
    events = _record_syncs_and_moves(monkeypatch)
    Storage(str(tmp_path / "out"), {}).write_json("manifest.json", {"shards": 3})
    [(_, temporary, final)] = [e for e in events if e[0] == "move"]
    assert final == str(tmp_path / "out" / "manifest.json")
    assert events == [("fsync", temporary), ("move", temporary, final), ("fsync", str(tmp_path / "out"))]
