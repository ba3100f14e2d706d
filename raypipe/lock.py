"""The lock files in locks/: every version each install kind resolves to, so that every install gets the same.

Without them each install resolved the transitive versions afresh, and a release on PyPI could change what the
tests ran on between two clones of the same commit. `scripts/bootstrap.sh KIND` installs `locks/KIND.txt` exactly
(`uv pip sync`) and then raypipe itself without its dependencies. After an edit of pyproject.toml's dependencies,
`python -m raypipe.lock` writes them again with uv; it keeps each lock's other versions where it can (arguments
go on to `uv pip compile`: `--upgrade` or `--upgrade-package NAME` takes newer releases).

Each lock records a digest of what it was made from (pyproject.toml's dependencies for its kind and the compile
arguments below); `problems` reports a lock whose digest or direct pins differ (tests/test_lock.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The kinds that run on the CPU torch (torch==2.13.0+cpu): pip's find-links, where this kind of machine keeps that
# wheel, must be searched; PyPI has only the CUDA build.
CPU_KINDS = ("tiny", "cpu", "test")
KINDS = (*CPU_KINDS, "gpu")
# Where the project runs: Linux x86_64 (the CPU torch wheel and vLLM's CUDA wheel are built for it), Python 3.11.
TARGET = ("--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28")
# PyPI's torchaudio and torchcodec break `import transformers` beside the CPU torch and nothing needs them; GPU
# installs keep them, as vLLM asks.
CPU_OMITTED = ("--no-emit-package", "torchaudio", "--no-emit-package", "torchcodec")
DIGEST = re.compile(r"^# made from pyproject\.toml's dependencies with sha256 ([0-9a-f]{64})$", re.M)
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", re.M)


def compile_args(kind: str) -> tuple[str, ...]:
    """`uv pip compile`'s arguments for a kind, less the find-links (they are where this machine keeps files)."""
    return (*TARGET, "--extra", kind, *(CPU_OMITTED if kind in CPU_KINDS else ()))


def direct_requirements(kind: str, root: Path = ROOT) -> list[Requirement]:
    """pyproject.toml's requirements for a kind: the base ones and its extra's, with `raypipe[...]` expanded."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    extras, seen = [kind], set()
    while extras:
        extra = extras.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, project["optional-dependencies"][extra]):
            if canonicalize_name(req.name) == project["name"]:
                extras.extend(req.extras)
            else:
                reqs.append(req)
    return reqs


def digest(kind: str, root: Path = ROOT) -> str:
    """What a kind's lock is made from; it changes with any of its requirements, the Python range or the arguments."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    made_from = {
        "requires-python": project["requires-python"],
        "requirements": sorted(str(r) for r in direct_requirements(kind, root)),
        "args": compile_args(kind),
    }
    return hashlib.sha256(json.dumps(made_from, sort_keys=True).encode()).hexdigest()


def problems(root: Path = ROOT) -> list[str]:
    """Why each lock under `root` is stale against its pyproject.toml; empty when all are current."""
    found = []
    for kind in KINDS:
        path = root / "locks" / f"{kind}.txt"
        if not path.exists():
            found.append(f"locks/{kind}.txt is missing")
            continue
        text = path.read_text()
        recorded = DIGEST.search(text)
        if recorded is None or recorded.group(1) != digest(kind, root):
            found.append(f"locks/{kind}.txt was not made from this pyproject.toml")
        locked = {canonicalize_name(name): version for name, version in PIN.findall(text)}
        for req in direct_requirements(kind, root):
            version = locked.get(canonicalize_name(req.name))
            if version is None or not req.specifier.contains(version, prereleases=True):
                found.append(f"locks/{kind}.txt has {req.name} {version}, pyproject.toml asks for {req}")
    return found


def find_links() -> list[str]:
    """pip's find-links, as scripts/bootstrap.sh passes them on: uv reads no pip configuration."""
    config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    return (config.stdout if config.returncode == 0 else "").split() + os.environ.get("PIP_FIND_LINKS", "").split()


def main(uv_args: list[str]) -> None:
    """Write every kind's lock with uv, then record its digest under uv's header."""
    from uv import find_uv_bin

    links = [arg for d in find_links() for arg in ("--find-links", d)]
    for kind in KINDS:
        out = Path("locks") / f"{kind}.txt"
        command = [find_uv_bin(), "pip", "compile", "--quiet", "pyproject.toml", *compile_args(kind)]
        command += [*(links if kind in CPU_KINDS else ()), "--custom-compile-command", "python -m raypipe.lock"]
        subprocess.run([*command, *uv_args, "--output-file", str(out)], cwd=ROOT, check=True)
        first, command_line, body = (ROOT / out).read_text().split("\n", 2)  # uv's header: two lines
        line = f"# made from pyproject.toml's dependencies with sha256 {digest(kind)}"
        (ROOT / out).write_text("\n".join([first, command_line, line, body]))
        print(f"{out}: {len(PIN.findall(body))} packages")


if __name__ == "__main__":
    main(sys.argv[1:])
