"""A real MLflow tracking server on 127.0.0.1 (SQLite store) for tests/ray/test_trackers.py.

Its start costs ~10 s of CPU (the CLI's imports, then the store's migrations): 10 s on an idle
2-core host, but 80-100 s in `make test`, where the other xdist worker trains beside it, and a
worker waiting for it does nothing else meanwhile. Under xdist the controller therefore starts
it in the background (`EarlyServer`), once the workers' Ray clusters are up, and tells the
workers where its address will be (`MLFLOW_URI_FILE_ENV`): the tracker test finds it
answering. A run without xdist starts its own server when the test asks for one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# A file that holds the address of the server the xdist controller started (written once it
# has started), for its workers; its log is beside it.
MLFLOW_URI_FILE_ENV = "RTDT_TEST_MLFLOW_URI_FILE"
# What the controller waits before starting it: the workers' Ray clusters start first (a
# raylet aborts when its agent has not started within Ray's fixed 15 s on a busy host).
EARLY_START_DELAY_S = 60
# The file whose tests use it: the controller starts a server only when it is selected.
USED_BY = Path(__file__).parent / "ray" / "test_trackers.py"


@dataclass
class MlflowServer:
    process: subprocess.Popen
    uri: str
    root: Path

    @property
    def log_path(self) -> Path:
        return self.root / "server.log"

    def stop(self) -> None:
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(uri: str) -> bool:
    try:
        with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:  # not listening yet
        return False


def start(root: Path) -> MlflowServer:
    """`mlflow server` on a free loopback port, its files under `root`; not waited for."""
    port = _free_port()
    with open(root / "server.log", "w") as log:  # the child keeps its own descriptor
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlflow",
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{root}/mlflow.db",
                "--default-artifact-root",
                f"file://{root}/artifacts",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() ends everything it started
            # No job executor: it is not used here, and without `huey` installed it starts a
            # Python process again and again that fails, CPU taken from the server's own start.
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
    return MlflowServer(process, f"http://127.0.0.1:{port}", root)


def wait_healthy(uri: str, within_s: float, log_path: Path, process=None) -> None:
    deadline = time.monotonic() + within_s
    while not healthy(uri):
        if process is not None and process.poll() is not None:
            raise AssertionError(f"mlflow server exited:\n{log_path.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            tail = log_path.read_text()[-3000:] if log_path.exists() else "(no log yet)"
            raise AssertionError(f"mlflow server did not answer /health in {within_s} s:\n{tail}")
        time.sleep(0.5)


def selected(args: list[str], rootdir: Path) -> bool:
    """Whether pytest's path arguments (none: the whole suite) cover `USED_BY`."""
    paths = [a.split("::")[0] for a in args if not a.startswith("-")] or ["tests"]
    for path in paths:
        target = Path(path) if Path(path).is_absolute() else rootdir / path
        if target.resolve() == USED_BY or target.resolve() in USED_BY.parents:
            return True
    return False


def wait_for_early_server(uri_file: Path, within_s: float) -> str:
    """The controller's server's address, once it answers."""
    deadline = time.monotonic() + within_s
    log = uri_file.parent / "server.log"
    while not uri_file.exists():
        if time.monotonic() > deadline:
            said = log.read_text()[-3000:] if log.exists() else "(no log)"
            raise AssertionError(f"the mlflow server was not started in {within_s} s: {said}")
        time.sleep(0.5)
    uri = uri_file.read_text()
    wait_healthy(uri, deadline - time.monotonic(), log)
    return uri


class EarlyServer:
    """The controller's server: started `EARLY_START_DELAY_S` after the session starts, in a
    thread (the controller has nothing else to do), stopped at its end. The workers, spawned
    meanwhile, inherit where its address will be written."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rtdt_mlflow_"))
        self.uri_file = self.root / "uri"
        self.server: MlflowServer | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._start_later, daemon=True)

    def begin(self) -> None:
        os.environ[MLFLOW_URI_FILE_ENV] = str(self.uri_file)
        self._thread.start()

    def _start_later(self) -> None:
        if self._stopped.wait(EARLY_START_DELAY_S):
            return
        try:
            self.server = start(self.root)
        except Exception as exc:  # the waiting test says it was not started; this says why
            (self.root / "server.log").write_text(f"could not start mlflow server: {exc!r}\n")
            return
        written = self.uri_file.with_suffix(".tmp")
        written.write_text(self.server.uri)
        written.rename(self.uri_file)  # whole, or not there

    def end(self) -> None:
        self._stopped.set()
        self._thread.join()
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)
