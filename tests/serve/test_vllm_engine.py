"""The real vLLM CPU engine (asynchronous, continuous batching): states equal the transformers reference at every
layer."""

import asyncio

import pytest
import torch

from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.transport import as_tensor, read_array, replica_dir
from raypipe.serve.vllm_args import ENGINE_ENV, engine_args
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


def config(tiny_target):
    return serve_config(tiny_target, layer_ids=list(LAYERS), max_model_len=512)


@pytest.fixture(scope="module")
def engines(tiny_target):
    """The engine lives on one event loop for the module, as in a Serve replica, and its engine-core process starts
    with ENGINE_ENV as a replica's does (this process keeps vLLM's defaults for the plain LLM below)."""
    from raypipe.serve.vllm_engine import VllmEngine

    loop = asyncio.new_event_loop()
    cfg = config(tiny_target)
    directory = replica_dir()

    async def start() -> VllmEngine:
        return VllmEngine(resolve_target(cfg), cfg, directory)

    with pytest.MonkeyPatch.context() as env:
        for name, value in ENGINE_ENV.items():
            env.setenv(name, value)
        vllm = loop.run_until_complete(start())
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
