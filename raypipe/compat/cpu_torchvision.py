"""Make PyPI's torchvision importable beside the CPU build of torch (CPU installs only).

vLLM's Qwen3.5/3.6 module imports transformers' Qwen2-VL image processor, which
imports `torchvision.transforms.v2`. PyPI's torchvision wheel is built for the
CUDA torch: its C++ ops (`_C.so`) cannot load beside `torch==2.13.0+cpu`.
torchvision copes with that everywhere but in two fake-kernel registrations
(`torchvision::nms`, `torchvision::qnms`) that assume the ops exist, so the
import dies with "operator torchvision::nms does not exist".

The hook below runs once, just before torchvision is first imported: if the C++
ops cannot load, it defines those two schemas (no kernels), and the pure-Python
parts of torchvision import as usual. raypipe never calls the ops. Where the ops
load (GPU nodes keep the real torchvision and do not install the hook), it does
nothing.

`python -m raypipe.compat.cpu_torchvision` installs the hook into the running
environment as a `.pth` file, so it is active in every process started from it,
vLLM's engine processes and Ray's workers included; `scripts/bootstrap.sh` does
this for CPU installs. It costs nothing until torchvision is imported.

Relies on (torchvision 0.28.0 from PyPI beside torch 2.13.0+cpu): torchvision's import needs only the schemas of
`torchvision::nms` and `torchvision::qnms` when its `_C` library cannot load. On an upgrade:
tests/compat/test_cpu_torchvision.py (it also checks that the import still fails without the hook; when it no
longer does, the hook can go).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import sysconfig
from pathlib import Path
from typing import Any

PTH_NAME = "raypipe-cpu-torchvision.pth"
# The ops torchvision registers fake kernels for without checking that its C++ library loaded.
MISSING_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_defined: list[Any] = []  # the torch.library.Library holding the schemas; dropping it would unregister them


def define_missing_ops(package_dir: Path) -> bool:
    """Load torchvision's C++ ops, else define the schemas its import needs; True when schemas were defined."""
    import torch

    try:
        torch.ops.load_library(str(next(package_dir.glob("_C*.so"))))
        return False
    except (StopIteration, OSError):
        pass
    library = torch.library.Library("torchvision", "FRAGMENT")
    for schema in MISSING_OPS:
        library.define(schema)
    _defined.append(library)
    return True


class _DefineOpsFirst(importlib.abc.Loader):
    """torchvision's own loader, preceded by `define_missing_ops` when the package is executed."""

    def __init__(self, loader: importlib.abc.Loader, package_dir: Path) -> None:
        self.loader, self.package_dir = loader, package_dir

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        define_missing_ops(self.package_dir)
        module.__loader__ = module.__spec__.loader = self.loader  # from here on torchvision is as if imported plainly
        self.loader.exec_module(module)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Gives `import torchvision` a loader that runs `define_missing_ops` first.

    Only an import pays: `importlib.util.find_spec("torchvision")`, which `import transformers` calls to see what
    is installed, gets the spec and imports nothing (defining the ops imports torch, 2 s of every process that
    imports transformers and not torch, the data stage's driver among them).
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision" or "torchvision" in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.origin and spec.loader is not None:
            spec.loader = _DefineOpsFirst(spec.loader, Path(spec.origin).parent)
        return spec


def install_hook() -> None:
    """Called at interpreter start by the .pth file."""
    if "torchvision" not in sys.modules and not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())


def install_pth() -> Path:
    """Write the .pth file into this environment's site-packages."""
    path = Path(sysconfig.get_paths()["purelib"]) / PTH_NAME
    path.write_text(
        "import importlib.util; importlib.util.find_spec('raypipe') and "
        "__import__('raypipe.compat.cpu_torchvision').compat.cpu_torchvision.install_hook()\n"
    )
    return path


if __name__ == "__main__":
    print(f"raypipe: torchvision import hook for the CPU torch installed at {install_pth()}")
