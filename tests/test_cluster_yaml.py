"""cluster.yaml (one 8-GPU node for service and trainer, the default) and cluster_separate.yaml are valid Ray
autoscaler configs that fit raypipe's recipes."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raypipe.cluster_file import ami_problems, node_types
from raypipe.config import load_config
from raypipe.shm import shm_shortfall
from raypipe.sizing import state_files_peak
from raypipe.target import resolve_target

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {name: yaml.safe_load((ROOT / name).read_text()) for name in ("cluster.yaml", "cluster_separate.yaml")}
CLUSTER = LAYOUTS["cluster.yaml"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_shipped_schema_and_rays_own_validation_accept_it(layout: str) -> None:
    schema = json.loads((Path(ray.autoscaler.__path__[0]) / "ray-schema.json").read_text())
    jsonschema.validate(LAYOUTS[layout], schema)
    validate_config(
        prepare_config(copy.deepcopy(LAYOUTS[layout]))
    )  # Ray's defaults merged in, then its semantic checks


def test_a_typo_is_caught_by_the_validation() -> None:
    broken = copy.deepcopy(CLUSTER)
    broken["available_node_types"]["gpu"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))


def test_the_default_layout_is_the_seeds_one_node() -> None:
    """Service and trainer share one 8-GPU node type (4 GPUs each), so states move through shared memory."""
    [gpu] = [t for t in CLUSTER["available_node_types"].values() if "GPU" in t["resources"]]
    assert gpu["resources"]["GPU"] == 8 and gpu["resources"]["serve_gpu"] == gpu["resources"]["train_gpu"] == 4
    assert gpu["node_config"]["InstanceType"] in ("p5en.48xlarge", "p5e.48xlarge")  # 8 x H200


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_node_types_fit_the_recipes(layout: str) -> None:
    cluster = LAYOUTS[layout]
    types = cluster["available_node_types"]
    assert types[cluster["head_node_type"]]["resources"] == {"CPU": 0}  # the head does no work
    for cpu_only in (
        t for name, t in types.items() if name != cluster["head_node_type"] and "GPU" not in t["resources"]
    ):
        assert cpu_only["min_workers"] == 0  # the data stage's nodes scale from zero
    for node in (t for t in types.values() if "GPU" in t["resources"]):
        # Serve replicas and Train workers take GPUs by their own custom resource: together never more than the node
        # has.
        assert node["resources"].get("serve_gpu", 0) + node["resources"].get("train_gpu", 0) == node["resources"]["GPU"]
    for recipe in ("qwen3_8b", "qwen36_27b"):
        cfg = load_config(recipe)
        serve_units = sum(t["resources"].get(cfg.serve.resource, 0) * t.get("max_workers", 0) for t in types.values())
        train_units = [t["resources"].get(cfg.train.run.resource, 0) for t in types.values()]
        assert serve_units >= cfg.serve.max_replicas * cfg.serve.num_gpus, (layout, recipe)
        assert max(train_units) >= cfg.train.run.num_workers, (
            layout,
            recipe,
        )  # the placement group fits on one node (PACK)
        assert all(
            t["resources"].get(cfg.serve.resource, 0) % cfg.serve.num_gpus == 0 for t in types.values()
        )  # no replica split across nodes


def _worker_setup(cluster: dict, name: str) -> list[str]:
    """The setup commands a node type runs: its own worker_setup_commands, else the global ones (Ray's rule)."""
    spec = cluster["available_node_types"][name]
    if name == cluster["head_node_type"]:
        return cluster["setup_commands"] + cluster.get("head_setup_commands", [])
    return spec.get("worker_setup_commands", cluster["setup_commands"] + cluster.get("worker_setup_commands", []))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_images_are_pinned_and_only_gpu_nodes_install_vllm_and_cuda_torch(layout: str) -> None:
    cluster = LAYOUTS[layout]
    docker = cluster["docker"]
    assert docker["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    for name, spec in cluster["available_node_types"].items():
        gpu = "GPU" in spec["resources"]
        image = (
            docker["head_image"]
            if name == cluster["head_node_type"]
            else spec.get("docker", {}).get("worker_image", docker["image"])
        )
        assert image == f"rayproject/ray:{ray.__version__}-py311-{'gpu' if gpu else 'cpu'}", (layout, name)
        [install] = [c for c in _worker_setup(cluster, name) if "pip install" in c]
        assert "-c /home/ray/raypipe/locks/gpu.txt" in install  # the versions of locks/gpu.txt
        assert ("raypipe[gpu]" in install) == gpu, (layout, name)  # vLLM (CUDA) on GPU nodes only
        assert ("download.pytorch.org/whl/cpu" in install) != gpu, (layout, name)  # torch's CPU build elsewhere
    assert not any(
        "uninstall" in c for name in cluster["available_node_types"] for c in _worker_setup(cluster, name)
    )  # GPU nodes keep torchvision: vLLM imports it for Qwen3.5/3.6
    assert all(
        "--metrics-export-port" in c and "--object-store-memory=$RAYPIPE_OBJECT_STORE_BYTES" in c
        for c in cluster["head_start_ray_commands"][1:] + cluster["worker_start_ray_commands"][1:]
    )
    assert cluster["idle_timeout_minutes"] > 0


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_checkout_is_synced_without_the_venv_runs_and_caches(layout: str) -> None:
    cluster = LAYOUTS[layout]
    assert cluster["file_mounts"]["/home/ray/raypipe"] == "."
    assert cluster["rsync_filter"] == [".gitignore"]  # whatever git ignores stays on the operator's machine
    for path in (".git", ".venv", "runs", "**/__pycache__", ".pytest_cache", ".hypothesis"):
        assert path in cluster["rsync_exclude"], (layout, path)
    ignored = (ROOT / ".gitignore").read_text().split()
    assert {".venv/", "/runs/", "__pycache__/"} <= set(ignored)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_node_boots_an_ami_that_runs_cuda_13(layout: str) -> None:
    """Never Ray's default: `latest_dlami` (or no ImageId) is replaced by Ray's own AWS provider with a Deep Learning
    AMI on Ubuntu 18.04 whose driver predates CUDA 13."""
    from ray.autoscaler._private.aws.config import DEFAULT_AMI_NAME, _check_ami

    cluster = copy.deepcopy(LAYOUTS[layout])
    assert ami_problems(cluster) == []
    images = {name: t["node_config"]["ImageId"] for name, t in cluster["available_node_types"].items()}
    _check_ami(cluster)  # what `ray up` does first: an ImageId of ours is left as it is
    assert {name: t["node_config"]["ImageId"] for name, t in cluster["available_node_types"].items()} == images
    assert all("base-oss-nvidia-driver-gpu-ubuntu-24.04" in image for image in images.values())

    old = copy.deepcopy(LAYOUTS[layout])
    old["available_node_types"]["head"]["node_config"]["ImageId"] = "latest_dlami"
    del old["available_node_types"]["cpu"]["node_config"]["ImageId"]
    assert [p.split(":")[0] for p in ami_problems(old)] == ["node type head", "node type cpu"]
    _check_ami(old)
    assert "Ubuntu 18.04" in DEFAULT_AMI_NAME and old["available_node_types"]["head"]["node_config"][
        "ImageId"
    ].startswith("ami-")  # what it would have booted


def _driver_check(cluster: dict, name: str, tmp_path: Path, driver: str | None) -> subprocess.CompletedProcess:
    """The node type's initialization command on a host whose nvidia-smi reports `driver` (None: it fails)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "nvidia-smi"
    fake.write_text("#!/bin/sh\n" + (f"printf '{driver}\\n{driver}\\n'\n" if driver else "exit 9\n"))  # 2 GPUs
    fake.chmod(0o755)
    [command] = cluster["available_node_types"][name]["initialization_commands"]
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, check=False)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_gpu_node_whose_driver_cannot_run_cuda_13_fails_its_setup(layout: str, tmp_path: Path) -> None:
    cluster = LAYOUTS[layout]
    for name in (n for n, t in cluster["available_node_types"].items() if "GPU" in t["resources"]):
        assert _driver_check(cluster, name, tmp_path, "580.105.08").returncode == 0
        assert _driver_check(cluster, name, tmp_path, "595.91.07").returncode == 0
        old = _driver_check(cluster, name, tmp_path, "470.57.02")
        assert old.returncode != 0 and "NVIDIA driver 470.57.02 < 580" in old.stdout
        assert _driver_check(cluster, name, tmp_path, None).returncode != 0  # no working nvidia-smi: no GPUs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("recipe", ["qwen3_8b", "qwen36_27b"])
def test_the_state_files_fit_beside_the_object_store_on_every_gpu_node(layout: str, recipe: str, tmp_path) -> None:
    """/dev/shm of each node type holds its object store and, where replicas write states, the recipe's peak of state
    files (raypipe.sizing.state_files_peak), as the replicas check at start (raypipe.shm)."""
    from raypipe.assets.published import write_config_dir

    directory = write_config_dir(load_config(recipe).serve.model, tmp_path)
    cfg = load_config(recipe, [f"serve.model={directory}"])
    target = resolve_target(cfg.serve)
    peak = state_files_peak(cfg, target.shape.state_bytes_per_token(len(target.layer_ids)))
    assert 2 << 30 < peak < 4 << 30  # 2.81 GiB (Qwen3-8B) and 3.52 GiB (Qwen3.6-27B)
    for node in node_types(LAYOUTS[layout]):
        assert node.object_store_bytes <= 0.95 * node.shm_bytes, node  # Ray keeps the store in /dev/shm
        if cfg.serve.resource in node.resources:
            assert shm_shortfall(node.shm_bytes, node.object_store_bytes, peak) is None, (node, peak)
    small = node_types(LAYOUTS[layout])[-1]
    message = shm_shortfall(small.object_store_bytes + peak // 2, small.object_store_bytes, peak)
    assert message is not None and "--shm-size=" in message and "train.states.prefetch" in message
    # An object store larger than /dev/shm is not there (Ray falls back to /tmp): the state files have all of it.
    assert shm_shortfall(1 << 30, 5 << 30, 1 << 29) is None and shm_shortfall(1 << 30, 5 << 30, 2 << 30) is not None


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_token_auth_on_every_node_and_the_dashboard_on_loopback(layout: str) -> None:
    """Whoever reaches the dashboard can submit jobs: every `ray start` requires Ray's token, read from a file that
    file_mounts copy from the operator's machine (never in the YAML), and the dashboard listens on loopback only
    (`ray dashboard` tunnels to it over SSH)."""
    cluster, text = LAYOUTS[layout], (ROOT / layout).read_text()
    starts = [c for c in cluster["head_start_ray_commands"] + cluster["worker_start_ray_commands"] if "ray start" in c]
    assert len(starts) == 2
    for command in starts:
        env = dict(re.findall(r"\b(RAY_AUTH_[A-Z_]+)=(\S+)", command))
        assert env.get("RAY_AUTH_MODE") == "token", command
        assert "RAY_AUTH_TOKEN" not in env  # the token itself never on a command line
        assert (
            cluster["file_mounts"][env["RAY_AUTH_TOKEN_PATH"]] == "~/.ray/auth_token"
        )  # what `ray get-auth-token --generate` writes
    [head] = [c for c in starts if "--head" in c]
    assert re.findall(r"--dashboard-host[= ](\S+)", head) == ["127.0.0.1"]
    assert "RAY_AUTH_MODE=disabled" not in text and "0.0.0.0" not in text
    assert "RAY_AUTH_MODE=token ray job submit" in text  # the documented client sends the token
    assert not re.search(r"\b[0-9a-fA-F]{32,}\b", text), "a literal token in the cluster config"
