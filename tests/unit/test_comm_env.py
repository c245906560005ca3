"""The rank actors' NCCL/Gloo environment: per topology, config overrides win, bad names fail."""

from __future__ import annotations

import pytest

from raytrain_dt.config import load_config
from raytrain_dt.control.comm_env import (
    HOST_ALLOCATOR_ENV,
    comm_env,
    rank_runtime_env,
    run_comm_env,
    spans_nodes,
)
from raytrain_dt.errors import ConfigError

RECIPE = "conf/test.yaml"


def _comm(*overrides: str):
    return load_config(RECIPE, list(overrides)).comm


def test_single_node_keeps_bootstrap_and_gloo_on_loopback_and_sets_no_fabric():
    env = comm_env(_comm(), multi_node=False)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # abort and raise, the process lives
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"
    assert not {"NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_NET"} & env.keys()
    # Algorithms, protocols and buffer size are NCCL's to tune unless configured.
    assert not {"NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE"} & env.keys()


def test_multi_node_leaves_the_interface_to_nccl_and_sets_the_chosen_fabric():
    auto = comm_env(_comm(), multi_node=True)
    assert "GLOO_SOCKET_IFNAME" not in auto and "NCCL_SOCKET_IFNAME" not in auto
    assert "NCCL_IB_DISABLE" not in auto  # auto: NCCL picks EFA plugin, IB or sockets itself
    ib = comm_env(_comm("comm.network=ib", "comm.socket_ifname=ens5"), multi_node=True)
    assert ib["NCCL_IB_DISABLE"] == "0" and ib["NCCL_NET_GDR_LEVEL"] == "PHB"
    assert ib["NCCL_SOCKET_IFNAME"] == ib["GLOO_SOCKET_IFNAME"] == "ens5"
    tcp = comm_env(_comm("comm.network=socket"), multi_node=True)
    assert tcp["NCCL_IB_DISABLE"] == "1" and tcp["NCCL_NET"] == "Socket"


def test_configured_tuning_and_env_overrides_win():
    comm = _comm(
        "comm.algo=Ring",
        "comm.proto=Simple",
        "comm.buffsize_bytes=8388608",
        "comm.blocking_wait=true",
        "comm.env.NCCL_SOCKET_IFNAME=eth1",
        "comm.env.TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "comm.env.NCCL_IB_TIMEOUT=22",
    )
    env = comm_env(comm, multi_node=False)
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"], env["NCCL_BUFFSIZE"]) == (
        "Ring",
        "Simple",
        "8388608",
    )
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    assert env["NCCL_SOCKET_IFNAME"] == "eth1"  # the env override beats the topology default
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert env["NCCL_IB_TIMEOUT"] == "22"
    assert all(isinstance(v, str) for v in env.values())  # Ray's env_vars take strings only


def test_the_flight_recorder_is_on_and_the_environment_names_no_run(tmp_path):
    """The actors' environment is the same for every run of one config: Ray gives an idle
    worker process only to work of an equal runtime_env (each actor points the recorder's
    dumps at its run's logs itself: tests/ray/test_warm_actors.py)."""
    cfg = load_config(RECIPE)
    env = run_comm_env(cfg, "existing")
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    first = rank_runtime_env(load_config(RECIPE, [f"run.dir={tmp_path}/a"]), "existing", {})
    second = rank_runtime_env(load_config(RECIPE, [f"run.dir={tmp_path}/b"]), "existing", {})
    assert first == second
    off = comm_env(_comm("comm.trace_buffer=0"), multi_node=True)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in off


def test_topology_follows_the_cluster_and_the_node_bound():
    cfg = load_config(RECIPE)
    assert not spans_nodes(cfg, "embedded")
    assert spans_nodes(cfg, "joined") and spans_nodes(cfg, "simulated")
    assert not spans_nodes(load_config(RECIPE, ["elastic.max_nodes=1"]), "joined")


def test_collective_timeout_is_configurable_and_below_torchs_30_minutes():
    assert load_config(RECIPE).comm.timeout_s < 30 * 60
    assert load_config(RECIPE, ["comm.timeout_s=90"]).comm.timeout_s == 90


@pytest.mark.parametrize(
    "override, message",
    [
        ("comm.network=roce", "comm.network: 'roce' is not one of auto, ib, socket"),
        ("comm.timeout_s=0", "comm.timeout_s: must be > 0, got 0.0"),
    ],
)
def test_bad_comm_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, [override])


def test_bad_env_name_names_the_key():
    with pytest.raises(ConfigError, match=r"comm.env.1BAD: not a valid environment"):
        comm_env(_comm("comm.env.1BAD=x"), multi_node=False)


DRIVER_ENV = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG",
    "AWS_SESSION_TOKEN": "token",
    "AWS_REGION": "eu-west-1",
    "HOME": "/home/ray",
    "NCCL_DEBUG": "INFO",
}


def test_no_driver_variable_reaches_the_actors_unless_named():
    """Ray keeps the runtime_env in the GCS and shows it in the dashboard: a driver's
    credentials must never be copied there by default."""
    cfg = load_config(RECIPE, [])
    env_vars = rank_runtime_env(cfg, "joined", DRIVER_ENV)["env_vars"]
    assert env_vars == {**HOST_ALLOCATOR_ENV, **run_comm_env(cfg, "joined")}
    assert not {"AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "HOME"} & set(env_vars)


def test_the_host_allocators_huge_pages_are_on_unless_comm_env_says_otherwise():
    cfg = load_config(RECIPE, [])
    assert rank_runtime_env(cfg, "joined", {})["env_vars"]["THP_MEM_ALLOC_ENABLE"] == "1"
    cfg = load_config(RECIPE, ["comm.env.THP_MEM_ALLOC_ENABLE=0"])
    assert rank_runtime_env(cfg, "joined", {})["env_vars"]["THP_MEM_ALLOC_ENABLE"] == "0"


def test_named_variables_are_forwarded_and_comm_settings_win(caplog):
    cfg = load_config(
        RECIPE,
        [
            "cluster.forward_env=[AWS_REGION,AWS_SECRET_ACCESS_KEY,NCCL_DEBUG,AWS_PROFILE]",
            "comm.env.AWS_REGION=us-east-2",
        ],
    )
    env_vars = rank_runtime_env(cfg, "joined", DRIVER_ENV)["env_vars"]
    assert env_vars["AWS_SECRET_ACCESS_KEY"] == DRIVER_ENV["AWS_SECRET_ACCESS_KEY"]
    assert env_vars["AWS_REGION"] == "us-east-2"  # comm.env wins over the driver's value
    assert env_vars["NCCL_DEBUG"] == "WARN"  # the run's comm setting wins too
    assert "AWS_ACCESS_KEY_ID" not in env_vars and "AWS_SESSION_TOKEN" not in env_vars
    # A listed name the driver lacks is not forwarded, and says so.
    assert "AWS_PROFILE" not in env_vars
    assert "cluster.forward_env: AWS_PROFILE not set in the driver's environment" in caplog.text


@pytest.mark.parametrize("entries", ["[1BAD]", "[AWS_REGION,'AWS-KEY']", "['']", "['A B']"])
def test_a_forward_env_entry_that_is_not_a_name_names_the_key(entries):
    with pytest.raises(ConfigError, match=r"^cluster\.forward_env: .* is not a valid environment"):
        load_config(RECIPE, [f"cluster.forward_env={entries}"])


def test_the_cli_refuses_a_bad_forward_env_in_one_line_with_exit_2(capsys, tmp_path):
    from raytrain_dt.cli import main

    code = main(["train", RECIPE, "cluster.forward_env=[AWS-KEY]", f"run.dir={tmp_path}/r"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: cluster.forward_env: 'AWS-KEY' is not a valid environment variable name"
    ]
    assert not (tmp_path / "r").exists()


def test_every_group_a_rank_creates_gets_the_collective_timeout(tmp_path, monkeypatch):
    """Groups made after the world group (device-mesh dimensions use the same `new_group`,
    the checkpoint side groups too) would otherwise take torch's 30-minute Gloo default."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from raytrain_dt.worker.collective_timeout import set_collective_timeout

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        monkeypatch.setattr(c10d, name, getattr(c10d, name))  # restored afterwards
    timeout = set_collective_timeout(load_config(RECIPE, ["comm.timeout_s=77"]).comm.timeout_s)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timeout
    )
    try:
        groups = [dist.new_group(backend="gloo"), dist.new_group(ranks=[0], backend="gloo")]
        seen = [g._get_backend(torch.device("cpu")).options._timeout for g in groups]
    finally:
        dist.destroy_process_group()
    assert seen == [timeout] * 2 and timeout.total_seconds() == 77


def test_the_world_group_joins_within_the_formations_time_then_takes_the_collectives(
    tmp_path, monkeypatch
):
    """A peer lost before it joins holds the others only for the formation's time left; once
    joined, the world group's collectives (and later groups') have `comm.timeout_s`."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from raytrain_dt.worker.collective_timeout import (
        join_timeout,
        restore_world_timeout,
        set_collective_timeout,
    )

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        monkeypatch.setattr(c10d, name, getattr(c10d, name))
    collective = set_collective_timeout(600)
    assert join_timeout(collective, 42.5) == datetime.timedelta(seconds=42.5)
    assert join_timeout(collective, 900) == join_timeout(collective, None) == collective
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'store'}",
        rank=0,
        world_size=1,
        timeout=join_timeout(collective, 42.5),
    )
    try:
        world = c10d._get_default_group()
        joined = world._get_backend(torch.device("cpu")).options._timeout
        restore_world_timeout(collective)
        after = world._get_backend(torch.device("cpu")).options._timeout
        later = dist.new_group(backend="gloo")._get_backend(torch.device("cpu")).options._timeout
    finally:
        dist.destroy_process_group()
    assert (joined.total_seconds(), after, later) == (42.5, collective, collective)
