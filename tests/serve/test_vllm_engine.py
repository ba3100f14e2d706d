"""The real vLLM CPU engine (asynchronous, continuous batching): states equal the transformers reference at every
layer, with the longer prompts prefilled in chunks over several steps (the service's chunked prefill, here with a
step of CHUNK tokens), and equal those of the same engine with chunked prefill off."""

import asyncio
from pathlib import Path

import pytest
import torch

from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.transport import as_tensor, read_array, replica_dir
from raypipe.serve.vllm_args import ENGINE_ENV, engine_args, service_args
from raypipe.target import resolve_target
from tests.helpers import serve_config

pytestmark = pytest.mark.integration

LAYERS = (0, 1, 2, 3, 4)
BATCH = [
    [9707, 1879],
    [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198],
    list(range(100, 137)),
    list(range(5000, 5300, 3)),
]
CHUNK = 32  # vLLM's tokens per step: at least max_sequences (8), below the two longer prompts (37, 100)


def config(tiny_target):
    return serve_config(
        tiny_target, layer_ids=list(LAYERS), max_model_len=512, engine_kwargs={"max_num_batched_tokens": CHUNK}
    )


def start(loop: asyncio.AbstractEventLoop, tiny_target: str, directory: Path):
    """A VllmEngine on `loop`, as in a Serve replica, its engine-core process started with ENGINE_ENV as a replica's
    (this process keeps vLLM's defaults for the plain LLM below)."""
    from raypipe.serve.vllm_engine import VllmEngine

    cfg = config(tiny_target)

    async def started() -> VllmEngine:
        return VllmEngine(resolve_target(cfg), cfg, directory)

    with pytest.MonkeyPatch.context() as env:
        for name, value in ENGINE_ENV.items():
            env.setenv(name, value)
        return loop.run_until_complete(started())


@pytest.fixture(scope="module")
def engines(tiny_target):
    """The engine lives on one event loop for the module, as in a Serve replica."""
    loop = asyncio.new_event_loop()
    directory = replica_dir()
    vllm = start(loop, tiny_target, directory)
    yield loop, vllm, TransformersEngine(tiny_target, LAYERS), directory
    vllm.close()
    loop.close()


def together(loop: asyncio.AbstractEventLoop, coroutines: list) -> list:
    """Run the coroutines concurrently on the engine's loop."""

    async def gather() -> list:
        return list(await asyncio.gather(*coroutines))

    return loop.run_until_complete(gather())


def scale_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max())


def test_states_equal_the_reference_at_every_layer_with_every_request_in_flight_together(engines):
    loop, vllm, hf, directory = engines
    paths = together(loop, [vllm.extract(ids) for ids in BATCH])
    got, ref = [as_tensor(read_array(p, ids)) for p, ids in zip(paths, BATCH)], hf.extract(BATCH)
    for seq, g, r in zip(BATCH, got, ref):
        assert g.shape == r.shape == (len(seq), len(LAYERS), 64) and g.dtype == torch.float32
        for j, layer in enumerate(LAYERS):
            assert scale_error(g[:, j], r[:, j]) < 1e-4, f"layer {layer}"
            assert torch.nn.functional.cosine_similarity(g[:, j], r[:, j], dim=-1).min() > 0.99999
    assert not list(directory.iterdir())  # every file read once and removed


def test_states_of_prompts_prefilled_in_chunks_equal_those_of_whole_prefills(engines, tiny_target, tmp_path):
    """The service's engine splits a prompt longer than a step over several steps; the same engine with chunked prefill
    off (a step then holds a whole prompt) writes the same states, bit for bit in fp32 on vLLM's CPU engine."""
    from raypipe.serve import vllm_engine

    loop, split, _, directory = engines
    scheduler = split.llm.vllm_config.scheduler_config
    assert scheduler.enable_chunked_prefill and scheduler.max_num_batched_tokens == CHUNK < max(map(len, BATCH))

    def whole_prefills(target, cfg):
        whole = {"enable_chunked_prefill": False, "max_num_batched_tokens": cfg.max_model_len}
        return {**service_args(target, cfg), **whole}

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(vllm_engine, "service_args", whole_prefills)
        whole = start(loop, tiny_target, tmp_path)
    try:
        assert not whole.llm.vllm_config.scheduler_config.enable_chunked_prefill
        chunked = together(loop, [split.extract(ids) for ids in BATCH])
        unchunked = together(loop, [whole.extract(ids) for ids in BATCH])
    finally:
        whole.close()
    for ids, a, b in zip(BATCH, chunked, unchunked):
        got, ref = as_tensor(read_array(a, ids)), as_tensor(read_array(b, ids))
        assert got.shape == ref.shape == (len(ids), len(LAYERS), 64)
        assert torch.equal(got, ref), f"{len(ids)} tokens: scale error {scale_error(got, ref):.3g}"  # fp32 on CPU
    assert not list(directory.iterdir()) and not list(tmp_path.iterdir())


def test_greedy_replies_equal_the_reference_and_leave_no_files(engines):
    loop, vllm, hf, directory = engines
    sampling = Sampling(temperature=0.0, max_tokens=12)
    replies = together(loop, [vllm.generate(ids, sampling) for ids in BATCH[:3]])
    assert replies == hf.generate(BATCH[:3], sampling)
    assert not list(directory.iterdir())


def test_greedy_replies_equal_plain_offline_vllm(engines, tiny_target):
    """The hidden-state engine's replies are what an ordinary vLLM deployment of the target says."""
    from vllm import LLM, SamplingParams

    loop, vllm, _, _ = engines
    cfg = config(tiny_target)
    plain = LLM(**engine_args(resolve_target(cfg), cfg))
    try:
        outputs = plain.generate(
            [{"prompt_token_ids": p} for p in BATCH], SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False
        )
        ours = together(loop, [vllm.generate(ids, Sampling(temperature=0.0, max_tokens=12)) for ids in BATCH])
        assert ours == [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        del plain
