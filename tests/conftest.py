"""Shared fixtures: one simulated multi-node Ray cluster per test session (per xdist worker:
each runs whole files against its own cluster), a small dataset; the heaviest tests first.

The cluster has 2 nodes x 2 accelerators (the `accelerator` resource), like the embedded
default's simulated nodes; tests that need a third node add and remove it themselves. Ray keeps
its files in a short temp dir (its socket paths have a length limit).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).parent))
# No usage reporting by the suite's Ray instances (Ray's own switch; inherited by every process
# they and the tests start). With it on, each pipeline's first run also starts Ray Data's usage
# collection actor, a process that imports Ray Data and stays for the session.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

import mlflow_server  # tests/ is on sys.path from here on

from raytrain_dt.config import load_config
from raytrain_dt.config.schema import ClusterConfig
from raytrain_dt.data.prepare import prepare_dataset

pytest_plugins = ["timeout_dumps"]  # how a time-out fires in an xdist worker

REPO = Path(__file__).resolve().parents[1]
# A fixed corpus (the stdlib's json and email packages), so test data do not change with
# this repository's own code.
TEXT_GLOB = str(Path(sysconfig.get_paths()["stdlib"]) / "[je][sm][oa]*" / "*.py")


# Heaviest directories first. `make test` runs two xdist workers that take whole files in
# this order (`--no-loadscope-reorder`: xdist would otherwise start with the files that have the
# most tests, the cheap unit ones, and end on one worker running the long Ray files alone).
# The cheap files last fill whichever worker finishes its Ray files first.
HEAVIEST_FIRST = ("ray", "distributed", "control", "unit")

# The shared cluster: 2 simulated nodes x 2 accelerators, each node sized as the embedded
# default sizes it (ClusterConfig's CPUs per rank).
SESSION_CLUSTER = ClusterConfig(local_nodes=2, accelerators_per_node=2)


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test` two xdist workers share two cores: torch computing in a worker's own
    process takes one thread, not both (it runs at nice 0, and would starve the other
    worker's Ray ranks, which Ray starts at nice 15; see `harness.settle_rank_process`).
    The controller, idle otherwise, starts the MLflow server early for whichever worker runs
    the tracker tests (tests/mlflow_server.py); it runs before xdist spawns the workers, which
    inherit where to find it."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
    elif getattr(config.option, "numprocesses", None) and mlflow_server.selected(
        config.args, config.rootpath
    ):
        config._rtdt_mlflow = mlflow_server.EarlyServer()
        config._rtdt_mlflow.begin()


def pytest_unconfigure(config: pytest.Config) -> None:
    early = getattr(config, "_rtdt_mlflow", None)
    if early is not None:
        early.end()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def weight(item: pytest.Item) -> int:
        top = item.path.relative_to(Path(__file__).parent).parts[0]
        return HEAVIEST_FIRST.index(top) if top in HEAVIEST_FIRST else len(HEAVIEST_FIRST)

    items.sort(key=weight)  # stable: the order within each directory stays as collected


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    for attempt in range(3):
        temp_dir = tempfile.mkdtemp(prefix="rtdt_", dir="/tmp")
        try:
            sim = _start_session_cluster(temp_dir)
            break
        except Exception as exc:
            # Ray's raylet aborts when its dashboard agent has not written its port within a
            # fixed 15 s, which a loaded machine (another worker training) can make the agent
            # miss; Ray then reports "The current node timed out during startup".
            if "timed out during startup" not in str(exc) or attempt == 2:
                raise
            _stop_processes_under(temp_dir)
    ray.init(address=sim.address, log_to_driver=False)
    yield sim
    ray.shutdown()
    sim.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _start_session_cluster(temp_dir: str):
    """The simulated cluster, its processes started at a higher CPU priority where this process
    may raise it (root), so that their agents beat the raylets' 15 s wait on a busy machine;
    once it is up, they run at this process's priority again. The ranks they start run at
    Ray's own worker priority (nice 15)."""
    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, start_simulated_cluster

    normal = os.getpriority(os.PRIO_PROCESS, 0)
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, normal - 5)  # inherited by what starts meanwhile
    try:
        return start_simulated_cluster(SESSION_CLUSTER, SIMULATED_ACCELERATOR, temp_dir)
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, normal)
        for process in _processes_under(temp_dir):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.nice(normal)


def _stop_processes_under(temp_dir: str) -> None:
    """Kill what a failed start left running: every Ray process of it names its temp dir."""
    for process in _processes_under(temp_dir):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    shutil.rmtree(temp_dir, ignore_errors=True)


def _processes_under(temp_dir: str) -> list[psutil.Process]:
    return [
        process
        for process in psutil.process_iter(["cmdline"])
        if any(temp_dir in arg for arg in process.info["cmdline"] or ())
    ]


@pytest.fixture
def fresh_actors(ray_cluster):
    """No rank actor kept warm by an earlier run (conf/test.yaml's `cluster.keep_warm_s`): the
    test's runs start their own processes, and the cluster's accelerators are all free."""
    from raytrain_dt.control import warm_actors

    warm_actors.release_kept()
    return ray_cluster


@pytest.fixture
def restore_nodes(ray_cluster):
    """After the test, the cluster has two accelerator nodes of the size it started with: lost
    ones are replaced, and ones a test's chaos added (sized by the run's config, conf/test.yaml:
    1 CPU) are removed. A 1-CPU node cannot host two ranks at the default CPUs per rank (a
    bundle of 0.75), so the doctor's runs, landing after such a test, timed out placing them."""
    import ray

    from raytrain_dt.control import warm_actors
    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR

    yield ray_cluster
    wanted = _session_node_args()

    def accelerator_nodes() -> list[dict]:
        return [n for n in ray.nodes() if n["Alive"] and n["Resources"].get(SIMULATED_ACCELERATOR)]

    def session_sized(node: dict) -> bool:
        have = node["Resources"]
        return have.get("CPU") == wanted["num_cpus"] and all(
            have.get(k) == v for k, v in wanted["resources"].items()
        )

    kept = [n["NodeID"] for n in accelerator_nodes() if session_sized(n)][:2]
    odd = [node for node in ray_cluster.worker_nodes if node.node_id not in kept]
    if odd:
        # Kept actors on a node removed here go first; those on the kept nodes stay warm for
        # the next test.
        warm_actors.release_on_nodes({node.node_id for node in odd})
        for node in odd:
            ray_cluster.remove_node(node)
    for _ in range(2 - len(kept)):
        ray_cluster.add_node(**wanted)
    ray_cluster.wait_for_nodes()
    removed = {node.node_id for node in odd}
    deadline = time.monotonic() + 60  # the removed ones reported dead: no plan counts them
    while True:
        alive = {n["NodeID"] for n in accelerator_nodes()}
        if len(alive) == 2 and not alive & removed:
            break
        assert time.monotonic() < deadline, f"nodes not restored: {accelerator_nodes()}"
        time.sleep(0.2)


def _session_node_args() -> dict:
    """What each of the shared cluster's accelerator nodes declares (`_start_session_cluster`):
    the embedded default's simulated node."""
    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, simulated_node_args

    return simulated_node_args(SESSION_CLUSTER, SIMULATED_ACCELERATOR)


@pytest.fixture(scope="session")
def token_data(tmp_path_factory) -> Path:
    """A small token dataset of real text (about 3k sequences of 64)."""
    out = tmp_path_factory.mktemp("data") / "tokens"
    prepare_dataset(out, TEXT_GLOB, seq_len=64, max_tokens=200_000)
    return out


@pytest.fixture(scope="session")
def user_docs(tmp_path_factory) -> Path:
    """Real documents (stdlib sources, about 60 kB) as text files under `text/` and, in the
    same order, as `docs.jsonl` ({"id", "text"} per line): user data for `data.source`."""
    import glob
    import json

    out = tmp_path_factory.mktemp("user_docs")
    (out / "text").mkdir()
    docs, size = [], 0
    for i, name in enumerate(sorted(glob.glob(TEXT_GLOB))):
        text = Path(name).read_text()
        (out / "text" / f"doc{i:03d}.txt").write_text(text)
        docs.append({"id": i, "text": text})
        size += len(text)
        if size > 60_000:
            break
    (out / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return out


@pytest.fixture
def make_config(token_data, tmp_path):
    def make(*overrides: str, run_dir: Path | None = None):
        return load_config(
            REPO / "conf" / "test.yaml",
            [f"data.path={token_data}", f"run.dir={run_dir or tmp_path / 'run'}", *overrides],
        )

    return make
