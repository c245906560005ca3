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

import psutil
import pytest

# Run alone, after the parallel run (`make test`): the head's raylet aborts unless its dashboard
# agent, a Python process, has started within Ray's fixed 15 s, which it misses while another
# worker's training holds both cores.
pytestmark = pytest.mark.solo

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
    for _attempt in range(3):
        started = _start_head(temp_dir, env)
        if started:
            break
    assert started, "the head's raylet aborted three times (see raylet.out under " + temp_dir
    head, port, dash = started
    yield f"http://127.0.0.1:{dash}", env, f"127.0.0.1:{port}"
    _stop_head(head)


def _start_head(temp_dir: str, env: dict) -> tuple[subprocess.Popen, int, int] | None:
    """`ray start --head --block`, once its raylet registered (None if the raylet aborted).

    Ray's raylet waits a fixed 15 s for its dashboard agent to write its listening port, then
    aborts. On a loaded machine (another pytest worker training on the 2 cores) the agent's
    imports alone can take longer; the `ray start` process then lives on with no raylet, and
    `ray status` still exits 0 ("No cluster status"). Ready is therefore the head node listed
    alive, which the raylet is only after the agent wrote its ports; an aborted raylet means a
    fresh start.
    """
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
    alive_nodes = [
        *(RAY, "list", "nodes", "--address", f"http://127.0.0.1:{dash}"),
        *("--filter", "state=ALIVE", "--format", "json"),
    ]
    try:
        ready = _wait_until_registered(head, alive_nodes, env)
    except BaseException:
        _stop_head(head)
        raise
    if not ready:
        _stop_head(head)
        return None
    return head, port, dash


def _wait_until_registered(head: subprocess.Popen, alive_nodes: list[str], env: dict) -> bool:
    """True once the head node is listed alive; False if its raylet exited first."""
    raylet = None
    deadline = time.time() + 180
    while True:
        listed = subprocess.run(alive_nodes, env=env, capture_output=True, text=True)
        # JSON once a node is listed; "No resource in the cluster" before.
        if listed.returncode == 0 and listed.stdout.startswith("["):
            return True
        raylet = raylet or _child_named(head, "raylet")
        if head.poll() is not None or (raylet and _exited(raylet)):
            return False
        assert time.time() < deadline, "the head's raylet did not register within 180 s"
        time.sleep(1)


def _child_named(parent: subprocess.Popen, name: str) -> psutil.Process | None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for child in psutil.Process(parent.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.name() == name:
                    return child
    return None


def _exited(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.status() == psutil.STATUS_ZOMBIE  # exited, not yet reaped
    return True


def _stop_head(head: subprocess.Popen) -> None:
    """Stop exactly the processes of this head (its own process group)."""
    with contextlib.suppress(ProcessLookupError):  # `ray start` already stopped them all
        os.killpg(head.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(5)
    # Whatever ignored SIGTERM (raylet children, dashboard agents) goes now.
    with contextlib.suppress(ProcessLookupError):  # nothing did
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
    run_dir = tmp_path / "job_run"
    job_id = _submit(
        head_node,
        f"data.path={token_data}",
        f"run.dir={run_dir}",
        "trainer.steps=4",
        "checkpoint.every_steps=2",
    )
    status, logs = _wait_for_job(head_node, job_id)
    assert status == "SUCCEEDED", logs[-3000:]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "step_4" / "commit.json").is_file()
    assert f"run dir: {run_dir}" in logs


def _submit(head_node, *overrides: str) -> str:
    """`ray job submit --no-wait` of jobs/pretrain.py on the test recipe; the job's id."""
    address, env, _ = head_node
    job_id = f"rtdt-{secrets.token_hex(4)}"
    runtime_env = json.dumps(
        {
            "excludes": [".venv", "runs", "data", ".git"],
            # `ray job stop` gives the driver this long after SIGTERM to checkpoint (default 3 s).
            "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": "60"},
        }
    )
    command = [
        RAY,
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        job_id,
        "--no-wait",
        "--working-dir",
        str(REPO),
        "--runtime-env-json",
        runtime_env,
        "--",
        sys.executable,
        "jobs/pretrain.py",
        "conf/test.yaml",
        *overrides,
    ]
    # The dashboard answers before its job agent has registered; Ray says to try again.
    deadline = time.time() + 60
    while True:
        submit = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        if "No available agent" not in submit.stderr or time.time() > deadline:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stderr
    return job_id


def _wait_for_job(head_node, job_id: str) -> tuple[str, str]:
    """The job's final status and its logs."""
    address, env, _ = head_node
    deadline = time.time() + 400
    while (status := _job_status(address, env, job_id)) in ("PENDING", "RUNNING", "UNKNOWN"):
        assert time.time() < deadline, f"job still {status} after 400 s"
        time.sleep(1)
    logs = subprocess.run(
        [RAY, "job", "logs", "--address", address, job_id], env=env, capture_output=True, text=True
    ).stdout
    return status, logs


def _wait_for_steps(run_dir: Path, steps: int, timeout_s: float = 180) -> None:
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + timeout_s
    while not metrics.exists() or len(metrics.read_text().splitlines()) < steps:
        assert time.time() < deadline, f"fewer than {steps} steps after {timeout_s:.0f} s"
        time.sleep(0.05)


def _check_trained_exactly_once(run_dir: Path, cfg_overrides: list[str], steps: int) -> None:
    """Every step 1..steps once in the metrics, and each step's samples the global order's."""
    from reference import global_batch_ids

    from raytrain_dt.config import load_config
    from raytrain_dt.data.source import TokenDataset
    from raytrain_dt.observe.metrics import read_jsonl

    cfg = load_config(REPO / "conf" / "test.yaml", cfg_overrides)
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == list(range(1, steps + 1))
    ledger = read_jsonl(run_dir / "ledger.jsonl")
    assert [r["step"] for r in ledger] == list(range(1, steps + 1))
    dataset = TokenDataset.open(cfg.data.path, cfg.data.seq_len)
    for record in ledger:
        assert record["sample_ids"] == global_batch_ids(cfg, dataset, record["step"] - 1).tolist()


@pytest.mark.timeout(600)
def test_stopped_job_checkpoints_and_its_resubmission_loses_no_step(
    head_node, token_data, tmp_path
):
    """`ray job stop` sends SIGTERM: the driver saves at the next step boundary and exits; the
    same job submitted again resumes there and finishes, every sample trained exactly once."""
    address, env, _ = head_node
    run_dir = tmp_path / "run"
    # Long enough to be stopped midway: ~0.1 s a step, and the stop is sent at step 3. It
    # usually lands within 2-3 s (about 25 steps), but once took more than 12 s (CI's solo
    # phase; 150 steps then finished first); 400 leave over 30 s.
    steps = 400
    overrides = [
        f"data.path={token_data}",
        f"run.dir={run_dir}",
        f"trainer.steps={steps}",
        "checkpoint.every_steps=0",
    ]
    job_id = _submit(head_node, *overrides)
    _wait_for_steps(run_dir, 3)
    stop = subprocess.run(
        [RAY, "job", "stop", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0, stop.stderr
    status, logs = _wait_for_job(head_node, job_id)
    assert status == "STOPPED", logs[-3000:]
    drains = [e for e in _events(run_dir) if e["event"] == "drained"]
    assert drains, "no drain: the run ended before the stop reached it"
    drained = drains[-1]
    assert drained["reason"] == "stop: SIGTERM"
    checkpoints = (run_dir / "checkpoints").glob("step_*")
    committed = [c.name for c in checkpoints if (c / "commit.json").exists()]
    assert committed == [f"step_{drained['step']}"]  # saved at the boundary it stopped at
    assert "run stopped at step" in logs
    status, logs = _wait_for_job(head_node, _submit(head_node, *overrides))
    assert status == "SUCCEEDED", logs[-3000:]
    _check_trained_exactly_once(run_dir, overrides, steps)
    resumed = [e for e in _events(run_dir) if e["event"] == "start"][-1]
    assert resumed["resumed_step"] == drained["step"] and resumed["lost_steps"] == 0


@pytest.mark.timeout(600)
def test_killed_driver_resumes_from_the_latest_checkpoint(head_node, token_data, tmp_path):
    """SIGKILL to `raytrain-dt train` mid-run; the same command again resumes from the latest
    committed checkpoint and finishes with the ledger exact."""
    _, env, gcs = head_node
    run_dir = tmp_path / "run"
    overrides = [
        f"data.path={token_data}",
        f"run.dir={run_dir}",
        "trainer.steps=100",
        "checkpoint.every_steps=3",
    ]
    command = [
        sys.executable,
        "-m",
        "raytrain_dt.cli",
        "train",
        "conf/test.yaml",
        *overrides,
        "--address",
        gcs,
    ]
    driver = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.time() + 180
        while not (run_dir / "checkpoints" / "step_3" / "commit.json").exists():
            assert time.time() < deadline and driver.poll() is None, "no checkpoint at step 3"
            time.sleep(0.05)
    finally:
        driver.kill()
        driver.wait()
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    _check_trained_exactly_once(run_dir, overrides, 100)
    sessions = [e for e in _events(run_dir) if e["event"] == "start"]
    assert len(sessions) == 2 and sessions[1]["resumed_step"] >= 3


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_job_client_without_the_token_is_refused(head_node):
    address, env, _ = head_node
    no_token = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    no_token["HOME"] = tempfile.mkdtemp()  # no ~/.ray/auth_token to fall back on
    result = subprocess.run(
        [RAY, "job", "list", "--address", address], env=no_token, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "auth" in (result.stdout + result.stderr).lower()
