#!/usr/bin/env bash
# Build .gpu_carry/ (ignored, < 64 MiB): the wheels bench/gpu_check.py needs beyond the GPU machine's torch,
# transformers and Triton, unpacked. That machine fetches nothing; `run` carries this folder with the tree.
# Pure-Python wheels go to .gpu_carry/site; pydantic-core (compiled) to .gpu_carry/cp3XX for each Python it may have.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_carry && mkdir -p .gpu_carry/wheels
pure=(speculators==0.9.0 pydantic==2.14.4 pydantic-settings==2.16.3 annotated-types==0.8.0 typing-inspection==0.4.5
      typing_extensions==4.16.0 click==8.5.1 python-dotenv==1.2.4 loguru==0.7.3 rich==15.0.0 Pygments==2.21.0
      markdown-it-py==4.3.0 mdurl==0.1.2 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 anyio==4.16.0 sniffio==1.3.1
      certifi==2026.10.19.post1 idna==3.20)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .gpu_carry/wheels "${pure[@]}"
for whl in .gpu_carry/wheels/*.whl; do .venv/bin/python -m zipfile -e "$whl" .gpu_carry/site; done
for v in 10 11 12 13; do
    .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version "3.$v" --platform manylinux2014_x86_64 \
        -d ".gpu_carry/wheels/cp3$v" pydantic_core==2.50.5
    .venv/bin/python -m zipfile -e ".gpu_carry/wheels/cp3$v"/*.whl ".gpu_carry/cp3$v"
done
rm -rf .gpu_carry/wheels
du -sh .gpu_carry
