"""cluster.yaml's own start commands, run for real on loopback: token auth is on.

The head's start commands from cluster.yaml generate the token and start Ray; only what needs
AWS or would collide on this machine is changed (fixed ports become free ones, Ray's files go
to a temp dir, the AWS autoscaler config is left out, `ray stop` is skipped because it would
stop every Ray on the machine). A worker joins with the workers' start command and the token
where the file mount puts it. Then `ray job submit` without the token is refused, and with it,
as docs/cloud.md tells a client to pass it, succeeds.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml
from test_job_submit import AGENT_PORT_FLAGS, RAY, _free_port, _stop_head, _wait_until_registered

# Its own head (see test_job_submit.py): after the parallel run, alone.
pytestmark = pytest.mark.solo

REPO = Path(__file__).resolve().parents[2]
CLUSTER = yaml.safe_load((REPO / "cluster.yaml").read_text())


def _substitute(command: str, replacements: dict[str, str]) -> str:
    """`command` with each pattern replaced; every pattern must occur exactly once, so a
    changed cluster.yaml fails here instead of running something else than it says."""
    for pattern, new in replacements.items():
        command, count = re.subn(pattern, new, command)
        assert count == 1, f"{pattern!r} found {count} times in {command!r}"
    return command


def _local_flags(*extra: str) -> str:
    """What a node on a shared loopback needs besides cluster.yaml's flags: to live in its own
    process group (--block), loopback, and free ports for Ray's fixed defaults (the shared test
    cluster holds them)."""
    ports = (f"--{flag}={_free_port()}" for flag in AGENT_PORT_FLAGS)
    return " ".join(["--block --node-ip-address=127.0.0.1 --disable-usage-stats", *ports, *extra])


def _node_env(home: Path) -> dict[str, str]:
    """A node's shell: its own home (where the token lives), nothing of ours about auth."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(home), RAY_ADDRESS="", PATH=f"{Path(RAY).parent}:{env['PATH']}")
    return env


def _start(command: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            ["bash", "-c", command],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: _stop_head stops exactly this node
        )


def _non_loopback_ip() -> str | None:
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return address.address
    return None


@pytest.fixture
def node_home():
    """The nodes' home: short, under /tmp (Ray's socket paths have a length limit)."""
    home = Path(tempfile.mkdtemp(prefix="rtdta_", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


def test_a_job_without_the_token_is_refused_and_with_it_succeeds(node_home, tmp_path):
    env = _node_env(node_home)
    for command in CLUSTER["head_start_ray_commands"]:
        if "get-auth-token" in command:
            subprocess.run(["bash", "-c", command], env=env, check=True, timeout=120)
    token = node_home / ".ray" / "auth_token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text().strip()) >= 32
    # Where the workers' file mount picks it up.
    assert (node_home / "ray_auth" / "auth_token").read_text() == token.read_text()

    # The client, as docs/cloud.md sets it up: the token copied off the head, and its path.
    client_token = tmp_path / "token"
    shutil.copy(token, client_token)
    client_home = tmp_path / "client_home"  # no ~/.ray/auth_token to fall back on
    client_home.mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    without = {**base, "HOME": str(client_home), "RAY_ADDRESS": ""}
    with_token = {**without, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(client_token)}

    nodes: list[subprocess.Popen] = []
    try:
        port, dash = _start_head(env, with_token, nodes, tmp_path)
        address = f"http://127.0.0.1:{dash}"
        # Nothing but loopback reaches the dashboard and job API.
        if ip := _non_loopback_ip():
            with pytest.raises(OSError), socket.create_connection((ip, dash), timeout=5):
                pass
        _join_worker(port, address, env, with_token, nodes, tmp_path)

        refused = _submit(address, without)
        assert refused.returncode != 0
        assert "auth" in (refused.stdout + refused.stderr).lower()

        accepted = _submit(address, with_token)
        assert accepted.returncode == 0, accepted.stderr[-3000:]
        assert "hello from a token-auth job" in accepted.stdout
        assert "succeeded" in accepted.stdout.lower()
    finally:
        for node in reversed(nodes):
            _stop_head(node)


def _start_head(env: dict, client_env: dict, nodes: list, tmp_path: Path) -> tuple[int, int]:
    """cluster.yaml's head `ray start`, until its node is listed alive (a raylet that aborted
    on a loaded machine, see test_job_submit.py, is started afresh); its GCS and dashboard
    ports."""
    (head_start,) = [c for c in CLUSTER["head_start_ray_commands"] if "ray start" in c]
    for _attempt in range(3):
        port, dash = _free_port(), _free_port()
        command = _substitute(
            head_start,
            {
                r"--port=6379": f"--port={port}",
                r"--object-manager-port=8076": f"--object-manager-port={_free_port()}",
                r"--metrics-export-port=8080": f"--metrics-export-port={_free_port()}",
                r" --autoscaling-config=\S+": "",  # the AWS autoscaler: needs AWS
                r"--dashboard-host=127\.0\.0\.1": (
                    f"--dashboard-host=127.0.0.1 --dashboard-port={dash} "
                    + _local_flags(f"--temp-dir={env['HOME']}/ray")
                ),
            },
        )
        head = _start(command, env, tmp_path / "head.log")
        if _wait_until_registered(head, _alive_command(f"http://127.0.0.1:{dash}"), client_env):
            nodes.append(head)
            return port, dash
        _stop_head(head)
    raise AssertionError("the head's raylet aborted three times; see " + str(tmp_path))


def _join_worker(
    port: int, address: str, env: dict, client_env: dict, nodes: list, tmp_path: Path
) -> None:
    """cluster.yaml's worker `ray start`, with the token where its file mount puts it, until the
    cluster lists two nodes alive."""
    (worker_start,) = [c for c in CLUSTER["worker_start_ray_commands"] if "ray start" in c]
    log = tmp_path / "worker.log"
    for _attempt in range(3):
        command = _substitute(
            worker_start,
            {
                r"--address=\$RAY_HEAD_IP:6379": f"--address=$RAY_HEAD_IP:{port}",
                r"--object-manager-port=8076": f"--object-manager-port={_free_port()}",
                # The head's temp dir: in /tmp/ray, the default, the worker would leave the
                # address of this cluster for any other Ray client on the machine to find.
                r"--metrics-export-port=8080": (
                    f"--metrics-export-port={_free_port()} "
                    + _local_flags(f"--temp-dir={env['HOME']}/ray")
                ),
            },
        )
        worker = _start(command, {**env, "RAY_HEAD_IP": "127.0.0.1"}, log)
        deadline = time.time() + 120
        while worker.poll() is None and time.time() < deadline:
            listed = subprocess.run(
                _alive_command(address), env=client_env, capture_output=True, text=True
            )
            if listed.returncode == 0 and listed.stdout.count('"node_id"') == 2:
                nodes.append(worker)
                return
            time.sleep(1)
        _stop_head(worker)
    raise AssertionError("the worker did not join: " + log.read_text()[-3000:])


def _alive_command(address: str) -> list[str]:
    return [
        *(RAY, "list", "nodes", "--address", address),
        *("--filter", "state=ALIVE", "--format", "json"),
    ]


def _submit(address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`ray job submit` of a one-line job, waiting for it; Ray's "No available agent" (the
    dashboard answers before its job agent registered) is retried."""
    command = [
        *(RAY, "job", "submit", "--address", address, "--"),
        *(sys.executable, "-c", "print('hello from a token-auth job')"),
    ]
    deadline = time.time() + 60
    while True:
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if "No available agent" not in result.stderr or time.time() > deadline:
            return result
        time.sleep(2)
