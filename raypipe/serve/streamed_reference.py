"""The canary's transformers reference at any target size: the decoder run one layer at a time, each layer's weights
read from the safetensors files just before it runs and dropped after it.

The model is built on the meta device (no memory); the decoder's own forward
runs with a pre-hook per layer that loads that layer's weights and a hook that
puts them back on the meta device, so every architecture transformers runs
(dense Qwen3, the hybrid Qwen3.6 with its Gated DeltaNet layers and composite
checkpoint) runs its own code, and the states equal the whole model's in the
same dtype (tests/serve/test_streamed_reference.py). Only the rows of the
embedding that the prompts use are read, and only the tapped layers' outputs
are kept. Resident at once: one decoder layer (its safetensors pages mapped,
or its copy where the file's dtype differs), the final norm, the activations of
one batch and the kept states; at Qwen3.6-27B 1.82 GiB over the process's own
instead of the whole model's 54 GB (raypipe.serve.canary.reference_bytes).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from raypipe.serve.hf_engine import decoder_parts
from raypipe.target import check_layer_ids


def _local_dir(model: str) -> Path:
    """The directory of a target's config and safetensors files: a local path, else its Hugging Face cache (filled
    by the serving engine on this node)."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))


def _weight_files(directory: Path) -> dict[str, Path]:
    """Each tensor's file, from the safetensors headers (the index file is optional)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no safetensors files; the canary's reference reads the target's weights there")
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), path))
    return where


class StreamedReference:
    """The states of `layer_ids` (id 0: the embeddings; id i: decoder layer i-1's output) in `dtype`, as
    `TransformersEngine.extract` computes them, with one decoder layer in memory at a time."""

    def __init__(self, model_dir: str, layer_ids: tuple[int, ...], dtype: torch.dtype = torch.bfloat16) -> None:
        directory = _local_dir(model_dir)
        config = AutoConfig.from_pretrained(directory)
        with torch.device("meta"):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        self.decoder, embeddings, self.layers = decoder_parts(self.model)
        check_layer_ids(layer_ids, len(self.layers))
        self.layer_ids = tuple(layer_ids)
        self.dtype = dtype
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        # The rotary frequencies are computed from the config, not stored: built again, on the CPU.
        rotary = self.decoder.rotary_emb
        self.decoder.rotary_emb = type(rotary)(config=rotary.config)
        meta_buffers = [name for name, b in self.decoder.named_buffers() if b.is_meta]
        if meta_buffers:
            raise ValueError(f"{type(self.decoder).__name__}: buffers {meta_buffers} are not stored; cannot stream it")
        self._files = _weight_files(directory)
        self._prefix = self._decoder_prefix(embeddings)
        self._embedding_key = self._prefix + self._relative_name(embeddings.weight)
        # The decoder's own weights outside its layers and embedding (the final norm): small, loaded for good.
        layer_params = {id(p) for p in self.layers.parameters()} | {id(embeddings.weight)}
        own = {n: p for n, p in self.decoder.named_parameters() if id(p) not in layer_params}
        self.decoder.load_state_dict(
            {n: self._read(self._prefix + n, p.dtype) for n, p in own.items()}, strict=False, assign=True
        )
        self._states = torch.empty(0)  # [B, T, len(layer_ids), H] fp32 while extract runs
        for index, layer in enumerate(self.layers):
            layer.register_forward_pre_hook(self._load(index))
            layer.register_forward_hook(self._drop(index + 1))

    def _relative_name(self, param: torch.Tensor) -> str:
        return next(n for n, p in self.decoder.named_parameters() if p is param)

    def _decoder_prefix(self, embeddings: torch.nn.Module) -> str:
        """Where the checkpoint keeps the decoder: `model.` (Qwen3), `model.language_model.` (Qwen3.6's composite
        checkpoint, beside its vision tower and multi-token-prediction layers), found by the embedding's name."""
        name = self._relative_name(embeddings.weight)
        prefixes = [key.removesuffix(name) for key in self._files if key.endswith(name)]
        if len(prefixes) != 1:
            raise ValueError(f"the target's checkpoint has {len(prefixes)} tensors named *{name}; expected one")
        return prefixes[0]

    def _read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        with safe_open(self._files[key], framework="pt") as f:  # the tensor maps its pages until it is dropped
            return f.get_tensor(key).to(dtype)

    def _load(self, index: int) -> Any:
        def hook(layer: torch.nn.Module, _inputs: Any) -> None:
            prefix = f"{self._prefix}layers.{index}."
            state = {n: self._read(prefix + n, p.dtype) for n, p in layer.named_parameters()}
            layer.load_state_dict(state, assign=True)

        return hook

    def _drop(self, layer_id: int) -> Any:
        def hook(layer: torch.nn.Module, _inputs: Any, output: Any) -> None:
            layer.to("meta")
            if layer_id in self.layer_ids:
                self._states[:, :, self.layer_ids.index(layer_id)] = output[0] if isinstance(output, tuple) else output

        return hook

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows of `ids`, read alone (the whole table is 2.5 GB at 27B)."""
        unique, inverse = ids.unique(return_inverse=True)
        with safe_open(self._files[self._embedding_key], framework="pt") as f:
            table = f.get_slice(self._embedding_key)
            rows = torch.cat([table[i : i + 1] for i in unique.tolist()]).to(self.dtype)
        return rows[inverse]

    @torch.no_grad()
    def extract(self, batch: list[list[int]]) -> list[torch.Tensor]:
        """[T, len(layer_ids), H] fp32 per sequence, the sequences right-padded into one batch as
        `TransformersEngine.extract` runs them."""
        lengths = [len(ids) for ids in batch]
        ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.tensor(seq)
            mask[row, : len(seq)] = 1
        embedded = self._embed(ids)
        # Filled as the tapped layers run: no layer's output is held until the end, nor stacked then.
        self._states = torch.empty(*ids.shape, len(self.layer_ids), embedded.shape[-1])
        if 0 in self.layer_ids:
            self._states[:, :, self.layer_ids.index(0)] = embedded
        self.decoder(inputs_embeds=embedded, attention_mask=mask, use_cache=False)
        states, self._states = self._states, torch.empty(0)
        return [states[row, :n].clone() for row, n in enumerate(lengths)]  # the padding is not kept
