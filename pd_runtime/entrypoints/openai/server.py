"""Runs the router app under uvicorn: in the foreground (`serve_http`) or on a background thread
with a clean stop (`start_in_thread`), as tests and embedded uses need.
"""

from __future__ import annotations

import gc
import socket
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


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other processes may bind to the same port too (SO_REUSEPORT):
    the kernel spreads new connections over every replica's socket."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def settle_heap() -> None:
    """What start-up built (the app, its libraries, the tokenizer) lives as long as the process:
    taken out of the garbage collector's full passes, which otherwise walk those ~200k objects
    each time requests' longer-lived objects (runs kept for replay, say) pile up (measured in
    process: a 174 ms pass within 8000 requests; none with the start-up objects frozen)."""
    gc.freeze()


def serve_http(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
               reuse_port: bool = False) -> None:
    """Serve until SIGINT / SIGTERM (`reuse_port`: beside other router replicas)."""
    server = uvicorn.Server(_config(app, host, port, log_level))
    settle_heap()
    server.run(sockets=[reuse_port_socket(host, port)] if reuse_port else None)


class BackgroundServer:
    """A uvicorn server on a daemon thread; `port` is the bound one (port 0 picks a free one)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 reuse_port: bool = False):
        self.server = uvicorn.Server(_config(app, host, port, log_level))
        sockets = [reuse_port_socket(host, port)] if reuse_port else None
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets},
                                       name="router-http", daemon=True)
        self.port: Optional[int] = None

    def start(self, timeout_s: float = 30.0) -> "BackgroundServer":
        settle_heap()
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
