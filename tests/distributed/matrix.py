"""Fixtures of the layout-equivalence modules (the engine matrix, the emulated accelerator, the
CUDA path), which import them: a pool of spawned ranks per module, the 5-step config on the test
corpus, and the single-process reference it is checked against."""

from __future__ import annotations

import pytest
from harness import WorkerPool
from reference import reference_run

STEPS = 5
GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def pool():
    workers = WorkerPool(4)
    yield workers
    workers.close()


@pytest.fixture(scope="module")
def cfg(token_data, tmp_path_factory, request):
    from conftest import REPO

    from raytrain_dt.config import load_config

    return load_config(
        REPO / "conf" / "test.yaml",
        [
            f"data.path={token_data}",
            f"run.dir={tmp_path_factory.mktemp(request.module.__name__)}",
            "model.n_layers=4",
            f"trainer.steps={STEPS}",
            f"trainer.global_batch={GLOBAL_BATCH}",
        ],
    )


@pytest.fixture(scope="module")
def reference(cfg):
    return reference_run(cfg, STEPS)
