"""A directory on any fsspec filesystem (local, s3://, gs://) with atomic writes.

Every file is written under a temporary name and renamed into place, so a
killed writer leaves complete files or none, and readers never see half a file.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

from fsspec.core import url_to_fs


def absolute(url: str) -> str:
    """Local paths made absolute (Ray Train runs each worker in its own working directory); URLs unchanged."""
    return url if "://" in url else str(Path(url).resolve())


class Storage:
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.root = url_to_fs(self.url, **storage_options)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def child(self, rel: str) -> Storage:
        return Storage(f"{self.url}/{rel}", self.storage_options)

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def write(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def read(self, rel: str) -> bytes:
        with self.fs.open(self.path(rel), "rb") as f:
            return f.read()

    def write_json(self, rel: str, doc: Any) -> None:
        self.write(rel, (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read(rel))

    def glob(self, pattern: str) -> list[str]:
        """Paths relative to this directory, sorted."""
        root = self.root.rstrip("/") + "/"
        return sorted(p[len(root) :] if p.startswith(root) else p for p in self.fs.glob(self.path(pattern)))
