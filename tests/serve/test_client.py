"""The client against a real Serve deployment whose replica process is killed mid-stream."""

import os
import signal

import pytest
import torch
from ray import serve

from raypipe.serve.client import HiddenStateClient
from raypipe.serve.deployment import HiddenStateService
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.transport import StateFile, as_tensor
from raypipe.serve.validate import BadRequest
from tests.helpers import serve_config

pytestmark = pytest.mark.integration
LAYERS = [1, 4]


def test_killed_replica_every_batch_returns_once_and_correct(ray_cluster, tiny_target):
    # One request per engine call (budget = one request's tokens), so requests queue on the replica.
    app = HiddenStateService.options(ray_actor_options={"num_cpus": 0.5}).bind(
        serve_config(
            tiny_target,
            engine="transformers",
            layer_ids=LAYERS,
            max_model_len=257,  # sequences of 256 tokens and the one token vLLM would generate after them
            max_batch_tokens=1024,
            max_sequences=64,
            canary="off",
        )
    )
    handle = serve.run(app, name="client_test", route_prefix=None)
    try:
        client = HiddenStateClient(handle, max_in_flight=8, timeout_s=60, retries=8, backoff_s=0.5)
        batches = [[list(range(1000 * i + 7 * j, 1000 * i + 7 * j + 256)) for j in range(4)] for i in range(24)]
        pid = handle.stats.remote().result()["pid"]
        results = []
        for got in client.stream(batches):
            results.append(got)
            if len(results) == 1:
                os.kill(pid, signal.SIGKILL)  # the replica dies with requests queued and in flight
        assert client.resubmitted > 0, "the kill did not hit a request in flight"
        assert handle.stats.remote().result()["pid"] != pid  # Serve replaced the killed replica
        reference = TransformersEngine(tiny_target, tuple(LAYERS))
        assert len(results) == len(batches)
        for batch, got in zip(batches, results):
            for g, r in zip(got, reference.extract(batch), strict=True):
                assert isinstance(g, StateFile)  # same node: handed over as files this process owns
                torch.testing.assert_close(as_tensor(g), r)
        before = client.resubmitted
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            client.extract([[10**9]])
        assert client.resubmitted == before  # the replica's own error is deterministic: raised at once, not retried
        impatient = HiddenStateClient(handle, timeout_s=0.001, retries=1, backoff_s=0.0)
        with pytest.raises(TimeoutError):
            impatient.extract(batches[0])
        assert impatient.resubmitted == 1  # timed out, cancelled, tried again once, then raised
    finally:
        serve.delete("client_test")
