"""The replica's clean-up of the files of a cancelled or failed request, without Ray: every file is attempted."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from raypipe.serve.deployment import HiddenStateService
from raypipe.serve.transport import StateFile, write_states


def test_a_cancelled_requests_files_are_all_removed_though_one_removal_fails(tmp_path: Path) -> None:
    """The hand-over of a cancelled call ended: its files are removed, though one cannot be (a directory stands at its
    path), the others before and after it too."""
    paths = [write_states(tmp_path, f"req{i}", torch.zeros(2, 1, 4), [1, 2]) for i in range(3)]
    (tmp_path / "stuck.safetensors").mkdir()
    stuck = str(tmp_path / "stuck.safetensors")
    results = [StateFile(path, 0, (2, 1, 4), "F32") for path in (paths[0], stuck, paths[1], paths[2])]

    async def cancelled_call() -> None:
        done = asyncio.get_running_loop().create_future()
        done.set_result(results)
        await HiddenStateService.func_or_class._discard_when_done(None, done)

    asyncio.run(cancelled_call())
    assert not any(Path(p).exists() for p in paths), "a failed removal stopped the others"
