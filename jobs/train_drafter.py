"""Job entrypoint: `ray job submit --working-dir . -- python jobs/train_drafter.py --recipe qwen3_8b [key=value ...]`.

Trains the drafter (attaching to or starting the hidden-state service), then exports it.
`--verbose` also prints Ray's, Ray Train's and vLLM's own logs (raypipe.progress).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir holds the package

from raypipe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
