"""Plain helpers the tests import: configs for CPU tests, the Qwen vocabulary's renderer, free ports, a metrics
scrape, the shard preparer on raw lines. Fixtures and the collection hooks stay in tests/conftest.py."""

from __future__ import annotations

from typing import Any

from raypipe.config import DataConfig, ServeConfig
from raypipe.data.render import ChatRenderer
from raypipe.data.tokenizer import TokenizerSpec, resolve_tokenizer


def data_config(**overrides: Any) -> DataConfig:
    base: dict[str, Any] = {
        "sources": [{"path": "unused"}],
        "output": "unused",
        "tokenizer": "builtin:qwen",
        "chat_template": "qwen_strict",
    }
    return DataConfig.model_validate({**base, **overrides})


def serve_config(model: str, **overrides: Any) -> ServeConfig:
    """A service config for CPU tests: no GPU, no custom resource, a 1 GiB KV cache, small limits."""
    base: dict[str, Any] = {
        "model": model,
        "dtype": "float32",
        "max_model_len": 256,
        "max_sequences": 8,
        "max_batch_tokens": 2048,
        "num_gpus": 0,
        "num_cpus": 0.5,
        "resource": None,
        "kv_cache_gib": 1,
        "enforce_eager": True,
    }
    return ServeConfig.model_validate({**base, **overrides})


_SPECS: dict[tuple, tuple] = {}


def qwen_spec(template: str = "qwen_strict", thinking: bool = False) -> tuple[Any, TokenizerSpec]:
    """(HF tokenizer, spec) for the Qwen vocabulary with a project template; cached per process."""
    key = (template, thinking)
    if key not in _SPECS:
        _SPECS[key] = resolve_tokenizer(data_config(chat_template=template, enable_thinking=thinking))
    return _SPECS[key]


def renderer(template: str = "qwen_strict", thinking: bool = False, placeholder: str = "OK.") -> ChatRenderer:
    _, spec = qwen_spec(template, thinking)
    return ChatRenderer.of(spec, placeholder)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: all bound at once, since a port closed and re-bound can come back (CI saw it)."""
    import socket

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def scrape_metrics(url: str, names: list[str], timeout_s: float = 90) -> dict[str, list[str]]:
    """Prometheus lines for each metric name, polling until all are exported (export is periodic)."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        found = {n: [line for line in body.splitlines() if line.startswith(n + "{")] for n in names}
        if all(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(2)


def prepare_lines(tmp_path: Any, lines: list[bytes], **overrides: Any) -> Any:
    """Run the (Ray-free) shard preparer over raw JSONL lines; returns the ShardResult."""
    from raypipe.data.prepare import ShardPreparer
    from raypipe.data.sources import plan_chunks

    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in lines))
    cfg = data_config(sources=[{"path": str(path)}], output=str(tmp_path / "out"), **overrides)
    _, spec = qwen_spec(cfg.chat_template, cfg.enable_thinking)
    [chunk] = plan_chunks(cfg.sources, {}, 1 << 30)
    return ShardPreparer(cfg, spec).prepare(chunk)


def prepare_records(tmp_path: Any, records: list[Any], **overrides: Any) -> Any:
    import json

    return prepare_lines(tmp_path, [json.dumps(r).encode() for r in records], **overrides)


def local_target(root: Any, scale: float = 1.0) -> Any:
    """A model directory as a target's digest reads it: config.json, safetensors weights (`scale` times a fixed
    pattern: another scale is a retrained model of the same shapes) and a README; returns its path."""
    import json
    from pathlib import Path

    import numpy as np
    from safetensors.numpy import save_file

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "torch_dtype": "bfloat16"}))
    weights = {"embed.weight": np.arange(256, dtype=np.float32).reshape(32, 8), "norm.weight": np.ones(8, np.float32)}
    save_file({k: v * scale for k, v in weights.items()}, str(root / "model.safetensors"))
    (root / "README.md").write_text("a model card\n")
    return root


def hub_snapshot(cache: Any, repo: str, commit: str, ref: str = "main") -> None:
    """`repo` at `commit` in a Hugging Face cache at `cache` (config.json only), with `ref` pointing at it."""
    import json
    from pathlib import Path

    folder = Path(cache) / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    (folder / "snapshots" / commit / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
