"""Graceful shutdown: a uvicorn server that drains on SIGTERM / SIGINT instead of dropping requests.

The first signal stops admission (new requests and /health get a 503 while the listener stays open), lets the
requests already in finish for up to `--shutdown-timeout` seconds, cancels what is left (its clients get an error
event or a 503), and then lets uvicorn close. A second signal exits at once. The process exits 0 either way.
"""
from __future__ import annotations

import signal
import threading
import time
from types import FrameType

import uvicorn

from moestream.server.app import ServerState, create_app

DRAIN_POLL_S = 0.05


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, srv: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.srv = srv
        self.shutdown_timeout = shutdown_timeout
        self._drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn re-raises the signals it recorded once it has shut down, which would end the process with
        # -SIGTERM; a drained shutdown is a normal exit, so nothing is recorded here.
        if self._drainer is not None:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        self.srv.scheduler.drain()
        self._drainer = threading.Thread(target=self._drain, name="moestream-drain", daemon=True)
        self._drainer.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while not self.srv.scheduler.idle and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        self.srv.scheduler.stop()  # cancels whatever is still running: its clients get a 503
        self.should_exit = True


def serve(srv: ServerState, host: str, port: int, shutdown_timeout: float) -> None:
    config = uvicorn.Config(create_app(srv), host=host, port=port, log_level="warning")
    DrainingServer(config, srv, shutdown_timeout).run()
