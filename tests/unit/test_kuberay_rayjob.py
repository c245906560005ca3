"""deploy/kuberay/rayjob.yaml passes KubeRay's own RayJob schema, offline, and says what the docs
promise: token auth, the job of jobs/pretrain.py, a CPU head, spot GPU workers preferred over an
on-demand group of the same type.

The schema is the openAPIV3Schema of the served `ray.io/v1` version in KubeRay v1.7.0's CRD,
vendored in tests/data/kuberay (source and version in its README). Unknown fields are rejected,
as `kubectl apply --validate=strict` rejects them: a misspelt key would otherwise be dropped by
the API server without a word.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
RAYJOB = REPO / "deploy" / "kuberay" / "rayjob.yaml"
CRD = REPO / "tests" / "data" / "kuberay" / "ray.io_rayjobs.yaml.gz"
# Of the uncompressed CRD, as published in KubeRay v1.7.0 (tests/data/kuberay/README.md).
CRD_SHA256 = "01a5cf3b17c1769fda44af7e82debcd98722f0c27b9ab84d084681c6649121f5"


def _strict(schema: dict) -> dict:
    """`schema` with unknown fields rejected wherever the CRD lists the fields of an object and
    does not say to keep unknown ones (what strict field validation does)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        schema = [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    raw = gzip.decompress(CRD.read_bytes())
    assert hashlib.sha256(raw).hexdigest() == CRD_SHA256, "not the vendored KubeRay CRD"
    crd = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    assert crd["spec"]["names"]["kind"] == "RayJob"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    # OpenAPI v3's schema keywords are JSON Schema's; the `x-kubernetes-*` ones are ignored
    # except preserve-unknown-fields, honoured above.
    return jsonschema.Draft7Validator(_strict(v1["schema"]["openAPIV3Schema"]))


@pytest.fixture(scope="module")
def rayjob() -> dict:
    return yaml.safe_load(RAYJOB.read_text())


def test_rayjob_is_valid_against_kuberays_crd(validator, rayjob):
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(rayjob)]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize(
    "path, bad",
    [
        (("spec", "rayClusterSpec", "authOptions", "mode"), "tokens"),  # not in the enum
        (("spec", "rayClusterSpec", "authOption"), {"mode": "token"}),  # misspelt key
        (("spec", "rayClusterSpec", "workerGroupSpecs", 0, "maxReplicas"), "6"),  # a string
    ],
)
def test_the_validation_catches_mistakes(validator, rayjob, path, bad):
    broken = copy.deepcopy(rayjob)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    assert list(validator.iter_errors(broken))


def test_token_auth_on_a_ray_that_has_it(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    assert cluster["authOptions"] == {"mode": "token"}
    pinned = re.search(r'"ray\[[^]]*\]==([\d.]+)"', (REPO / "pyproject.toml").read_text())[1]
    assert cluster["rayVersion"] == pinned  # KubeRay needs >= 2.52.0 for token auth
    dockerfile = (REPO / "deploy" / "kuberay" / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{pinned}-" in dockerfile


def test_the_entrypoint_is_jobs_pretrain_with_a_valid_config(rayjob):
    """What `ray job submit ... -- python jobs/pretrain.py CONFIG [k=v ...]` runs (its docstring
    and docs/cloud.md): the recipe exists in the repository and the overrides load."""
    from raytrain_dt.config import load_config

    python, script, recipe, *overrides = shlex.split(rayjob["spec"]["entrypoint"])
    assert (python, script) == ("python", "jobs/pretrain.py")
    assert (REPO / script).is_file()
    cfg = load_config(REPO / recipe, overrides)
    assert cfg.checkpoint.dir.startswith("s3://") and cfg.run.dir.startswith("/fsx/")
    runtime_env = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])
    # The image's copy of the repository (the Dockerfile's COPY), where the script is.
    dockerfile = (REPO / "deploy" / "kuberay" / "Dockerfile").read_text()
    assert f"COPY --chown=ray:users . {runtime_env['working_dir']}" in dockerfile
    assert int(runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"]) > 3


def test_cpu_head_and_spot_workers_preferred_over_an_on_demand_group_of_the_same_type(rayjob):
    cluster = rayjob["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    assert head["template"]["spec"]["nodeSelector"]["eks.amazonaws.com/capacityType"] == (
        "ON_DEMAND"
    )
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    spot, floor = groups["gpu-spot"], groups["gpu-ondemand"]
    capacity = [g["template"]["spec"]["nodeSelector"] for g in (spot, floor)]
    assert [c["eks.amazonaws.com/capacityType"] for c in capacity] == ["SPOT", "ON_DEMAND"]
    assert (
        capacity[0]["node.kubernetes.io/instance-type"]
        == (capacity[1]["node.kubernetes.io/instance-type"])
    )
    containers = [g["template"]["spec"]["containers"][0] for g in (spot, floor)]
    assert containers[0] == containers[1] and containers[0]["resources"]["limits"][
        "nvidia.com/gpu"
    ] == ("8")
    # Spot first; the on-demand floor never scales to zero. Fallback needs autoscaler v2.
    assert spot["priority"] > floor["priority"] and floor["minReplicas"] >= 1
    assert cluster["enableInTreeAutoscaling"] and cluster["autoscalerOptions"]["version"] == "v2"
