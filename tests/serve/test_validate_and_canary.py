import pytest
import torch

from raypipe.serve.canary import CANARY_PROMPTS, canary_prompts, compare_states
from raypipe.serve.hf_engine import TransformersEngine
from raypipe.serve.validate import BadRequest, validate_batch

LIMITS = {"vocab_size": 100, "max_len": 8, "max_sequences": 3, "max_tokens": 12}


@pytest.mark.parametrize(
    "batch, problem",
    [
        ([], "non-empty list"),
        ("1 2 3", "non-empty list"),
        ([[1], [2], [3], [4]], "4 sequences"),
        ([[1], 5], "sequence 1 must be a list"),
        ([[1], []], "sequence 1 is empty"),
        ([list(range(9))], r"9 tokens; the engine takes at most 7 \(serve.max_model_len=8"),
        ([list(range(8))], r"8 tokens; the engine takes at most 7"),  # vLLM refuses a prompt of max_model_len tokens
        ([[1, 2.0]], "token 1 must be an int, got float"),
        ([[1, True]], "token 1 must be an int, got bool"),
        ([[1, 100]], r"100 is outside the vocabulary \[0, 100\)"),
        ([[1, -1]], "outside the vocabulary"),
        ([[1] * 7, [2] * 6], "13 tokens in one request"),
    ],
)
def test_bad_requests_are_named(batch, problem):
    with pytest.raises(BadRequest, match=problem):
        validate_batch(batch, **LIMITS)


def test_good_request_passes():
    assert validate_batch([[1, 2], [99]], **LIMITS) == [[1, 2], [99]]


def test_canary_prompts_fold_into_a_small_vocabulary():
    assert canary_prompts(151_936) == [list(p) for p in CANARY_PROMPTS]
    assert all(0 <= t < 65 for p in canary_prompts(65) for t in p)
    # Cut to what the engine takes: a prompt of serve.max_model_len tokens would be vLLM's error, not the canary's.
    assert max(map(len, canary_prompts(151_936))) > 100 and max(map(len, canary_prompts(151_936, 100))) == 100


def test_canary_passes_on_equal_engines_and_names_the_wrong_layer(tiny_target):
    prompts = [list(p) for p in CANARY_PROMPTS]
    engine = TransformersEngine(tiny_target, (1, 2, 4))
    ref = engine.extract(prompts)
    same = compare_states([s.bfloat16() for s in ref], ref, (1, 2, 4))
    assert same.ok, same.message()
    shifted = TransformersEngine(tiny_target, (1, 3, 4)).extract(prompts)  # layer 2 read one layer too late
    report = compare_states(shifted, ref, (1, 2, 4))
    assert not report.ok
    assert "layer 2" in report.message() and "layer 1:" not in report.message() and "layer 4" not in report.message()
    with torch.no_grad():  # the final norm applied to id L: transformers' last hidden state, the classic mistake
        post_norm = [torch.stack([s[:, 0], s[:, 1], engine.model.model.norm(s[:, 2])], dim=1) for s in ref]
    report = compare_states(post_norm, ref, (1, 2, 4))
    assert not report.ok and "layer 4" in report.message() and "layer 2" not in report.message()
