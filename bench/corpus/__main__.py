"""`python -m bench.corpus --output DIR [--samples N] [--seed S] [--mix reference|multi_turn]`: write the corpus."""

import argparse
import json

from bench.corpus import MIXES, REFERENCE_SAMPLES, CorpusSpec, write_corpus

parser = argparse.ArgumentParser(prog="python -m bench.corpus", description=__doc__)
parser.add_argument("--output", required=True, help="Output directory.")
parser.add_argument("--samples", type=int, default=REFERENCE_SAMPLES, help="Samples; categories scale proportionally.")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--mix", default="reference", choices=MIXES, help="multi_turn: its conversations alone")
args = parser.parse_args()
print(
    json.dumps(write_corpus(args.output, CorpusSpec(num_samples=args.samples, seed=args.seed, mix=args.mix)), indent=1)
)
