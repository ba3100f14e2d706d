"""The offline acceptance estimate: replay vLLM's greedy verification with the drafter outside vLLM.

For a prompt and the target's greedy reply, the drafter proposes a block from
every reply position at once (all positions as anchors, one forward pass);
`accepted[p]` is how many of its block_size - 1 drafted tokens after anchor p
match the target's greedy tokens. vLLM's loop is then walked: the first reply
token comes from the prefill, so the first anchor is that token; from anchor p
accept `accepted[p]` tokens plus the target's bonus token, and continue from
there. Like vLLM, a last block that runs past the reply's end (its stop token
or max_tokens) counts the drafts the target's greedy continuation agrees with:
vLLM verifies them before it truncates the output, so the replay extends each
reply by block_size - 1 greedy tokens. τ = 1 + accepted / steps, the same
quantity vLLM's counters give; a training-time estimate that averages over
random anchors instead weighs positions differently.

The same walk replays vLLM's rejection sampling at temperature > 0 on the
reply vLLM sampled. vLLM's DFlash drafts are greedy (one-hot draft
probabilities), so a drafted token is accepted with probability p_target(d)
and, when rejected, replaced by a sample from the target's distribution
without d: the emitted token equals the draft exactly when it was accepted.
Given the sampled reply, acceptance is therefore determined, and the replay
must agree with vLLM's counters; only the last block's verification beyond
the reply's end differs (the replay extends it greedily).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from raypipe.compat.speculators import block_logits


@dataclass
class Replay:
    steps: int
    accepted: int
    accepted_per_position: list[int]

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    def __add__(self, other: Replay) -> Replay:
        return Replay(
            self.steps + other.steps,
            self.accepted + other.accepted,
            [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)],
        )

    def summary(self) -> dict[str, Any]:
        rates = [a / self.steps for a in self.accepted_per_position] if self.steps else []
        return {
            "steps": self.steps,
            "accepted_tokens": self.accepted,
            "accepted_per_position": self.accepted_per_position,
            "tau": self.tau,
            "acceptance_per_position": rates,
        }


def walk(accepted: np.ndarray, start: int, end: int, width: int) -> Replay:
    """vLLM's greedy loop over the reply [start, end): from anchor p, accept accepted[p] drafts and the bonus token.

    `accepted` must cover the anchors up to end - 2; a block from one of them may run past the end, as in vLLM.
    """
    steps = total = 0
    per_position = [0] * width
    p = start
    while p < end - 1:
        a = int(accepted[p])
        steps += 1
        total += a
        for k in range(a):
            per_position[k] += 1
        p += a + 1
    return Replay(steps, total, per_position)


@torch.no_grad()
def drafted_blocks(
    drafter: torch.nn.Module, input_ids: torch.Tensor, states: torch.Tensor, loss_mask: torch.Tensor
) -> tuple[list[int], torch.Tensor]:
    """The drafter's greedy block after every anchor (each position `loss_mask` marks), in one forward pass:
    (anchors, drafted ids [anchors, block_size - 1]); `states` [T, n_layers, H], as served."""
    t = input_ids.shape[1]
    logits = block_logits(  # the model's own block predictions, without its loss
        drafter,
        hidden_states=states[:, :-1, :].reshape(1, t, -1),
        input_ids=input_ids,
        loss_mask=loss_mask,
        verifier_last_hidden_states=states[:, -1, :].reshape(1, t, -1),
        document_ids=torch.zeros_like(input_ids),
        max_anchors=int(loss_mask.sum()),
    )
    anchors = torch.nonzero(loss_mask[0]).squeeze(-1).tolist()
    drafted = logits.argmax(-1)
    if drafter.d2t is not None:  # a draft vocabulary's ids, as target ids (raypipe.train.vocab)
        drafted = drafted + drafter.d2t[drafted]
    return anchors, drafted.reshape(len(anchors), drafter.block_size)[:, 1:]  # slot 0 is the anchor itself


def _block_inputs(
    drafter: torch.nn.Module, ids: list[int], states: torch.Tensor, prompt_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """drafted_blocks' inputs with an anchor at every reply position but the last: (ids, states, loss mask)."""
    pad = drafter.block_size  # the model takes no anchor in its last block_size positions
    device = next(drafter.parameters()).device
    input_ids = torch.tensor(ids + [ids[-1]] * pad, device=device).unsqueeze(0)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[0, prompt_len : len(ids) - 1] = 1
    hidden = torch.cat([states, states[-1:].expand(pad, -1, -1)]).to(device, torch.float32)
    return input_ids, hidden, loss_mask


@torch.no_grad()
def accepted_at_every_position(
    drafter: torch.nn.Module, ids: list[int], states: torch.Tensor, prompt_len: int
) -> np.ndarray:
    """accepted[p] for every reply position p but the last: drafted tokens after anchor p matching ids."""
    block = drafter.block_size
    n = len(ids)
    anchors, drafted = drafted_blocks(drafter, *_block_inputs(drafter, ids, states, prompt_len))
    accepted = np.zeros(n, dtype=np.int64)
    for row, p in enumerate(anchors):
        truth = ids[p + 1 : p + block]
        run = 0
        for guess, want in zip(drafted[row].tolist(), truth, strict=False):  # a block may run past the end of ids
            if guess != want:
                break
            run += 1
        accepted[p] = run
    return accepted


def load_drafter(drafter: Any, directory: str) -> Any:
    """Exported (trained) weights into a drafter built for the target; the frozen embedding and head stay the
    target's."""
    missing, unexpected = drafter.load_state_dict(load_file(f"{directory}/model.safetensors"), strict=False)
    trainable = {n for n, p in drafter.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ValueError(
            f"{directory} does not fit the drafter built from this config: missing {sorted(trainable & set(missing))}, "
            f"unexpected {unexpected}"
        )
    return drafter.eval()


def replay(drafter: Any, target: Any, prompts: list[list[int]], replies: list[list[int]]) -> Replay:
    """The replay summed over prompts; `target` gives the reference states and greedy continuations
    (TransformersEngine)."""
    width = drafter.block_size - 1
    total = Replay(0, 0, [0] * width)
    for prompt, reply in zip(prompts, replies, strict=True):
        end = len(prompt) + len(reply)
        [ids] = target.continue_greedy([prompt + reply], width)  # what vLLM verifies a last block against
        [states] = target.extract([ids])
        total = total + walk(accepted_at_every_position(drafter, ids, states, len(prompt)), len(prompt), end, width)
    return total


def step_seconds(
    drafters: dict[str, torch.nn.Module], inputs: list[tuple[list[int], torch.Tensor, int]], repeats: int = 3
) -> dict[str, float]:
    """Mean seconds of one drafting pass (drafted_blocks) over `inputs` (ids, states, prompt length) per drafter,
    after a warm-up pass; the drafters take turns, so that the machine's noise falls on each."""
    prepared = {name: [_block_inputs(d, *x) for x in inputs] for name, d in drafters.items()}
    times: dict[str, list[float]] = {name: [] for name in drafters}
    for round_ in range(repeats + 1):
        for name, drafter in drafters.items():
            start = time.perf_counter()
            for x in prepared[name]:
                drafted_blocks(drafter, *x)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: sum(t) / len(t) for name, t in times.items()}
