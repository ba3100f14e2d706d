"""cluster.yaml (one 8-GPU node for service and trainer, the default) and cluster_separate.yaml are valid Ray
autoscaler configs that fit raypipe's recipes."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raypipe.config import load_config

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


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_image_is_pinned_and_the_nodes_install_raypipe_with_the_gpu_lock(layout: str) -> None:
    CLUSTER = LAYOUTS[layout]
    assert CLUSTER["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-py311")
    assert any(
        "pip install -c /home/ray/raypipe/locks/gpu.txt" in c and "raypipe[gpu]" in c for c in CLUSTER["setup_commands"]
    )  # the versions of locks/gpu.txt
    assert not any(
        "uninstall" in c for c in CLUSTER["setup_commands"]
    )  # GPU nodes keep torchvision: vLLM imports it for Qwen3.5/3.6
    assert all(
        "--metrics-export-port" in c
        for c in CLUSTER["head_start_ray_commands"][1:] + CLUSTER["worker_start_ray_commands"][1:]
    )
    assert CLUSTER["idle_timeout_minutes"] > 0


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
