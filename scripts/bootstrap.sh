#!/usr/bin/env bash
# Create .venv from the project's own files: `bash scripts/bootstrap.sh EXTRAS` (e.g. cpu, test or tiny).
# Re-runs are instant while pyproject.toml, this script and the extras are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-tiny}"
python3 -m venv .venv
stamp=".venv/.raypipe-installed"
want="$(cat pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$extras]"
    # PyPI's torchaudio/torchcodec break `import transformers` beside the CPU torch; nothing needs them.
    .venv/bin/python -m pip uninstall -q -y torchaudio torchcodec || true
    if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
        # vLLM's Qwen3.5/3.6 module needs torchvision, whose CUDA-built ops cannot load beside the CPU torch.
        .venv/bin/python -m raypipe.cpu_torchvision
    fi
    echo "$want" > "$stamp"
fi
