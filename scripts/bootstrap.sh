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
    # uv installs the project in 33-42 s where pip took about 100 s (BENCHMARKS.md, issue 14). It reads no pip
    # configuration, so pip's find-links (where a machine keeps a local CPU torch wheel) are passed on. It compiles
    # the bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, no process would ever write it, and
    # each would compile torch, transformers and vLLM from source again (their import took twice as long).
    .venv/bin/python -m pip install -q uv==0.13.8
    links=()
    for dir in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
        links+=(--find-links "$dir")
    done
    uv=(.venv/bin/uv pip --quiet)
    "${uv[@]}" install --python .venv/bin/python --compile-bytecode "${links[@]}" -e ".[$extras]"
    # PyPI's torchaudio/torchcodec break `import transformers` beside the CPU torch; nothing needs them.
    "${uv[@]}" uninstall --python .venv/bin/python torchaudio torchcodec || true
    if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
        # vLLM's Qwen3.5/3.6 module needs torchvision, whose CUDA-built ops cannot load beside the CPU torch.
        .venv/bin/python -m raypipe.compat.cpu_torchvision
    fi
    echo "$want" > "$stamp"
fi
