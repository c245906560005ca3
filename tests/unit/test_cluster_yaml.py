"""cluster.yaml passes Ray's own autoscaler config schema and Ray's AWS network-interface rules,
offline (no cloud credentials), and has the shape the docs promise: an on-demand head that
never trains, spot GPU workers preferred over an on-demand floor of the same type, EFA."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def config() -> dict:
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(yaml.safe_load(CLUSTER_YAML.read_text()))
    validate_config(prepared)  # jsonschema against ray/autoscaler/ray-schema.json
    return prepared


def test_every_gpu_node_type_passes_rays_efa_interface_rules(config):
    from ray.autoscaler._private.aws.config import (
        _configure_subnets_and_groups_from_network_interfaces as check_interfaces,
    )

    for name in ("gpu-spot", "gpu-ondemand"):
        node = config["available_node_types"][name]["node_config"]
        interfaces = node["NetworkInterfaces"]
        assert [i["InterfaceType"] for i in interfaces] == ["efa"] * 4, name
        assert sorted(i["NetworkCardIndex"] for i in interfaces) == [0, 1, 2, 3], name
        assert check_interfaces(node)["SubnetIds"], name  # raises on a malformed interface


def test_the_head_is_on_demand_and_holds_no_gpu(config):
    head = config["available_node_types"][config["head_node_type"]]
    assert head["resources"]["GPU"] == 0 and head["max_workers"] == 0
    assert "InstanceMarketOptions" not in head["node_config"]
    assert any("--num-gpus=0" in cmd for cmd in config["head_start_ray_commands"])


def test_spot_workers_with_an_on_demand_floor_of_the_same_type(config):
    types = config["available_node_types"]
    spot, floor = types["gpu-spot"], types["gpu-ondemand"]
    assert spot["node_config"]["InstanceMarketOptions"]["MarketType"] == "spot"
    assert "InstanceMarketOptions" not in floor["node_config"]
    assert spot["node_config"]["InstanceType"] == floor["node_config"]["InstanceType"]
    assert spot["resources"] == floor["resources"] and spot["resources"]["GPU"] == 8
    assert floor["min_workers"] >= 1 and spot["min_workers"] <= spot["max_workers"]
    assert spot["max_workers"] + floor["max_workers"] <= config["max_workers"]
    assert config["idle_timeout_minutes"] > 0


def test_rays_scheduler_takes_spot_first_and_the_floor_type_when_spot_is_full(config):
    from ray.autoscaler._private.node_provider_availability_tracker import (
        NodeAvailabilitySummary,
    )
    from ray.autoscaler._private.resource_demand_scheduler import (
        _default_utilization_scorer,
        get_nodes_for,
    )

    scorer = functools.partial(
        _default_utilization_scorer, node_availability_summary=NodeAvailabilitySummary({})
    )
    types, head = config["available_node_types"], config["head_node_type"]
    one_node = [{"GPU": 8}]
    assert dict(get_nodes_for(types, {}, head, 1, one_node, scorer)[0]) == {"gpu-spot": 1}
    spot_full = {"gpu-spot": types["gpu-spot"]["max_workers"]}
    assert dict(get_nodes_for(types, spot_full, head, 1, one_node, scorer)[0]) == {
        "gpu-ondemand": 1
    }


def test_workers_get_efa_and_the_package(config):
    options = " ".join(config["docker"]["worker_run_options"])
    assert "--device=/dev/infiniband" in options and "FI_PROVIDER=efa" in options
    setup = config["setup_commands"]
    assert "torch" in setup[0] and "download.pytorch.org/whl/cu" in setup[0]  # CUDA torch first
    mounted = next(iter(config["file_mounts"]))
    assert any(f"pip install -q -e {mounted}" in cmd for cmd in setup)
    assert ".venv" in config["rsync_exclude"]


def test_token_auth_on_every_node_and_the_job_api_on_loopback_only(config):
    """What tests/ray/test_cluster_auth.py runs for real; here, that the commands say it."""
    (head_start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    (worker_start,) = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    assert any("ray get-auth-token --generate" in c for c in config["head_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start" in head_start
    assert "RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$HOME/ray_auth/auth_token" in worker_start
    assert "--dashboard-host=127.0.0.1" in head_start and "0.0.0.0" not in str(config)
    # The workers' token arrives through a file mount that the head syncs from its own copy.
    assert "/home/ray/ray_auth" in config["file_mounts"]
