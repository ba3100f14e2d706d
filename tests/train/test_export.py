"""The export's swap into place: the previous export or the new one is at the path at every instant."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem

from raypipe.storage import Storage
from raypipe.train.export import DONE, _exchange, _replace


def _export(path: Path, step: int) -> Storage:
    """A stand-in for a complete export: its weights and, last, its export.json."""
    export = Storage(str(path), {})
    export.write("model.safetensors", f"weights of step {step}".encode())
    export.write_json(DONE, {"step": step})
    return export


def _step(path: Path) -> int:
    return json.loads((path / DONE).read_text())["step"]


def test_an_export_killed_during_its_swap_leaves_a_complete_export_at_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process is killed at the swap's second move (the old export moved aside, the new one not yet in place,
    before the fix): the path still holds a complete export, the old one or the new one."""
    out, staging = _export(tmp_path / "drafter", 1), _export(tmp_path / "drafter.tmp-new", 2)
    moves: list[Any] = []
    move = LocalFileSystem.mv

    def killed_at_the_second(self: LocalFileSystem, *args: Any, **kwargs: Any) -> None:
        moves.append(args)
        if len(moves) == 2:
            raise KeyboardInterrupt("killed")
        move(self, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "mv", killed_at_the_second)
    with contextlib.suppress(KeyboardInterrupt):
        _replace(staging, out, ["model.safetensors"])
    assert (tmp_path / "drafter" / DONE).exists(), f"nothing complete at the export path: {list(tmp_path.iterdir())}"
    assert _step(tmp_path / "drafter") in (1, 2)


def test_where_the_filesystem_cannot_exchange_two_renames_put_the_export_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NFS has no RENAME_EXCHANGE: the previous export is renamed aside, the new one into place, the old one removed."""
    monkeypatch.setattr("raypipe.train.export._exchange", lambda a, b: False)
    out, staging = _export(tmp_path / "drafter", 1), _export(tmp_path / "drafter.tmp-new", 2)
    _replace(staging, out, ["model.safetensors"])
    assert _step(tmp_path / "drafter") == 2 and [p.name for p in tmp_path.iterdir()] == ["drafter"]


def test_the_exchange_swaps_two_directories_in_one_step(tmp_path: Path) -> None:
    """On this machine's filesystem (ext4, tmpfs and xfs all have RENAME_EXCHANGE): each holds the other's files."""
    _export(tmp_path / "a", 1)
    _export(tmp_path / "b", 2)
    assert _exchange(str(tmp_path / "a"), str(tmp_path / "b"))
    assert (_step(tmp_path / "a"), _step(tmp_path / "b")) == (2, 1)


def test_the_export_in_place_is_synced_to_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the swap the directory that holds the export is synced: the new name survives a crash of the machine."""
    out, staging = _export(tmp_path / "drafter", 1), _export(tmp_path / "drafter.tmp-new", 2)
    synced: list[str] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    _replace(staging, out, ["model.safetensors"])
    assert synced == [str(tmp_path)]
