"""Preemption notices seen from inside a rank actor: SIGTERM to the worker process, and the
cloud's spot notice (AWS instance metadata `spot/instance-action`) polled on the node.

A notice does not stop anything here: it is held and shown in every health poll, and the
coordinator answers it by checkpointing at the next step boundary and re-forming without the
node. After a SIGTERM the process exits by itself once `grace_s` has passed, as it would have.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urljoin

from raytrain_dt.worker.reports import Notice

log = logging.getLogger(__name__)

SPOT_POLL_INTERVAL_S = 1.0
# IMDSv2 wants a session token first; a server without that endpoint is asked without one.
IMDS_TOKEN_PATH = "/latest/api/token"


# The board SIGTERM goes to while a rank trains (`catch_sigterm`), and the handler the router
# replaced (Ray's), which SIGTERM goes to otherwise.
_armed: NoticeBoard | None = None
_replaced_sigterm: object = signal.SIG_DFL


def route_sigterm() -> None:
    """Install, once and from the main thread (the only one that may: with concurrency groups
    Ray runs an actor's methods on other threads, its constructor on the main one), a SIGTERM
    handler that hands the signal to the armed board, else to the handler it replaced."""
    global _replaced_sigterm
    if threading.current_thread() is not threading.main_thread():
        return

    def on_sigterm(signum, frame):
        board = _armed
        if board is not None:
            board.on_sigterm()
        elif callable(_replaced_sigterm):
            _replaced_sigterm(signum, frame)
        elif _replaced_sigterm != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    _replaced_sigterm = signal.signal(signal.SIGTERM, on_sigterm)


class NoticeBoard:
    def __init__(self, node_id: str):
        self.node_id = node_id
        self.notice: Notice | None = None
        self._watching: str | None = None
        self._grace_s = 0.0

    def post(self, source: str, detail: str) -> None:
        if self.notice is None:
            log.warning("preemption notice (%s): %s", source, detail)
            self.notice = Notice(source, detail, time.time())

    # --- SIGTERM -----------------------------------------------------------------------------
    def catch_sigterm(self, grace_s: float) -> None:
        """From now on SIGTERM (routed here by `route_sigterm`) is a notice, and the process
        exits `grace_s` later (a second SIGTERM exits at once). Any thread may call it."""
        global _armed
        self._grace_s, _armed = grace_s, self

    def on_sigterm(self) -> None:
        if self.notice is not None and self.notice.source == "sigterm":
            os._exit(1)
        self.post("sigterm", f"SIGTERM to pid {os.getpid()}; exiting in {self._grace_s:.0f}s")
        timer = threading.Timer(self._grace_s, os._exit, args=(1,))
        timer.daemon = True
        timer.start()

    def release_sigterm(self) -> None:
        """Give SIGTERM back to the replaced handler (the actor is between layouts)."""
        global _armed
        if _armed is self:
            _armed = None

    # --- spot notice -------------------------------------------------------------------------
    def watch_spot(self, url: str | None) -> None:
        """Poll `url` (`{node_id}` is filled in) in a daemon thread, once per actor."""
        if not url or self._watching:
            return
        self._watching = url.format(node_id=self.node_id)
        threading.Thread(target=self._poll_spot, name="spot-notice", daemon=True).start()

    def _poll_spot(self) -> None:
        url = self._watching
        while self.notice is None:
            with contextlib.suppress(OSError):  # unreachable or not a cloud node: try again
                body = _fetch_spot_notice(url)
                if body is not None:
                    self.post("spot", f"{url}: {body.strip()[:200]}")
                    return
            time.sleep(SPOT_POLL_INTERVAL_S)


def _fetch_spot_notice(url: str) -> str | None:
    """The notice's body, or None while there is none (the endpoint answers 404)."""
    headers = {}
    token_request = urllib.request.Request(
        urljoin(url, IMDS_TOKEN_PATH),
        method="PUT",
        headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
    )
    with (
        contextlib.suppress(urllib.error.HTTPError),
        urllib.request.urlopen(token_request, timeout=1.0) as response,
    ):
        headers["X-aws-ec2-metadata-token"] = response.read().decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=1.0) as r:
            return r.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
