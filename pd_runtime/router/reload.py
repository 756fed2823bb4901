"""Live reload of the routing section: the config file is re-read when it changes (checked
every `reload_interval_s`) or at once on SIGHUP. A bad edit is logged with the field and line
and the settings in force stay; a good one takes effect for the next request.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from typing import Callable, Optional

from pd_runtime.config import RoutingConfig
from pd_runtime.config_loading import ConfigError, load_routing_config

log = logging.getLogger(__name__)


class RoutingReloader:
    def __init__(self, path: Optional[str], initial: RoutingConfig, interval_s: float = 2.0,
                 on_result: Optional[Callable[[str], None]] = None):
        self.path = Path(path) if path else None
        self.current = initial
        self.interval_s = interval_s
        self.on_result = on_result or (lambda result: None)
        self.last_error: Optional[str] = None
        self._mtime = self._stat()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _stat(self):
        try:
            st = os.stat(self.path) if self.path else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st else None

    def check(self, force: bool = False) -> bool:
        """Reload if the file changed (or when forced); True if new settings took effect."""
        if self.path is None:
            return False
        stamp = self._stat()
        if not force and stamp == self._mtime:
            return False
        self._mtime = stamp
        try:
            new = load_routing_config(self.path)
        except (ConfigError, OSError) as exc:
            self.last_error = str(exc)
            log.error("routing config reload rejected, keeping the settings in force: %s", exc)
            self.on_result("rejected")
            return False
        self.last_error = None
        if new == self.current:
            return False
        log.info("routing config reloaded from %s: %s", self.path, new.model_dump())
        self.current = new
        self.on_result("applied")
        return True

    def start(self, install_sighup: bool = True) -> None:
        if self.path is None:
            return
        if install_sighup and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, lambda *_: self._wake.set())
        self._thread = threading.Thread(target=self._run, name="routing-reload", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            forced = self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.check(force=forced)
            except Exception:  # a reload problem must never take the router down
                log.exception("routing config reload failed")

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout=5)
