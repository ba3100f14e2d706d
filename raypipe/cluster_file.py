"""What a Ray cluster file (cluster.yaml, cluster_separate.yaml) gives each node type: resources, GPU memory,
/dev/shm and the object store.

`raypipe doctor --cluster FILE` checks a recipe against these, and the
tests check the shipped files against the production recipes. Each node type
sets its container's /dev/shm (`--shm-size` in its `docker.worker_run_options`,
the head's in `docker.head_run_options`) and its object store
(`RAYPIPE_OBJECT_STORE_BYTES`, which the `ray start` commands pass as
`--object-store-memory`), so neither is left to Ray's defaults (raypipe.shm).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

# Memory per GPU of the instance types the cluster files use, as nvidia-smi reports it.
GPU_BYTES = {
    "g6e.12xlarge": 46_068 << 20,  # L40S
    "p5.48xlarge": 81_559 << 20,  # H100 SXM
    "p5e.48xlarge": 143_771 << 20,  # H200
    "p5en.48xlarge": 143_771 << 20,  # H200
}
OBJECT_STORE_ENV = "RAYPIPE_OBJECT_STORE_BYTES"
# The AMIs a node type may boot: one pinned id, or the Deep Learning Base OSS Nvidia Driver GPU AMI resolved at launch
# from AWS's public SSM parameter (current releases carry an R580+ driver, which vLLM's CUDA 13 build needs).
AMI = re.compile(
    r"^(ami-[0-9a-f]{8,17}|resolve:ssm:/aws/service/deeplearning/ami/x86_64/"
    r"base-oss-nvidia-driver-gpu-ubuntu-(22|24)\.04/latest/ami-id)$"
)
_SIZE = re.compile(r"^(\d+)([bkmg]?)$")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}  # docker's --shm-size units


@dataclass(frozen=True)
class NodeType:
    name: str
    resources: dict[str, float]
    instance_type: str
    shm_bytes: int
    object_store_bytes: int

    @property
    def gpu_bytes(self) -> int:
        """Memory of one of its GPUs (0 for a CPU node type)."""
        if not self.resources.get("GPU"):
            return 0
        if self.instance_type not in GPU_BYTES:
            raise ValueError(
                f"node type {self.name}: no GPU memory known for {self.instance_type}; add it to "
                "raypipe.cluster_file.GPU_BYTES"
            )
        return GPU_BYTES[self.instance_type]


def _option(options: list[str], flag: str) -> str | None:
    """The value of `--flag=value` (or `--flag value`) among docker run options, the last one given."""
    found = None
    for option in options:
        for part in re.findall(rf"{flag}[= ](\S+)", option):
            found = part.strip("'\"")
    return found


def _shm(options: list[str], name: str) -> int:
    value = _option(options, "--shm-size")
    found = _SIZE.match((value or "").lower())
    if not found:
        raise ValueError(f"node type {name}: its docker run options set no --shm-size (found {value!r})")
    return int(found.group(1)) * _UNITS[found.group(2)]


def _object_store(options: list[str], name: str) -> int:
    value = None
    for option in options:
        for assignment in re.findall(rf"--env[= ]{OBJECT_STORE_ENV}=(\d+)", option):
            value = assignment
    if value is None:
        raise ValueError(f"node type {name}: its docker run options set no --env {OBJECT_STORE_ENV}=BYTES")
    return int(value)


def node_types(cluster: dict[str, Any]) -> list[NodeType]:
    """Every node type of a parsed cluster file, with its /dev/shm and object store as its container starts."""
    docker = cluster.get("docker", {})
    shared = list(docker.get("run_options", []))
    found = []
    for name, spec in cluster["available_node_types"].items():
        if name == cluster["head_node_type"]:
            options = shared + list(docker.get("head_run_options", []))
        else:
            options = shared + list(
                spec.get("docker", {}).get("worker_run_options", docker.get("worker_run_options", []))
            )
        found.append(
            NodeType(
                name,
                dict(spec["resources"]),
                spec["node_config"]["InstanceType"],
                _shm(options, name),
                _object_store(options, name),
            )
        )
    return found


def ami_problems(cluster: dict[str, Any]) -> list[str]:
    """Node types whose ImageId is not an AMI that runs the GPU stack, each with the fix."""
    found = []
    for name, spec in cluster["available_node_types"].items():
        image = spec["node_config"].get("ImageId", "")
        if not AMI.match(image):
            found.append(
                f"node type {name}: ImageId {image or '(none)'!r} is neither a pinned ami-... nor the Deep Learning "
                "Base OSS Nvidia Driver GPU AMI's SSM parameter (`latest_dlami` and no ImageId boot Ray 2.60's "
                "default, AWS Deep Learning AMI (Ubuntu 18.04) V71.0, whose driver cannot run CUDA 13); set it as "
                'cluster.yaml does (README.md, "The cluster\'s AMI")'
            )
    return found


def read_cluster_file(path: str | Path) -> list[NodeType]:
    return node_types(yaml.safe_load(Path(path).read_text()))
