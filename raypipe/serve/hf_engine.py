"""Reference engine: the target in transformers, hidden states read with forward hooks.

Slow but simple and independent of vLLM. The parity canary's reference computes
the same states with one decoder layer in memory at a time
(raypipe.serve.streamed_reference).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoModelForCausalLM

from raypipe.serve.engine import Sampling
from raypipe.target import check_layer_ids


def decoder_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.ModuleList]:
    """(decoder, token embeddings, decoder layers) of a causal LM, wherever its architecture keeps them.

    Composite targets (Qwen3.5/3.6) load as their language model alone
    (`AutoModelForCausalLM` maps them to the text-only class); `get_decoder()`
    finds the decoder either way.
    """
    decoder = model.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: its decoder {type(decoder).__name__} has no `layers` list; raypipe cannot hook "
            "its hidden states"
        )
    return decoder, model.get_input_embeddings(), layers


class TransformersEngine:
    def __init__(self, model_dir: str, layer_ids: tuple[int, ...], dtype: str = "float32", device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
            .to(self.device)
            .eval()
        )
        self.decoder, embeddings, layers = decoder_parts(self.model)
        check_layer_ids(layer_ids, len(layers))
        self.layer_ids = tuple(layer_ids)
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        self._captured: dict[int, torch.Tensor] = {}
        for layer_id in self.layer_ids:  # id 0: the embeddings; id i: what decoder layer i-1 puts out
            module = embeddings if layer_id == 0 else layers[layer_id - 1]
            module.register_forward_hook(self._capture(layer_id))

    def _capture(self, layer_id: int) -> Any:
        def hook(_module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        lengths = [len(ids) for ids in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(batch):  # right padding: causal attention keeps real tokens exact
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        self._captured.clear()
        self.decoder(input_ids=ids.to(self.device), attention_mask=mask.to(self.device))
        states = torch.stack([self._captured[i] for i in self.layer_ids], dim=2).float().cpu()  # [B, T, n, H]
        return [states[row, :n] for row, n in enumerate(lengths)]

    @torch.no_grad()
    def continue_greedy(self, batch: list[list[int]], n: int) -> list[list[int]]:
        """Each sequence followed by its next n greedy tokens, stop tokens included (no stopping)."""
        out = []
        for seq in batch:
            ids = torch.tensor([seq], device=self.device)
            for _ in range(n):
                ids = torch.cat([ids, self.model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
            out.append(ids[0].tolist())
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        replies = []
        for prompt in prompts:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            kwargs: dict[str, Any] = {"do_sample": sampling.temperature > 0, "max_new_tokens": sampling.max_tokens}
            if sampling.temperature > 0:
                kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
            ids = torch.tensor([prompt], device=self.device)
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
            replies.append(out[0, len(prompt) :].tolist())
        return replies
