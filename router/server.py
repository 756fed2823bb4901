"""Runs the router app under uvicorn: in the foreground (`serve_http`) or on a background thread
with a clean stop (`start_in_thread`), as tests and embedded uses need.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import uvicorn

# Streams still open at shutdown get this long before their connections are closed.
GRACEFUL_SHUTDOWN_S = 2.0


def _config(app, host: str, port: int, log_level: str) -> uvicorn.Config:
    # Our middleware logs one line per request with its id; uvicorn's access log would repeat it.
    # lifespan "on": the app's shutdown stops what it started (the request parser process).
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                          lifespan="on", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)


def serve_http(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve until SIGINT / SIGTERM."""
    uvicorn.Server(_config(app, host, port, log_level)).run()


class BackgroundServer:
    """A uvicorn server on a daemon thread; `port` is the bound one (port 0 picks a free one)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.server = uvicorn.Server(_config(app, host, port, log_level))
        self.thread = threading.Thread(target=self.server.run, name="router-http", daemon=True)
        self.port: Optional[int] = None

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the HTTP server exited while starting (port in use?)")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the HTTP server did not start within {timeout_s}s")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        if self.thread.is_alive():  # a stuck stream: close connections without waiting
            self.server.force_exit = True
            self.thread.join(timeout_s)


def start_in_thread(app, host: str = "127.0.0.1", port: int = 0) -> tuple[BackgroundServer, int]:
    """Start serving `app` on a background thread; `server.stop()` shuts it down cleanly."""
    server = BackgroundServer(app, host, port).start()
    return server, server.port
