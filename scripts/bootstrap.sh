#!/usr/bin/env bash
# Create .venv from the project's own files: `bash scripts/bootstrap.sh KIND`, KIND one of the locks in locks/
# (tiny, cpu, test or gpu). It installs the lock's versions exactly, then raypipe itself; re-runs are instant while
# pyproject.toml, the lock and this script are unchanged. `python -m raypipe.lock` writes the locks again.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-tiny}"
lock="locks/$kind.txt"
if [ ! -f "$lock" ]; then
    echo "scripts/bootstrap.sh: no lock for '$kind'; the kinds are: $(basename -s .txt locks/*.txt | xargs)" >&2
    exit 2
fi
[ -x .venv/bin/python ] || python3 -m venv .venv  # again, it would run ensurepip each time (5-20 s)
stamp=".venv/.raypipe-installed"
want="$(cat pyproject.toml "$lock" scripts/bootstrap.sh | sha256sum | cut -c1-16) $kind"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # uv installs the project in 33-42 s where pip took about 100 s (BENCHMARKS.md, issue 14). It compiles the
    # bytecode at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, no process would ever write it, and
    # each would compile torch, transformers and vLLM from source again (their import took twice as long).
    .venv/bin/python -m pip install -q uv==0.13.8
    links=()
    if [ "$kind" != gpu ]; then
        # The CPU kinds' torch (2.13.0+cpu) is not on PyPI: this kind of machine keeps it in pip's find-links, which
        # uv does not read. The gpu lock's torch is PyPI's CUDA build, which a local CPU wheel would stand in for.
        for dir in $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true) ${PIP_FIND_LINKS:-}; do
            links+=(--find-links "$dir")
        done
    fi
    uv=(.venv/bin/uv pip --quiet)
    # sync: the venv holds the lock's packages and no others (a kind installed before leaves nothing behind). The
    # CPU locks leave out torchaudio and torchcodec, which break `import transformers` beside the CPU torch.
    "${uv[@]}" sync --python .venv/bin/python --compile-bytecode "${links[@]}" "$lock"
    "${uv[@]}" install --python .venv/bin/python --no-deps -e .
    if .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)"; then
        # vLLM's Qwen3.5/3.6 module needs torchvision, whose CUDA-built ops cannot load beside the CPU torch.
        .venv/bin/python -m raypipe.compat.cpu_torchvision
    fi
    echo "$want" > "$stamp"
fi
