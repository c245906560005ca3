"""A test past its time-out, in an xdist worker, ends that worker once every thread's stack is
written down; xdist reports the test failed and starts another worker, and the controller adds
the stacks to the failure's report. pytest-timeout still decides each test's time-out (`timeout`
in pyproject.toml, the `timeout` marker); this plugin replaces only how it fires.

pytest-timeout's own ways fall short in a worker. "signal" raises in the main thread: raised
between a lock's acquire and its `try`, the exception leaves the lock held (CI: logging's module
lock, after which every later test of that worker that logged from a thread hung, 5 of them),
and it never reaches a main thread blocked in a C call (a gloo collective). "thread" needs the
GIL to act, and writes the stacks where xdist drops them. faulthandler's watchdog is a C thread:
it writes every thread's stack and exits even while a C call holds the GIL.

The worker's simulated Ray cluster goes with it: Ray's Cluster ties its raylets and GCS to the
process that started them, and their agents exit within two minutes of their raylet (measured).
Outside xdist (`make test`'s solo run) pytest-timeout fires as configured.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

_DIR_VARIABLE = "RTDT_TIMEOUT_DUMPS"  # set by the controller, inherited by its workers


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER") and _DIR_VARIABLE not in os.environ:
        os.environ[_DIR_VARIABLE] = tempfile.mkdtemp(prefix="rtdt-timeouts-")
        config._rtdt_timeout_dumps = os.environ[_DIR_VARIABLE]


def pytest_unconfigure(config: pytest.Config) -> None:
    made = getattr(config, "_rtdt_timeout_dumps", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


def _dump_file(worker: str) -> Path:
    return Path(os.environ[_DIR_VARIABLE]) / f"{worker}.txt"


_armed: list = []  # the open dump file of the test being timed (at most one)


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> bool | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker or _DIR_VARIABLE not in os.environ or not settings.timeout:
        return None  # pytest-timeout's own timer
    dump = _dump_file(worker).open("w")
    dump.write(f"{item.nodeid}\n")  # faulthandler appends the stacks after it, if it fires
    dump.flush()
    faulthandler.dump_traceback_later(settings.timeout, exit=True, file=dump)
    _armed.append(dump)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> bool | None:
    if not _armed:
        return None
    faulthandler.cancel_dump_traceback_later()
    _armed.pop().close()
    return True


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    """The controller: a worker that ran past a test's time-out left every thread's stack."""
    dump = _dump_file(report.node.gateway.id)
    if not dump.exists():
        return
    nodeid, _, stacks = dump.read_text().partition("\n")
    if nodeid == crashitem and stacks.startswith("Timeout ("):
        report.longrepr = f"{report.longrepr}: past its time-out, every thread's stack:\n{stacks}"
