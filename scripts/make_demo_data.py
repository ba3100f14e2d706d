"""Write the demo recipe's bundled data: `python scripts/make_demo_data.py` (deterministic; a test checks the files
match)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from raypipe.assets.demo_target import demo_splits  # noqa: E402

if __name__ == "__main__":
    root = Path(__file__).resolve().parents[1] / "data" / "demo"
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in demo_splits().items():
        (root / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{root / split}.jsonl: {len(rows)} rows")
