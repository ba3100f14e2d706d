#!/usr/bin/env bash
# The GPU check on a machine without Ray or vLLM: raypipe from this tree plus the wheels of .gpu_carry (scripts/gpu_carry.sh).
cd "$(dirname "$0")/.." && PYTHONPATH="$PWD:$PWD/.gpu_carry/site:$PWD/.gpu_carry/$(python3 -c 'import sys; print(f"cp3{sys.version_info[1]}")')" exec python3 bench/gpu_check.py "$@"
