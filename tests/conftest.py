"""Shared fixtures: one simulated multi-node Ray cluster per test session, a small dataset.

The cluster has 2 nodes x 2 accelerators (the `accelerator` resource), like the embedded
default's simulated nodes; tests that need a third node add and remove it themselves. Ray keeps
its files in a short temp dir (its socket paths have a length limit).
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("RAY_DISABLE_USAGE_STATS", "1")
os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")

from raytrain_dt.config import load_config
from raytrain_dt.data.prepare import prepare_dataset

REPO = Path(__file__).resolve().parents[1]
# A fixed corpus (the stdlib's json and email packages), so test data do not change with
# this repository's own code.
TEXT_GLOB = str(Path(sysconfig.get_paths()["stdlib"]) / "[je][sm][oa]*" / "*.py")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from raytrain_dt.config.schema import ClusterConfig
    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, start_simulated_cluster

    temp_dir = tempfile.mkdtemp(prefix="rtdt_", dir="/tmp")
    sim = start_simulated_cluster(
        ClusterConfig(local_nodes=2, accelerators_per_node=2), SIMULATED_ACCELERATOR, temp_dir
    )
    ray.init(address=sim.address, log_to_driver=False)
    yield sim
    ray.shutdown()
    sim.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def restore_nodes(ray_cluster):
    """After the test, the cluster has the two accelerator nodes it started with."""
    from raytrain_dt.control.cluster import SIMULATED_ACCELERATOR, alive_nodes

    yield ray_cluster
    while len(alive_nodes(SIMULATED_ACCELERATOR)) < 2:
        ray_cluster.add_node(num_cpus=1, resources={SIMULATED_ACCELERATOR: 2})
        ray_cluster.wait_for_nodes()


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
