"""The driver's SIGTERM: `ray job stop`, a scheduler or a spot driver node asks the run to end.

The first SIGTERM asks the coordinator to stop at the next step boundary with a checkpoint (the
handler only sets a flag the state machine reads); a second one exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator

log = logging.getLogger("raytrain_dt.control.coordinator")


@contextlib.contextmanager
def sigterm_stops(
    request_stop: Callable[[str], None], stop_requested: Callable[[], object]
) -> Iterator[None]:
    """While in this block, SIGTERM calls `request_stop("SIGTERM")`, or exits if
    `stop_requested()` says a stop was already asked for."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may handle signals
        return

    def on_sigterm(signum, frame):
        if stop_requested():
            raise SystemExit(128 + signum)
        log.warning("SIGTERM: stopping at the next step boundary with a checkpoint")
        request_stop("SIGTERM")

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
