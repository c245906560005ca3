"""The optimizer step waits for every copy staged before it (`FSDP2Engine._hold_optimizer_until`):
an async save and an in-memory copy staged from the same step both finish before the step
changes the state, and the waiting hook never mutates the optimizer's hooks while `step` runs
over them (that raised "OrderedDict mutated during iteration" with two staged copies)."""

import threading
import time
from concurrent.futures import Future

import torch

from raytrain_dt.engines.fsdp2 import FSDP2Engine


def _engine() -> FSDP2Engine:
    engine = object.__new__(FSDP2Engine)  # only the optimizer matters here
    engine.param = torch.nn.Parameter(torch.ones(3))
    engine.optimizer = torch.optim.SGD([engine.param], lr=0.1)
    return engine


def _finishing_later(delay_s: float, done: list[str], name: str) -> Future:
    future: Future = Future()

    def finish():
        time.sleep(delay_s)
        done.append(name)
        future.set_result(None)

    threading.Thread(target=finish, daemon=True).start()
    return future


def _step(engine: FSDP2Engine) -> None:
    engine.param.grad = torch.ones(3)
    engine.optimizer.step()


def test_a_step_waits_for_a_save_and_a_copy_staged_from_the_same_step():
    engine, done = _engine(), []
    engine._hold_optimizer_until(_finishing_later(0.3, done, "save"))
    engine._hold_optimizer_until(_finishing_later(0.1, done, "copy"))
    _step(engine)
    assert sorted(done) == ["copy", "save"]  # both staged before the state changed
    assert engine.staging_wait_s >= 0.2
    _step(engine)  # nothing staged: the next step does not wait
    assert engine.staging_wait_s < 0.05
    assert len(engine.optimizer._optimizer_step_pre_hooks) == 1
    assert torch.allclose(engine.param.detach(), torch.full((3,), 0.8))


def test_a_failed_copy_does_not_fail_the_step():
    engine = _engine()
    failed: Future = Future()
    failed.set_exception(OSError("disk full"))
    engine._hold_optimizer_until(failed)
    _step(engine)
    assert torch.allclose(engine.param.detach(), torch.full((3,), 0.9))
