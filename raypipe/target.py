"""The target model: where `builtin:` names are built, and the dimensions and layer ids every stage reads from it.

Composite targets (Qwen3.5/3.6 are `Qwen3_5ForConditionalGeneration`: a
`text_config` beside a `vision_config`) keep the language model's dimensions in
the text config, so every stage reads them through `TargetShape`, never from
the top-level config. Hybrid targets mix Gated DeltaNet (`linear_attention`)
with full-attention layers; vLLM must run them without prefix caching
(raypipe.serve.vllm_args).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raypipe.assets import TOKENIZER_DIR
from raypipe.config.base import fingerprint

if TYPE_CHECKING:
    from raypipe.config import ServeConfig

# Built in code on first use, cached under $RAYPIPE_CACHE/models; see raypipe/assets.
BUILTIN_TARGETS = {
    "builtin:tiny": "a tiny random Qwen3 (Qwen vocabulary)",
    "builtin:tiny_qwen36": (
        "a tiny random Qwen3.6-architecture model: composite config, Gated DeltaNet + gated attention layers, a vision "
        "tower"
    ),
    "builtin:demo": "a tiny Qwen3 trained in code on structured chat (learnable replies)",
    "builtin:demo_qwen36": "a tiny Qwen3.6-architecture model trained in code on the demo's structured chat",
}


def resolve_model(model: str, key: str = "serve.model") -> str:
    """The directory (or hub id) of a target: `builtin:` targets are built locally on each node, deterministically;
    anything else is returned as it is. `key`: the setting that named it, for the error."""
    if model not in BUILTIN_TARGETS:
        if model.startswith("builtin:"):
            raise ValueError(
                f"{key}: unknown builtin {model!r}; the builtin targets are {', '.join(BUILTIN_TARGETS)}, or give a "
                "path / Hugging Face id"
            )
        return model
    from raypipe.assets.qwen_vocab import cache_root

    name = model.split(":", 1)[1]
    directory = cache_root() / "models" / f"{name}_target"
    if model in ("builtin:demo", "builtin:demo_qwen36"):
        from raypipe.assets.demo_target import build_demo_target

        return str(build_demo_target(directory, arch="qwen36" if model == "builtin:demo_qwen36" else "qwen3"))
    from raypipe.assets.tiny_target import build_tiny_target

    return str(build_tiny_target(directory, arch="qwen36" if model == "builtin:tiny_qwen36" else "qwen3"))


def _builtin_stamp(model: str) -> dict[str, Any]:
    """What a builtin target is built from, as its builder stamps it (a change of the builder bumps its version)."""
    from raypipe.assets.demo_target import DEMO_TARGET_VERSION
    from raypipe.assets.tiny_target import TINY_TARGET_VERSION

    name = model.split(":", 1)[1]
    version = DEMO_TARGET_VERSION if name.startswith("demo") else TINY_TARGET_VERSION
    return {"builtin": model, "version": version, "seed": 0, "arch": "qwen36" if name.endswith("qwen36") else "qwen3"}


# A local target's files read whole up to this size (configs, tokenizers); larger ones are sampled.
_WHOLE_FILE_BYTES = 64 << 20
_SAMPLE_BYTES = 64
_DOCUMENTATION = (".md", ".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")


def _sampled(path: Path, spans: list[tuple[int, int]]) -> str:
    """sha256 of `_SAMPLE_BYTES` at the start, middle and end of each (start, end) byte span of the file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for start, end in spans:
            for at in sorted({start, max(start, (start + end - _SAMPLE_BYTES) // 2), max(start, end - _SAMPLE_BYTES)}):
                f.seek(at)
                digest.update(f.read(min(_SAMPLE_BYTES, end - at)))
    return digest.hexdigest()


def _file_digest(path: Path) -> str:
    size = path.stat().st_size
    if path.suffix == ".safetensors":  # the header (names, dtypes, shapes, offsets), then samples of every tensor
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= size - 8:
                raise ValueError(f"serve.model: {path} is not a safetensors file (its header length is {length})")
            header = f.read(length)
        tensors = [t for name, t in sorted(json.loads(header).items()) if name != "__metadata__"]
        spans = [(8 + length + t["data_offsets"][0], 8 + length + t["data_offsets"][1]) for t in tensors]
        return hashlib.sha256(header).hexdigest() + _sampled(path, spans)
    if size <= _WHOLE_FILE_BYTES:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    return f"{size}:{_sampled(path, [(i * size // 16, (i + 1) * size // 16) for i in range(16)])}"


def _directory_files(directory: Path) -> dict[str, str]:
    """Each file of a model directory, by relative path, but hidden ones (huggingface_hub's download metadata) and
    documentation."""
    files = (
        p
        for p in directory.rglob("*")
        if p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
        and p.suffix.lower() not in _DOCUMENTATION
    )
    return {p.relative_to(directory).as_posix(): _file_digest(p) for p in sorted(files)}


def _hub_commit(model: str, revision: str | None) -> dict[str, Any]:
    """The commit a hub id resolves to (the branch or tag `revision`, default main), where transformers finds its
    config.json (the Hugging Face cache's snapshots/{commit}/; fetched unless offline), and that config's text."""
    from transformers.utils.hub import cached_file, extract_commit_hash

    config = cached_file(model, "config.json", revision=revision)
    commit = extract_commit_hash(config, None)
    if commit is None:
        raise ValueError(
            f"serve.model: {model}'s config.json resolved to {config}, outside a Hugging Face cache's snapshots/, so "
            "its revision is unknown; give serve.model as a local directory instead"
        )
    return {"hub": model, "commit": commit, "config": Path(config).read_text()}


def target_digest(cfg: ServeConfig) -> str:
    """A digest of what determines the served target's weights, so that a target updated under the same
    `serve.model` re-runs what depends on it (the pipeline's fingerprints, the resume check, the state cache and the
    replies' meta): a builtin's builder stamp (nothing is built); a hub id's commit (the revision vLLM gets,
    `serve.engine_kwargs.revision`, else main) and config; a local directory's files: configs and tokenizers whole,
    safetensors by their header and samples of every tensor, other large files by their size and samples.

    The weights are not hashed whole: a 27B target's 54 GB would take minutes of reading on every node at every
    check. A retrained or updated model changes every tensor it touches, which the samples see; nothing depends on
    modification times, so copies of the same weights on several nodes (or copied again) agree."""
    if cfg.model in BUILTIN_TARGETS:
        return fingerprint(_builtin_stamp(cfg.model))
    if Path(cfg.model).is_dir():
        return fingerprint({"files": _directory_files(Path(cfg.model))})
    return fingerprint(_hub_commit(cfg.model, (cfg.engine_kwargs or {}).get("revision")))


@dataclass(frozen=True)
class TargetShape:
    """The language model's dimensions, read from the text config of any Hugging Face target."""

    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]  # per decoder layer: full_attention, linear_attention, sliding_attention, ...
    multimodal: bool  # a vision (or audio) tower beside the language model

    @classmethod
    def of(cls, config: Any) -> TargetShape:
        text = config.get_text_config()
        layers = int(text.num_hidden_layers)
        return cls(
            architecture=(config.architectures or [type(config).__name__])[0],
            num_layers=layers,
            hidden_size=int(text.hidden_size),
            vocab_size=int(text.vocab_size),
            layer_types=tuple(getattr(text, "layer_types", None) or ["full_attention"] * layers),
            multimodal=text is not config,
        )

    @property
    def hybrid(self) -> bool:
        """Some layers keep a recurrent state instead of a KV cache (vLLM's mamba-style cache)."""
        return any(t not in ("full_attention", "sliding_attention") for t in self.layer_types)

    def state_bytes_per_token(self, num_layer_ids: int, dtype_bytes: int = 2) -> int:
        """Bytes of served hidden states per token: one hidden vector per served layer id."""
        return num_layer_ids * self.hidden_size * dtype_bytes


def tokenizer_path(model: str) -> str:
    """Where a target's tokenizer loads from: its `tokenizer/` folder where it has one, else the target itself.

    `AutoTokenizer` picks the tokenizer class by the model type for some types (every `qwen3_5` model gets Qwen's
    byte-level BPE class, whatever tokenizer.json holds), so a target whose tokenizer is another kind (the Qwen3.6
    demo target's word vocabulary) keeps it in a folder without the model's config, where its own class loads. vLLM
    gets it as `tokenizer`."""
    folder = Path(model) / TOKENIZER_DIR
    return str(folder) if folder.is_dir() else model


@dataclass(frozen=True)
class Target:
    """A resolved target: where it is, its shape, and the layer ids the service serves and the drafter reads."""

    name: str  # as configured (serve.model)
    path: str  # local directory or hub id
    shape: TargetShape
    layer_ids: tuple[int, ...]  # the layer-id convention below; the last is the target's last layer for the drafter

    @property
    def tokenizer_path(self) -> str:
        return tokenizer_path(self.path)


def load_target(name: str, path: str, layer_ids: list[int] | None = None) -> Target:
    """The target at `path` (a directory or hub id): its shape read from its config, `layer_ids` checked, or DFlash's
    default when None."""
    from transformers import AutoConfig

    shape = TargetShape.of(AutoConfig.from_pretrained(path))
    return Target(name, path, shape, resolve_layer_ids(layer_ids, shape.num_layers))


def resolve_target(cfg: ServeConfig) -> Target:
    """`serve.model` built or located, then loaded with `serve.layer_ids`: how every stage gets its target."""
    return load_target(cfg.model, resolve_model(cfg.model), cfg.layer_ids)


# Layer ids: which residual stream a layer id means, one convention for every engine.
#
# raypipe uses vLLM's `extract_hidden_states` convention. For a target with L
# decoder layers, a layer id i is in [0, L] and names the residual stream
# *entering* decoder layer i:
#
# - id 0 is the token embeddings;
# - id i (1 <= i < L) is the output of decoder layer i-1, which is
#   transformers' `output_hidden_states[i]`;
# - id L is the output of the last decoder layer *before* the final norm.
#   transformers' last `hidden_states` entry is *after* the final norm, so it is
#   not id L; the reference engine hooks the norm's input instead.
#
# The DFlash drafter consumes the auxiliary layers (speculators'
# `aux_hidden_state_layer_ids`, five spread from layer 1 to L-3 by default)
# concatenated, plus id L as `verifier_last_hidden_states`, to which it applies
# the target's own final norm and LM head. A wrong id does not crash anything;
# acceptance just collapses, so the service's canary compares engines on it.


def check_layer_ids(layer_ids: tuple[int, ...], num_layers: int) -> None:
    """Ids must be distinct, ascending and within [0, num_layers]."""
    if not layer_ids:
        raise ValueError("serve.layer_ids: give at least one layer id")
    if list(layer_ids) != sorted(set(layer_ids)):
        raise ValueError(f"serve.layer_ids must be distinct and ascending, got {list(layer_ids)}")
    if layer_ids[0] < 0 or layer_ids[-1] > num_layers:
        raise ValueError(
            f"serve.layer_ids must lie in [0, {num_layers}] for a target with {num_layers} layers, got "
            f"{list(layer_ids)}"
        )


def default_layer_ids(num_layers: int, num_aux: int = 5) -> tuple[int, ...]:
    """DFlash's default: `num_aux` layers spread evenly from 1 to L-3, then L (the last, pre-norm)."""
    if num_layers < 4:
        raise ValueError(f"a target needs at least 4 layers for DFlash's default layers, got {num_layers}")
    first, last = 1, num_layers - 3
    count = min(num_aux, last - first + 1)
    aux = sorted({round(first + k * (last - first) / max(count - 1, 1)) for k in range(count)})
    return (*aux, num_layers)


def resolve_layer_ids(layer_ids: list[int] | None, num_layers: int) -> tuple[int, ...]:
    """The configured ids (checked), else DFlash's default: what the service serves and the drafter reads."""
    resolved = tuple(layer_ids or default_layer_ids(num_layers))
    check_layer_ids(resolved, num_layers)
    return resolved
