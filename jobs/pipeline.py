"""Job entrypoint: `ray job submit --working-dir . -- python jobs/pipeline.py --recipe demo [key=value ...]`.

Prepare -> hidden-state service -> train -> export -> evaluate; a re-submitted job skips finished stages.
`--verbose` also prints Ray's, Ray Train's and vLLM's own logs (raypipe.progress).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the uploaded working dir holds the package

from raypipe.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["pipeline", *sys.argv[1:]]))
