"""`ray job submit` against a real head node on loopback, with Ray 2.60's token auth on.

The head runs under `ray start --block` in its own process group, so the test stops exactly
the cluster it started (`ray stop` would stop every Ray on the machine, the shared one too).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")
AGENT_PORT_FLAGS = (
    "dashboard-agent-listen-port",
    "dashboard-agent-grpc-port",
    "metrics-export-port",
    "runtime-env-agent-port",
    "ray-client-server-port",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def head_node():
    temp_dir = tempfile.mkdtemp(prefix="rtdtj_", dir="/tmp")
    token_path = Path(temp_dir) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    # The documented way for a client to reach a token-auth cluster: the same mode and token.
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token_path),
        "RAY_ADDRESS": "",
    }
    port, dash = _free_port(), _free_port()
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash}",
            "--num-cpus=4",
            '--resources={"accelerator": 2}',
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            # Ray's fixed default ports (52365, ...) are taken by the session's shared cluster.
            *(f"--{flag}={_free_port()}" for flag in AGENT_PORT_FLAGS),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dash}"
    deadline = time.time() + 60
    while (
        subprocess.run(
            [RAY, "job", "list", "--address", address], env=env, capture_output=True
        ).returncode
        != 0
    ):
        assert head.poll() is None, "ray start --head exited"
        assert time.time() < deadline, "dashboard did not come up within 60 s"
        time.sleep(1)
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(5)
    # Whatever ignored SIGTERM (raylet children, dashboard agents) goes now.
    os.killpg(head.pid, signal.SIGKILL)
    head.wait()


def _job_status(address: str, env: dict, job_id: str) -> str:
    result = subprocess.run(
        [RAY, "job", "status", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
    )
    out = (result.stdout + result.stderr).lower()
    # The CLI prints e.g. "Job 'x' succeeded" or "Status for job 'x': RUNNING".
    for status in ("succeeded", "failed", "stopped", "running", "pending"):
        if status in out:
            return status.upper()
    return "UNKNOWN"


def test_ray_job_submit_trains_and_writes_the_run_dir(head_node, token_data, tmp_path):
    address, env = head_node
    run_dir = tmp_path / "job_run"
    job_id = f"rtdt-{secrets.token_hex(4)}"
    runtime_env = json.dumps({"excludes": [".venv", "runs", "data", ".git"]})
    command = [
        RAY, "job", "submit", "--address", address, "--submission-id", job_id, "--no-wait",
        "--working-dir", str(REPO), "--runtime-env-json", runtime_env, "--",
        sys.executable, "jobs/pretrain.py", "conf/test.yaml", f"data.path={token_data}",
        f"run.dir={run_dir}", "trainer.steps=4", "checkpoint.every_steps=2",
    ]  # fmt: skip
    # The dashboard answers before its job agent has registered; Ray says to try again.
    deadline = time.time() + 60
    while True:
        submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if "No available agent" not in submit.stderr or time.time() > deadline:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stderr
    deadline = time.time() + 180
    while (status := _job_status(address, env, job_id)) in ("PENDING", "RUNNING", "UNKNOWN"):
        assert time.time() < deadline, f"job still {status} after 180 s"
        time.sleep(2)
    logs = subprocess.run(
        [RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True
    ).stdout
    assert status == "SUCCEEDED", logs[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "step_4" / "commit.json").is_file()
    assert f"run dir: {run_dir}" in logs


def test_job_client_without_the_token_is_refused(head_node):
    address, env = head_node
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = tempfile.mkdtemp()  # no ~/.ray/auth_token to fall back on
    result = subprocess.run(
        [RAY, "job", "list", "--address", address], env=no_token, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "auth" in (result.stdout + result.stderr).lower()
