"""Job entrypoint: `ray job submit --working-dir . -- python jobs/prepare_data.py --recipe debug_cpu [key=value ...]`.

`--verbose` also prints Ray's, Ray Train's and vLLM's own logs (raypipe.progress).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir holds the package

from raypipe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["prepare", *sys.argv[1:]]))
