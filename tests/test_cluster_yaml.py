"""cluster.yaml is a valid Ray autoscaler config that fits raypipe's recipes."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from raypipe.config import load_config

CLUSTER = yaml.safe_load((Path(__file__).resolve().parents[1] / "cluster.yaml").read_text())


def test_the_shipped_schema_and_rays_own_validation_accept_it() -> None:
    schema = json.loads((Path(ray.autoscaler.__path__[0]) / "ray-schema.json").read_text())
    jsonschema.validate(CLUSTER, schema)
    validate_config(prepare_config(copy.deepcopy(CLUSTER)))  # Ray's defaults merged in, then its semantic checks


def test_a_typo_is_caught_by_the_validation() -> None:
    broken = copy.deepcopy(CLUSTER)
    broken["available_node_types"]["serve_gpu"]["max_worker"] = 4
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(broken))


def test_node_types_fit_the_recipes() -> None:
    types = CLUSTER["available_node_types"]
    assert types[CLUSTER["head_node_type"]]["resources"] == {"CPU": 0}  # the head does no work
    for cpu_only in (t for name, t in types.items() if name != CLUSTER["head_node_type"] and "GPU" not in t["resources"]):
        assert cpu_only["min_workers"] == 0  # the data stage's nodes scale from zero
    for recipe in ("qwen3_8b", "qwen36_27b"):
        cfg = load_config(recipe)
        [serve_node] = [t for t in types.values() if cfg.serve.resource in t["resources"]]
        [train_node] = [t for t in types.values() if cfg.train.resource in t["resources"]]
        assert serve_node is not train_node and cfg.serve.resource not in train_node["resources"]
        per_node = serve_node["resources"]["GPU"] // cfg.serve.num_gpus
        assert per_node >= 1 and per_node * serve_node["max_workers"] >= cfg.serve.max_replicas
        assert serve_node["resources"][cfg.serve.resource] == serve_node["resources"]["GPU"]
        assert train_node["resources"]["GPU"] * train_node["max_workers"] >= cfg.train.num_workers
        assert train_node["resources"][cfg.train.resource] == train_node["resources"]["GPU"]


def test_the_image_is_pinned_and_the_nodes_install_raypipe() -> None:
    assert CLUSTER["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-py311")
    assert any("pip install" in c and "raypipe" in c for c in CLUSTER["setup_commands"])
    assert not any("uninstall" in c for c in CLUSTER["setup_commands"])  # GPU nodes keep torchvision: vLLM imports it for Qwen3.5/3.6
    assert all("--metrics-export-port" in c for c in CLUSTER["head_start_ray_commands"][1:] + CLUSTER["worker_start_ray_commands"][1:])
    assert CLUSTER["idle_timeout_minutes"] > 0
