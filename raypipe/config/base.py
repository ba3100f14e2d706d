"""What every config section shares: strict models, the content/execution roles of fields, redaction of
credentials, and the one digest of raypipe's fingerprints."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

REDACTED = "<redacted>"
# speculators' per-position losses (speculators.losses.resolve_loss_config), by the names it takes.
LOSSES = ("ce", "kl_div", "rkl", "jsd", "tv", "nla", "lk_hybrid")
# Names of fsspec options that carry credentials (s3fs key/secret/token, client_kwargs' aws_*_key*, gcsfs token,
# adlfs account_key/sas_token/connection_string, HTTP headers' Authorization, passwords), matched as substrings.
# Cookie headers and Azure's `sas` (a SAS token under its own name) too.
_SECRET_NAMES = (
    "key",
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "auth",
    "signature",
    "connection_string",
    "cookie",
    "sas",
)
# Credentials inside a value, wherever it stands: a URL's password (`https://user:pw@host`, proxies), and the query
# parameters of presigned URLs that sign or carry a credential (S3's X-Amz-Signature/Credential/Security-Token, GCS's
# X-Goog-*, Azure SAS's sig, and any parameter whose name is a secret's).
_URL_PASSWORD = re.compile(r"(?<=://)([^/@:\s]+):([^/@\s]+)@")
_QUERY_SECRET = re.compile(r"(?<=[?&])([^=&#\s]+)=([^&#\s]*)")


def fingerprint(doc: Any) -> str:
    """The one digest of raypipe's fingerprints (output hashes, the pipeline's stages, the tokenizer and template):
    the first 16 hex digits of the sha256 of `doc` as canonical JSON (sorted keys, str() for what JSON lacks), or of
    a string's own text."""
    text = doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def redact(doc: Any) -> Any:
    """A copy of a config dump with every credential replaced by a constant: under `storage_options` by key name, and
    anywhere by value (a URL's password, a presigned URL's signature).

    What is persisted, hashed, logged or shown goes through this (so a rotated secret changes no fingerprint,
    while an endpoint still does); what workers use is the real config.
    """
    return _redact(doc, False)


def _redact(doc: Any, options: bool) -> Any:
    if isinstance(doc, dict):
        return {
            _redact(k, False): REDACTED  # keys too: plan.json keys its inputs by URL
            if options and any(n in str(k).lower() for n in _SECRET_NAMES)
            else _redact(v, options or k == "storage_options")
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [_redact(v, options) for v in doc]
    if isinstance(doc, str) and "://" in doc:
        return _redact_url(doc)
    return doc


def _secret_parameter(name: str) -> bool:
    name = name.lower()
    return (
        name == "sig"
        or name.startswith(("x-amz-", "x-goog-"))
        and not name.endswith(("-date", "-expires"))
        or any(n in name for n in _SECRET_NAMES)
    )


def _redact_url(text: str) -> str:
    """A URL's password and its signing query parameters replaced; the rest (scheme, host, path) kept."""
    text = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return _QUERY_SECRET.sub(lambda m: f"{m[1]}={REDACTED}" if _secret_parameter(m[1]) else m[0], text)


class _Strict(BaseModel):
    """Unknown keys are errors: a typo must not silently fall back to a default."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def public_dump(self, **kwargs: Any) -> dict[str, Any]:
        """model_dump(**kwargs) with credentials redacted: the form to persist, hash, log or show."""
        return redact(self.model_dump(**kwargs))


CONTENT: dict[str, Any] = {"role": "content"}
EXECUTION: dict[str, Any] = {"role": "execution"}


def role(field: FieldInfo) -> str | None:
    """A field's role: `content` (changes what a stage produces: in its fingerprints and resume checks) or
    `execution` (how it runs: parallelism, resources, places, intervals; may change on a resume)."""
    extra = field.json_schema_extra
    return extra.get("role") if isinstance(extra, dict) else None


def content_fields(model: type[BaseModel]) -> list[str]:
    """The names of a config model's content fields."""
    return [name for name, field in model.model_fields.items() if role(field) == "content"]


def content_dump(model: BaseModel) -> dict[str, Any]:
    """The model's content fields, dumped: what its fingerprints cover."""
    return model.model_dump(include=set(content_fields(type(model))))
