"""`data.*`: the inputs and how the data stage prepares them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from raypipe.config.base import CONTENT, EXECUTION, _Strict, content_dump, fingerprint


class SourceConfig(_Strict):
    """One input dataset: a path or glob on any fsspec filesystem."""

    path: str = Field(description="Local path, glob or URL (s3://, gs://) of JSONL, JSONL.gz or Parquet files.")
    name: str | None = Field(
        default=None, description="Dataset name written to the `source` column; default: the file stem of the glob."
    )
    format: Literal["auto", "openai", "sharegpt", "alpaca"] = Field(
        default="auto", description="Input format; `auto` detects it per row from its keys."
    )

    @property
    def source_name(self) -> str:
        """The name, else the last path component that is not a glob, without suffixes."""
        if self.name:
            return self.name
        parts = [p for p in self.path.split("://")[-1].rstrip("/").split("/") if p and not any(c in p for c in "*?[")]
        return parts[-1].split(".")[0] if parts else "data"


class DataConfig(_Strict):
    """Stage 1: raw conversations to token rows with assistant masks."""

    sources: list[SourceConfig] = Field(json_schema_extra=CONTENT, min_length=1, description="Input datasets.")
    output: str = Field(
        json_schema_extra=EXECUTION,
        description="Output directory (local or URL) for shards, manifest.json and rejects/.",
    )
    storage_options: dict[str, Any] = Field(
        json_schema_extra=EXECUTION,
        default_factory=dict,
        description="fsspec options for URLs, e.g. {client_kwargs: {endpoint_url: ...}} for S3. A secret is best "
        "given by reference, {env: NAME} or {file: PATH}, resolved where each filesystem is made: then it is never in "
        "the config, on a command line or in a record. Credentials are redacted wherever the config is written or "
        "shown, by key name here and by value anywhere (a URL's password, a presigned URL's signature).",
    )
    tokenizer: str = Field(
        json_schema_extra=CONTENT,
        description="`builtin:qwen` (Qwen vocabulary built locally), `builtin:demo` (the demo target's) or a path / "
        "Hugging Face id.",
    )
    chat_template: str | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="Builtin template name (qwen_strict, generation_markers, chatml) or a .jinja path; default: the "
        "tokenizer's own.",
    )
    enable_thinking: bool = Field(
        json_schema_extra=CONTENT,
        default=False,
        description="Passed to the template; with false the generation prompt ends in an empty think block.",
    )
    end_of_turn: str | None = Field(
        json_schema_extra=CONTENT,
        default=None,
        description="The special token that ends an assistant turn (supervised, and where replies stop); default: "
        "probed from the template, never the tokenizer's eos.",
    )
    placeholder_reply: str = Field(
        json_schema_extra=CONTENT,
        default="OK.",
        min_length=1,
        description="Text of the injected placeholder reply; never trained on.",
    )
    max_length: int = Field(json_schema_extra=CONTENT, default=3072, gt=0, description="Maximum tokens per row.")
    overlength: Literal["truncate", "reject"] = Field(
        json_schema_extra=CONTENT,
        default="truncate",
        description="Rows over max_length: keep the first max_length tokens, or reject the row.",
    )
    max_row_bytes: int = Field(
        json_schema_extra=CONTENT,
        default=8 << 20,
        gt=0,
        description="Raw input rows larger than this are rejected unparsed.",
    )
    chunk_bytes: int = Field(
        json_schema_extra=CONTENT,
        default=16 << 20,
        gt=0,
        description="Most input bytes per output shard (JSONL, gzip by decompressed bytes, Parquet by row groups, "
        "never cut): large files are cut into shards, small files of one source share one; a smaller input is cut "
        "finer, so that each actor has 4 shards (at least 256 KiB each).",
    )
    batch_rows: int = Field(
        json_schema_extra=EXECUTION, default=1024, gt=0, description="Rows per batched tokenizer call."
    )
    num_actors: int = Field(
        json_schema_extra=EXECUTION, default=2, gt=0, description="CPU actors that prepare shards in parallel."
    )
    cpus_per_actor: float = Field(
        json_schema_extra=EXECUTION, default=1.0, gt=0, description="Logical CPUs reserved per actor."
    )

    def output_hash(self) -> str:
        """Hash of the content fields (what changes the prepared rows; not where they go or the parallelism)."""
        return fingerprint(content_dump(self))
