"""A directory on any fsspec filesystem (local, s3://, gs://) with atomic writes, and local paths told from URLs.

Every file is written under a temporary name and renamed into place, so a
killed writer leaves complete files or none, and readers never see half a file.
On a local filesystem a file is synced before its rename and its directory
after, so a crash of the machine does not leave a complete-looking name over
bytes that never reached the disk either.

A job that `ray job submit --working-dir` started runs in Ray's copy of that
folder (`job_package`), whose own name changes with every edit and every Ray
session: an input file inside it is named by its place in the package
(`working_dir:data/x.jsonl`, `package_name`), which `filesystem` maps back to
the copy the calling process runs in.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem


def is_url(path: str) -> bool:
    """A URL (`s3://bucket/key`, `file:///tmp/x`) rather than a local path."""
    return "://" in path


def absolute(url: str) -> str:
    """Local paths made absolute (Ray Train runs each worker in its own working directory); URLs unchanged."""
    return url if is_url(url) else str(Path(url).resolve())


WORKING_DIR = "working_dir:"  # prefix of an input file's name inside the job's working-dir package


def job_package(cwd: Path) -> Path | None:
    """The copy of `ray job submit --working-dir` that `cwd` lies in, None elsewhere. Ray (2.60) unpacks it into its
    session's `runtime_resources/working_dir_files/_ray_pkg_<hash of the folder's content>/` on each node, without
    the files' times, and runs the job's driver and workers there; the session's temp folder goes with the next
    `ray start`."""
    parts = cwd.parts
    for i in range(len(parts) - 2):
        if parts[i : i + 2] == ("runtime_resources", "working_dir_files"):
            return Path(*parts[: i + 3])
    return None


def package_name(path: str) -> str:
    """A local file inside the job package this process runs in, named by its place there
    (`working_dir:data/x.jsonl`): the same name in the next job's copy. Anything else is returned as it is."""
    package = job_package(Path.cwd())
    if package is None or is_url(path) or not Path(path).is_relative_to(package):
        return path
    return WORKING_DIR + Path(path).relative_to(package).as_posix()


def local_path(url: str) -> str:
    """The file a `package_name` names in the job package this process runs in; any other URL or path unchanged."""
    if not url.startswith(WORKING_DIR):
        return url
    package = job_package(Path.cwd())
    if package is None:
        raise ValueError(
            f"{url} names a file of a `ray job submit --working-dir` package, but this process runs in none (its "
            f"working directory is {Path.cwd()}): such a name is read by a job's driver and workers, which run in "
            "their copy of the package; outside a job, prepare into another data.output"
        )
    return str(package / url.removeprefix(WORKING_DIR))


def filesystem(url: str, storage_options: dict[str, Any]) -> tuple[AbstractFileSystem, str]:
    """(fsspec filesystem, path without protocol); fsspec reuses instances per process and options. A name of a file
    in the job's package (`package_name`) is the path of that file in this process's copy."""
    return url_to_fs(local_path(url), **resolve_secrets(storage_options))


def resolve_secrets(options: Any, where: str = "storage_options") -> Any:
    """`options` with each `{env: NAME}` replaced by that environment variable and each `{file: PATH}` by the file's
    text (stripped), read where the filesystem is made: so a secret never travels in the config, on a command line
    (`ray job submit`'s entrypoint, `ps`) or in a record, only its reference does."""
    if isinstance(options, dict):
        if len(options) == 1 and next(iter(options)) in ("env", "file"):
            [(kind, name)] = options.items()
            if kind == "env":
                if name not in os.environ:
                    raise ValueError(f"{where}: the environment variable {name} is not set in this process")
                return os.environ[name]
            try:
                return Path(name).read_text().strip()
            except OSError as err:
                raise ValueError(f"{where}: cannot read the secret file {name}: {err.strerror}") from None
        return {k: resolve_secrets(v, f"{where}.{k}") for k, v in options.items()}
    if isinstance(options, list):
        return [resolve_secrets(v, f"{where}.{i}") for i, v in enumerate(options)]
    return options


def file_identity(fs: Any, path: str) -> dict[str, Any]:
    """Size plus ETag (object stores) or modification time (local files): shows a changed file without reading it.

    The cached listing is dropped first, so a file changed by another process since is seen as changed.
    """
    fs.invalidate_cache(path)
    info = fs.info(path)
    etag = info.get("ETag") or info.get("etag")
    if etag:
        return {"size": info["size"], "etag": str(etag).strip('"')}
    if info.get("mtime") is None:
        raise ValueError(
            f"{path}: its filesystem ({type(fs).__name__}) reports neither an ETag nor a modification time, so a "
            "change to it cannot be seen; copy the inputs to a local path or an object store"
        )
    mtime = info["mtime"]
    return {"size": info["size"], "mtime": mtime if isinstance(mtime, (int, float)) else str(mtime)}


def sync_directory(path: str) -> None:
    """Make the names just renamed into local directory `path` durable (a directory is synced as a file is)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def input_identity(url: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """`file_identity` of an input file; for a file of the job's package (a `package_name`), its size and the sha256
    of its content instead: Ray unpacks each copy of the package without the files' times, so a resubmitted job would
    see every input as changed. The package is small, so hashing it on the driver is cheap: Ray refuses a working dir
    whose zip exceeds its gRPC message size (512 MiB in 2.60)."""
    fs, path = filesystem(url, storage_options)
    if not url.startswith(WORKING_DIR):
        return file_identity(fs, path)
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return {"size": fs.size(path), "sha256": digest.hexdigest()}


class Storage:
    def __init__(self, url: str, storage_options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self.fs, self.root = filesystem(self.url, storage_options)
        self.local = isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def child(self, rel: str) -> Storage:
        return Storage(f"{self.url}/{rel}", self.storage_options)

    def refresh(self) -> None:
        """Forget the filesystem's cached listings before a check that other processes' writes must not escape.

        s3fs caches listings per instance and fsspec shares one instance per process and options, so a listing taken
        before another process wrote here would hide its files (s3fs' invalidate_cache(path) drops only the path and
        its parents, not the folders below it: the whole cache goes).
        """
        self.fs.invalidate_cache()

    def exists(self, rel: str) -> bool:
        return self.fs.exists(self.path(rel))

    def write(self, rel: str, data: bytes, durable: bool = True) -> None:
        """`data` at `rel`, whole or not at all. `durable=False` skips the syncs (see the module): for the hidden-state
        cache's file per sequence, where a sync each would hold up training steps."""
        path = self.path(rel)
        directory = path.rsplit("/", 1)[0]
        self.fs.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
            if self.local and durable:
                f.flush()
                os.fsync(f.fileno())
        self.fs.mv(tmp, path)
        if self.local and durable:
            sync_directory(directory)

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
