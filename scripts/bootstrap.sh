#!/usr/bin/env bash
# Create .venv from the project's own files: `bash scripts/bootstrap.sh EXTRAS` (e.g. tiny or test).
# Re-runs are instant while pyproject.toml and the extras are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-tiny}"
python3 -m venv .venv
stamp=".venv/.raypipe-installed"
want="$(sha256sum pyproject.toml | cut -c1-16) $extras"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$extras]"
    # PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch; nothing needs them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    echo "$want" > "$stamp"
fi
