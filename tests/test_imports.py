"""The package's shape: no import circle, base modules below the stages, small modules (issue 42).

Imports inside functions count too: a circle through a lazy import is still a circle."""

import ast
from pathlib import Path

import raypipe

PACKAGE = Path(raypipe.__file__).parent
STAGES = ("data", "serve", "train", "eval")
# Modules every stage may use; they import no stage. (cli, pipeline, preflight, doctor, docs and dashboard drive the
# stages, so they import them.)
BASE = (
    "config",
    "target",
    "layout",
    "storage",
    "sizing",
    "heap",
    "node_memory",
    "progress",
    "console",
    "assets",
    "compat",
)
MAX_LINES = 500


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """The raypipe modules `path` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("raypipe"):
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_no_import_circle():
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_base_modules_import_no_stage():
    for name, targets in graph().items():
        top = name.split(".")[1] if "." in name else ""
        if top in BASE:
            stages = sorted(t for t in targets if t.split(".")[1] in STAGES)
            assert not stages, f"{name} is a base module but imports {stages}"


def test_modules_stay_small():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"
