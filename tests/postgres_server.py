"""A throwaway PostgreSQL server for a test session: initdb into a temporary directory, served on
a unix socket only, one fresh database per test, stopped with no process left at the end.

PostgreSQL refuses to run as root, so under root (CI containers, `unshare -n`) the server runs
as `nobody`; the directories it writes are handed to that user.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import psycopg

SERVER_PROGRAMS = ("initdb", "pg_ctl", "postgres")
PORT = 5432  # only names the socket file (.s.PGSQL.5432) in a directory of our own


def server_bin_dir() -> Path:
    """The directory with initdb, pg_ctl and postgres: on PATH, else Debian's versioned
    /usr/lib/postgresql/<major>/bin (which is not on PATH), newest first."""
    on_path = shutil.which("initdb")
    candidates = [Path(on_path).resolve().parent] if on_path else []
    candidates += sorted((Path(d) for d in glob.glob("/usr/lib/postgresql/*/bin")),
                         key=lambda d: _major(d.parent.name), reverse=True)
    for directory in candidates:
        if all((directory / name).exists() for name in SERVER_PROGRAMS):
            return directory
    raise RuntimeError(
        "the PostgreSQL server programs (initdb, pg_ctl, postgres) are not on PATH nor under "
        "/usr/lib/postgresql/*/bin; run `make install`, which installs Debian's postgresql "
        "package")


def _major(name: str) -> float:
    try:
        return float(name)
    except ValueError:
        return -1.0


class PostgresServer:
    def __init__(self) -> None:
        self.bin = server_bin_dir()
        # Under /tmp: a unix socket's path may not exceed 107 bytes (long TMPDIRs do), and
        # /tmp is traversable by the unprivileged server user.
        self.root = Path(tempfile.mkdtemp(prefix="pd-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.log = self.root / "server.log"
        self._user = _unprivileged_user() if os.geteuid() == 0 else None
        if self._user is not None:
            os.chown(self.root, self._user.pw_uid, self._user.pw_gid)
        self._proc: Optional[subprocess.Popen] = None
        self.start_s = 0.0  # how long initdb plus start-up took

    def url(self, database: str) -> str:
        return f"postgresql://postgres@/{database}?host={self.root}&port={PORT}"

    def start(self, timeout_s: float = 60.0) -> None:
        began = time.monotonic()
        # --no-sync and fsync=off: a test database need not survive a power cut.
        self._run([self.bin / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust",
                   "--encoding=UTF8", "--locale=C", "--no-sync"], timeout_s)
        self._launch(began + timeout_s)
        self.start_s = time.monotonic() - began

    def pause(self) -> None:
        """An outage: the server stopped (its clients' connections broken), its data kept for
        resume() (a fast stop: this server does not sync its commits, and an immediate stop
        would lose the last of them, which a real database does not)."""
        self._halt("fast")

    def resume(self, timeout_s: float = 60.0) -> None:
        self._launch(time.monotonic() + timeout_s)

    def _launch(self, deadline: float) -> None:
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [self.bin / "postgres", "-D", self.data, "-k", self.root, "-p", str(PORT),
                 "-c", "listen_addresses=", "-c", "fsync=off", "-c", "synchronous_commit=off",
                 "-c", "full_page_writes=off", "-c", "max_connections=120"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                **self._as_user())
        while True:
            try:
                psycopg.connect(self.url("postgres"), connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"PostgreSQL did not start; its log:\n{self._log_tail()}")
                time.sleep(0.05)

    def create_database(self) -> str:
        """A new empty database; its URL (unix socket host, libpq style)."""
        name = f"test_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """The server stopped and its directory removed."""
        self._halt()
        shutil.rmtree(self.root, ignore_errors=True)

    def _halt(self, mode: str = "immediate") -> None:
        """pg_ctl stop (immediate: its children quit at once, nothing is flushed), then make
        sure the postmaster and every process it started are gone."""
        proc, self._proc = self._proc, None
        if proc is not None:
            children = _children(proc.pid)
            if proc.poll() is None:
                subprocess.run([self.bin / "pg_ctl", "stop", "-D", self.data, "-m", mode,
                                "-w", "-t", "30"], capture_output=True, timeout=60,
                               **self._as_user())
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pid, started in children:  # the postmaster waits for them; this is a backstop
                if _start_time(pid) == started:
                    os.kill(pid, 9)

    def _run(self, command: list, timeout_s: float) -> None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                              **self._as_user())
        if done.returncode != 0:
            raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}):\n"
                               f"{done.stdout}{done.stderr}")

    def _as_user(self) -> dict:
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": [],
                "env": {**os.environ, "HOME": str(self.root), "USER": self._user.pw_name}}

    def _log_tail(self) -> str:
        try:
            return self.log.read_text(errors="replace")[-4000:]
        except OSError:
            return "(no log)"


@contextmanager
def running_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _unprivileged_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        raise RuntimeError("running as root, and there is no `nobody` user to run PostgreSQL "
                           "as (it refuses to run as root)") from None


def _children(parent: int) -> list[tuple[int, str]]:
    """(pid, start time) of the processes whose parent is `parent`: the start time tells a
    child from a later process that reuses its pid."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None and fields[1] == str(parent):
                found.append((int(entry), fields[19]))
    return found


def _start_time(pid: int) -> Optional[str]:
    fields = _stat(pid)
    return fields[19] if fields is not None else None


def _stat(pid: int) -> Optional[list[str]]:
    """/proc/<pid>/stat's fields after the command name (state, ppid, ...; field 22 of the
    file, the start time, is index 19)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()
