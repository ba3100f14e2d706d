"""The client against a real Serve deployment whose replica process is killed mid-stream."""

import os
import signal

import pytest
import torch
from ray import serve

from raypipe.serve.client import HiddenStateClient
from raypipe.serve.deployment import HiddenStateService
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.validate import BadRequest
from tests.conftest import serve_config

pytestmark = pytest.mark.integration
LAYERS = [1, 4]


def test_killed_replica_every_batch_returns_once_and_correct(ray_cluster, tiny_target):
    # One request per engine call (budget = one request's tokens), so requests queue on the replica.
    app = HiddenStateService.options(ray_actor_options={"num_cpus": 0.5}).bind(
        serve_config(tiny_target, engine="transformers", layer_ids=LAYERS, max_batch_tokens=1024, max_sequences=64, canary="off")
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
                torch.testing.assert_close(g.float(), r, rtol=8e-3, atol=1e-5)
        with pytest.raises(BadRequest, match="outside the vocabulary"):
            client.extract([[10**9]])
    finally:
        serve.delete("client_test")
