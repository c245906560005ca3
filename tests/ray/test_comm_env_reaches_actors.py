"""The rank actors' environment reaches a Ray actor's process through the runtime_env the
coordinator builds (`rank_runtime_env`): the run's comm settings and the driver variables
`cluster.forward_env` names, and no other driver variable (a credential above all)."""

from __future__ import annotations

import os

import pytest

from raytrain_dt.control.comm_env import rank_runtime_env

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_an_actor_sees_the_comm_env_and_only_the_named_driver_variables(make_config, monkeypatch):
    import ray

    monkeypatch.setenv("AWS_REGION", "eu-north-1")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "driver-secret")
    cfg = make_config(
        "comm.env.NCCL_IB_TIMEOUT=22", "comm.network=socket", "cluster.forward_env=[AWS_REGION]"
    )
    runtime_env = rank_runtime_env(cfg, "existing")
    assert "AWS_SECRET_ACCESS_KEY" not in runtime_env["env_vars"]

    @ray.remote(num_cpus=0)
    class Probe:
        def env(self, names: list[str]) -> dict:
            return {name: os.environ.get(name) for name in names}

    probe = Probe.options(runtime_env=runtime_env).remote()
    expected = runtime_env["env_vars"]
    seen = ray.get(probe.env.remote([*expected, "AWS_SECRET_ACCESS_KEY"]), timeout=120)
    ray.kill(probe)
    assert seen == {**expected, "AWS_SECRET_ACCESS_KEY": None}
    assert seen["AWS_REGION"] == "eu-north-1"
    assert seen["NCCL_IB_TIMEOUT"] == "22" and seen["NCCL_NET"] == "Socket"
