"""PyPI's torchvision imports beside the CPU torch through raypipe's hook (what vLLM's Qwen3.5/3.6 module needs)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from raypipe.compat.cpu_torchvision import PTH_NAME

pytestmark = pytest.mark.skipif(
    not (Path(sysconfig.get_paths()["purelib"]) / PTH_NAME).is_file(), reason="not a CPU install (no hook)"
)


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_a_new_interpreter_imports_torchvision_and_the_qwen2_vl_image_processor() -> None:
    out = run(
        "import importlib.util, sys\n"
        # The hook costs nothing until torchvision is imported: not even transformers' probe for it imports torch.
        "assert importlib.util.find_spec('torchvision') and 'torch' not in sys.modules\n"
        "import transformers; assert 'torch' not in sys.modules\n"
        "import torchvision.transforms.v2, torchvision.extension as ext\n"
        "from transformers.models.qwen2_vl import image_processing_qwen2_vl\n"
        "print(torchvision.__version__, ext._has_ops())"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.28.0+cu130", "False"]  # the CUDA build's ops stay unloaded; nothing calls them


def test_without_the_hook_the_import_fails_as_reported() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            f"import sys; sys.path.append({sysconfig.get_paths()['purelib']!r}); import torchvision",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "operator torchvision::nms does not exist" in out.stderr
