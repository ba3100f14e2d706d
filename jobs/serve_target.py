"""Job entrypoint: `ray job submit --working-dir . -- python jobs/serve_target.py --recipe qwen3_8b [key=value ...]`.

Runs the hidden-state service until the job is stopped.
`--verbose` also prints Ray's, Ray Train's and vLLM's own logs (raypipe.progress).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir holds the package

from raypipe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
