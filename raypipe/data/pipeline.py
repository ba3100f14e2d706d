"""Ray wiring of the data stage: chunks spread over a pool of CPU actors.

Each actor loads the tokenizer once, prepares whole chunks (so a shard is
written by exactly one actor, atomically) and reports counts to Ray's
metrics. The driver plans the chunks, skips those already complete, and
writes the manifest when all are done.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import ray
from ray.data import ActorPoolStrategy
from ray.util.metrics import Counter

from raypipe.config import DataConfig
from raypipe.data.output import PreparedOutput, dependencies
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import Chunk, plan_chunks, unmatched_files
from raypipe.data.tokenizer import TokenizerSpec, resolve_tokenizer


class _PrepareActor:
    """Ray Data UDF: one chunk per call, written before the call returns."""

    def __init__(self, cfg_json: str, spec: TokenizerSpec) -> None:
        cfg = DataConfig.model_validate_json(cfg_json)
        self.preparer = ShardPreparer(cfg, spec)
        self.output = PreparedOutput.of(cfg)
        self.rows = Counter("raypipe_data_rows", "Input rows prepared by the data stage.", ("source",))
        self.kept = Counter("raypipe_data_rows_kept", "Prepared rows written.", ("source",))
        self.tokens = Counter("raypipe_data_tokens", "Tokens in prepared rows.", ("source",))
        self.rejects = Counter("raypipe_data_rejects", "Rejected rows, by reason code.", ("source", "reason"))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        out = []
        for item in batch["chunk"]:
            chunk = Chunk(**json.loads(item))
            stats = self.output.write_shard(self.preparer.prepare(chunk))
            tags = {"source": chunk.source}
            counts = [
                (self.rows, stats["rows_in"], tags),
                (self.kept, stats["rows_kept"], tags),
                (self.tokens, stats["tokens"], tags),
            ]
            counts += [(self.rejects, n, {**tags, "reason": code}) for code, n in stats["rejects_by_code"].items()]
            for counter, n, counter_tags in counts:
                if n > 0:  # Ray counters refuse 0 (a shard whose rows were all rejected keeps none)
                    counter.inc(n, counter_tags)
            out.append(json.dumps(stats))
        return {"stats": out}


def run_prepare(cfg: DataConfig) -> dict[str, Any]:
    """Prepare every source into `cfg.output`; resumes a partial run. Returns the manifest."""
    tok, spec = resolve_tokenizer(cfg)
    deps = dependencies(cfg, spec)  # before planning: it drops cached listings of the inputs
    plan = plan_chunks(cfg.sources, cfg.storage_options, cfg.chunk_bytes)
    unmatched = unmatched_files(cfg.sources, cfg.storage_options)
    if unmatched:
        shown = ", ".join(unmatched[:20]) + (f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else "")
        print(
            f"[prepare] warning: {len(unmatched)} files under data.sources are not read (another suffix): {shown}",
            flush=True,
        )
    output = PreparedOutput.of(cfg)
    output.start({**deps, "chunks": [c.to_dict() for c in plan]}, tok)
    todo = [c for c in plan if not output.is_done(c.index)]
    print(
        f"[prepare] {len(plan)} shards planned, {len(plan) - len(todo)} already complete, {len(todo)} to do", flush=True
    )
    if todo:
        _run_actors(cfg, spec, todo)
    output.refresh()  # the actors wrote stats/ from other processes: a listing cached here would hide their files
    end_of_turn = {"token": spec.end_of_turn, "id": spec.end_of_turn_id}
    manifest = output.write_manifest(plan, deps, end_of_turn, unmatched)
    c = manifest["counts"]
    print(
        f"[prepare] rows in {c['rows_in']} (+{c['split_extra']} per-turn) = kept {c['rows_kept']} + rejected "
        f"{c['rows_rejected']}; {c['tokens']} tokens, {c['needs_response']} rows need a response; manifest at "
        f"{output.url}/manifest.json",
        flush=True,
    )
    return manifest


def _run_actors(cfg: DataConfig, spec: TokenizerSpec, todo: list[Chunk]) -> None:
    # One tokenizer thread per reserved CPU: the batched call would otherwise use every core.
    threads = str(max(1, math.floor(cfg.cpus_per_actor)))
    ds = ray.data.from_items([{"chunk": json.dumps(c.to_dict())} for c in todo], override_num_blocks=len(todo))
    ds = ds.map_batches(
        _PrepareActor,
        fn_constructor_kwargs={"cfg_json": cfg.model_dump_json(), "spec": spec},
        batch_size=1,
        compute=ActorPoolStrategy(min_size=1, max_size=cfg.num_actors),
        num_cpus=cfg.cpus_per_actor,
        runtime_env={"env_vars": {"RAYON_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "true"}},
    )
    start, done, rows = time.monotonic(), 0, 0
    for row in ds.iter_rows():
        stats = json.loads(row["stats"])
        done += 1
        rows += stats["rows_in"]
        print(
            f"[prepare] shard {stats['shard']} done ({done}/{len(todo)}), "
            f"{rows / (time.monotonic() - start):.0f} rows/s",
            flush=True,
        )
