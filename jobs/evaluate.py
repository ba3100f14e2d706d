"""Job entrypoint: `ray job submit --working-dir . -- python jobs/evaluate.py --recipe demo [key=value ...]`.

Measures the exported drafter's acceptance in vLLM and writes eval.json and plots.
A job's outputs are absolute paths or URLs (`train.output=$PWD/runs/NAME/train` and alike): a relative one
would land in Ray's temporary copy of the working dir, so it is refused (raypipe.preflight).
`--verbose` also prints Ray's, Ray Train's and vLLM's own logs (raypipe.progress).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir holds the package

from raypipe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
