#!/usr/bin/env bash
# The GPU check on a machine without Ray or vLLM: raypipe from this tree plus the wheels of .gpu_carry (scripts/gpu_carry.sh).
# Both shapes on one GPU, then on two where nvidia-smi lists two or more: 8 minutes at most in all, inside one `run`.
# Each shape's JSON line is appended to $OUT/gpu_check.jsonl as it ends (a timeout keeps the shapes done); the logs
# (with Dynamo's recompilation reasons) and bench/results/gpu_check.json go to $OUT too. Extra arguments go to both runs.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/out}"
mkdir -p "$out" && rm -f "$out/gpu_check.jsonl"
export PYTHONPATH="$PWD:$PWD/.gpu_carry/site:$PWD/.gpu_carry/$(python3 -c 'import sys; print(f"cp3{sys.version_info[1]}")')"
export PYTHONUNBUFFERED=1 TORCH_LOGS=recompiles
gpus=$(nvidia-smi -L | wc -l)
start=$(date +%s)
status=0
timeout "$([ "$gpus" -ge 2 ] && echo 300 || echo 480)" python3 bench/gpu_check.py --out "$out/gpu_check.jsonl" "$@" 2>&1 \
    | tee "$out/gpu_check_1gpu.log" || status=1
if [ "$gpus" -ge 2 ]; then
    timeout 180 python3 bench/gpu_check.py --world-size 2 --out "$out/gpu_check.jsonl" "$@" 2>&1 \
        | tee "$out/gpu_check_2gpu.log" || status=1
fi
result=bench/results/gpu_check.json  # copied only when this run wrote it
if [ -f "$result" ] && [ "$(stat -c %Y "$result")" -ge "$start" ]; then cp "$result" "$out/"; fi
exit "$status"
