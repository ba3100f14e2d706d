"""Ray wiring of the data stage: chunks spread over a pool of CPU actors.

Each actor loads the tokenizer once, prepares whole chunks (so a shard is
written by exactly one actor, atomically) and reports counts to Ray's
metrics. The driver plans the chunks, skips those already complete, and
writes the manifest when all are done.

Fixed costs are kept small: the tokenizer and template reach the actors once
through the object store; every actor the work can use starts at once, warm
(its tokenizer and template engine built in its constructor); shards are cut
from the input's size and the actor count, so that every actor has several
to do (at most `data.chunk_bytes` each), and small files share shards, so the
file count does not set the shard count; a resumed run keeps the shards it
planned. At the end the driver reports where the time went: in the actors'
own work, and in Ray Data and start-up around it.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import numpy as np
import ray
from ray.data import ActorPoolStrategy
from ray.util.metrics import Counter

from raypipe.config import DataConfig
from raypipe.console import logger
from raypipe.counters import counter
from raypipe.data.output import PreparedOutput, dependencies
from raypipe.data.prepare import ShardPreparer
from raypipe.data.sources import Chunk, plan_chunks, unmatched_files
from raypipe.data.tokenizer import TokenizerSpec, resolve_tokenizer
from raypipe.progress import progress

SHARDS_PER_ACTOR = 4  # a small input is cut so that each actor gets this many shards
MIN_SHARD_BYTES = 256 << 10  # below this a shard's fixed cost (files, a Ray call) would show


def shard_bytes(cfg: DataConfig, input_bytes: int) -> int:
    """Input bytes per shard: `data.chunk_bytes`, or less so that each of the actors has SHARDS_PER_ACTOR shards (not
    below MIN_SHARD_BYTES unless `data.chunk_bytes` itself is)."""
    return min(cfg.chunk_bytes, max(MIN_SHARD_BYTES, input_bytes // (SHARDS_PER_ACTOR * cfg.num_actors) + 1))


class _PrepareActor:
    """Ray Data UDF: one chunk per call, written before the call returns."""

    def __init__(self, cfg_json: str, spec: list[ray.ObjectRef]) -> None:
        cfg = DataConfig.model_validate_json(cfg_json)
        # One tokenizer thread per reserved CPU (the batched call would otherwise use every core), set here before the
        # tokenizer's first batch, not by a runtime_env: an actor with its own runtime_env cannot take one of Ray's
        # idle workers and starts a new one (about 1 s more to each actor's start on 2 cores,
        # docs/benchmarks_log.md).
        os.environ["RAYON_NUM_THREADS"] = str(max(1, math.floor(cfg.cpus_per_actor)))
        os.environ["TOKENIZERS_PARALLELISM"] = "true"
        self.preparer = ShardPreparer(cfg, ray.get(spec[0]))  # the spec's one copy, from the object store
        self.output = PreparedOutput.of(cfg)
        sources = [{"source": s.source_name} for s in cfg.sources]  # at 0 from the start (raypipe.counters)
        self.rows = counter("raypipe_data_rows", "Input rows prepared by the data stage.", ("source",), sources)
        self.kept = counter("raypipe_data_rows_kept", "Prepared rows written.", ("source",), sources)
        self.tokens = counter("raypipe_data_tokens", "Tokens in prepared rows.", ("source",), sources)
        # Reason codes are known only once a row is refused: no series before the first reject.
        self.rejects = Counter("raypipe_data_rejects", "Rejected rows, by reason code.", ("source", "reason"))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list[str]]:
        out = []
        for item in batch["chunk"]:
            chunk = Chunk.from_dict(json.loads(item))
            start = time.perf_counter()
            stats = self.output.write_shard(self.preparer.prepare(chunk))
            seconds = time.perf_counter() - start
            tags = {"source": chunk.source}
            counts = [
                (self.rows, stats["rows_in"], tags),
                (self.kept, stats["rows_kept"], tags),
                (self.tokens, stats["tokens"], tags),
            ]
            counts += [(self.rejects, n, {**tags, "reason": code}) for code, n in stats["rejects_by_code"].items()]
            for metric, n, metric_tags in counts:
                if n > 0:  # Ray counters refuse 0 (a shard whose rows were all rejected keeps none)
                    metric.inc(n, metric_tags)
            out.append(json.dumps({**stats, "actor_seconds": seconds}))
        return {"stats": out}


def run_prepare(cfg: DataConfig) -> dict[str, Any]:
    """Prepare every source into `cfg.output`; resumes a partial run. Returns the manifest."""
    return run_prepare_timed(cfg)[0]


def run_prepare_timed(cfg: DataConfig) -> tuple[dict[str, Any], dict[str, float]]:
    """`run_prepare`, and where this run's time went (`_run_actors`; empty when every shard was done already)."""
    tok, spec = resolve_tokenizer(cfg)
    logger("prepare").info(f"chat template rendered by {spec.template_engine_note}; {spec.incremental_note}")
    deps = dependencies(cfg, spec)  # before planning: it drops cached listings of the inputs
    output = PreparedOutput.of(cfg)
    plan = output.planned_chunks(deps)  # a resumed run keeps its shards
    if plan is None:
        size = sum(i["size"] for i in deps["inputs"].values())
        plan = plan_chunks(cfg.sources, cfg.storage_options, shard_bytes(cfg, size))
    unmatched = unmatched_files(cfg.sources, cfg.storage_options)
    if unmatched:
        shown = ", ".join(unmatched[:20]) + (f" and {len(unmatched) - 20} more" if len(unmatched) > 20 else "")
        logger("prepare").warning(
            f"warning: {len(unmatched)} files under data.sources are not read (another suffix): {shown}"
        )
    output.start({**deps, "chunks": [c.to_dict() for c in plan]}, tok)
    todo = [c for c in plan if not output.is_done(c.index)]
    logger("prepare").info(f"{len(plan)} shards planned, {len(plan) - len(todo)} already complete, {len(todo)} to do")
    timing = _run_actors(cfg, spec, todo) if todo else {}
    output.refresh()  # the actors wrote stats/ from other processes: a listing cached here would hide their files
    end_of_turn = {"token": spec.end_of_turn, "id": spec.end_of_turn_id}
    manifest = output.write_manifest(plan, deps, end_of_turn, unmatched)
    c = manifest["counts"]
    logger("prepare").info(
        f"rows in {c['rows_in']} (+{c['split_extra']} per-turn) = kept {c['rows_kept']} + rejected "
        f"{c['rows_rejected']}; {c['tokens']} tokens, {c['needs_response']} rows need a response; manifest at "
        f"{output.url}/manifest.json"
    )
    return manifest, timing


def _run_actors(cfg: DataConfig, spec: TokenizerSpec, todo: list[Chunk]) -> dict[str, float]:
    """Prepare `todo` on the actor pool; returns where the time went (`wall_s`: the dataset from creation to its
    last shard; `actor_s`: the actors' own work, summed; `actors`: how many ran)."""
    actors = min(cfg.num_actors, len(todo))
    start = time.monotonic()
    ds = ray.data.from_items([{"chunk": json.dumps(c.to_dict())} for c in todo], override_num_blocks=len(todo))
    ds = ds.map_batches(
        _PrepareActor,
        fn_constructor_kwargs={"cfg_json": cfg.model_dump_json(), "spec": [ray.put(spec)]},
        batch_size=1,
        compute=ActorPoolStrategy(min_size=1, max_size=cfg.num_actors, initial_size=actors),
        num_cpus=cfg.cpus_per_actor,
    )
    rows, actor_s = 0, 0.0
    bar = progress(len(todo), "[prepare] shards", "shards")
    for row in ds.iter_rows():
        stats = json.loads(row["stats"])
        rows, actor_s = rows + stats["rows_in"], actor_s + stats["actor_seconds"]
        bar.set_postfix_str(f"{rows / (time.monotonic() - start):.0f} rows/s", refresh=False)
        bar.update()
    bar.close()
    wall = time.monotonic() - start
    logger("prepare").info(
        f"{len(todo)} shards in {wall:.1f} s on {actors} actors: {actor_s:.1f} s of the actors' own work "
        f"({100 * actor_s / (actors * wall):.0f}% of their time), the rest Ray Data and the actors' start-up"
    )
    return {"wall_s": wall, "actor_s": actor_s, "actors": actors}
