"""The communication environment reaches a Ray actor's process through the runtime_env the
coordinator builds for its rank actors (storage settings and comm settings merged)."""

from __future__ import annotations

import os

import pytest

from raytrain_dt.control.comm_env import run_comm_env, storage_runtime_env, with_comm_env

pytestmark = pytest.mark.usefixtures("ray_cluster")


def test_an_actor_sees_the_comm_and_storage_env(make_config, tmp_path, monkeypatch):
    import ray

    monkeypatch.setenv("AWS_REGION", "eu-north-1")
    cfg = make_config("comm.env.NCCL_IB_TIMEOUT=22", "comm.network=socket")
    expected = run_comm_env(cfg, "existing", tmp_path)
    runtime_env = with_comm_env(storage_runtime_env(), expected)

    @ray.remote(num_cpus=0)
    class Probe:
        def env(self, names: list[str]) -> dict:
            return {name: os.environ.get(name) for name in names}

    probe = Probe.options(runtime_env=runtime_env).remote()
    seen = ray.get(probe.env.remote([*expected, "AWS_REGION"]), timeout=120)
    ray.kill(probe)
    assert seen == {**expected, "AWS_REGION": "eu-north-1"}
    assert seen["NCCL_IB_TIMEOUT"] == "22" and seen["NCCL_NET"] == "Socket"
