"""The layer convention and the transformers reference engine that defines it in code."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from raypipe.serve.engine import Sampling
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.target import check_layer_ids, default_layer_ids

BATCH = [[9707, 1879], [151644, 872, 198, 3838, 374, 220, 17, 10, 17, 30, 151645, 198], list(range(100, 137))]


def test_default_layers_follow_dflash():
    assert default_layer_ids(36) == (1, 9, 17, 25, 33, 36)  # Qwen3-8B
    assert default_layer_ids(64) == (1, 16, 31, 46, 61, 64)  # Qwen3.6-27B-sized
    assert default_layer_ids(4) == (1, 4)


@pytest.mark.parametrize(
    "ids, problem", [((), "at least one"), ((2, 1), "ascending"), ((1, 1), "distinct"), ((0, 5), r"\[0, 4\]")]
)
def test_bad_layer_ids_are_explained(ids, problem):
    with pytest.raises(ValueError, match=problem):
        check_layer_ids(ids, 4)


def test_ids_match_transformers_hidden_states_and_the_last_is_pre_norm(tiny_target):
    engine = TransformersEngine(tiny_target, (0, 1, 2, 3, 4))
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()
    states = engine.extract(BATCH)
    for seq, got in zip(BATCH, states):
        assert got.shape == (len(seq), 5, 64) and got.dtype == torch.float32
        with torch.no_grad():
            ref = model(torch.tensor([seq]), output_hidden_states=True).hidden_states
        for i in range(4):  # id i = hidden_states[i] for i < L
            torch.testing.assert_close(got[:, i], ref[i][0], rtol=1e-5, atol=1e-6)
        assert not torch.allclose(got[:, 4], ref[4][0], atol=1e-3)  # id L is not transformers' post-norm entry ...
        torch.testing.assert_close(model.model.norm(got[:, 4]), ref[4][0], rtol=1e-5, atol=1e-5)  # ... it is its input


def test_batched_extraction_equals_one_by_one(tiny_target):
    engine = TransformersEngine(tiny_target, (1, 4))
    together = engine.extract(BATCH)
    for seq, got in zip(BATCH, together):
        torch.testing.assert_close(got, engine.extract([seq])[0], rtol=1e-5, atol=1e-5)


def test_greedy_generation_is_the_argmax_chain(tiny_target):
    engine = TransformersEngine(tiny_target, (4,))
    [reply] = engine.generate([BATCH[0]], Sampling(max_tokens=6))
    seq = list(BATCH[0])
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(engine.model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert reply == seq[len(BATCH[0]) :]
