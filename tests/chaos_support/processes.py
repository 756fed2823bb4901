"""The served product's process tree read from /proc: descendants and session members of one
root, so faults hit the right pid and a stop can prove that nothing of ours is left behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessId:
    """A pid plus its start time: a recycled pid is not mistaken for the process we saw."""
    pid: int
    start_ticks: int
    cmdline: str


def _stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, session id, start time in clock ticks), or None if the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name sits in parentheses and may itself hold spaces or parentheses.
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[3]), int(fields[19])


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace").strip()
    except OSError:
        return ""


def _all_pids() -> list[int]:
    return [int(name) for name in os.listdir("/proc") if name.isdigit()]


def tree(root: int, session: int | None = None) -> list[ProcessId]:
    """Every live descendant of `root` (root included), plus every process of `session`."""
    stats = {pid: st for pid in _all_pids() if (st := _stat(pid)) is not None}
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in stats and pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    if session is not None:
        found.update(pid for pid, (_, sid, _) in stats.items() if sid == session)
    return [ProcessId(pid, stats[pid][2], _cmdline(pid)) for pid in sorted(found)]


def alive(proc: ProcessId) -> bool:
    st = _stat(proc.pid)
    if st is None or st[2] != proc.start_ticks:
        return False
    try:  # a zombie has exited; only its parent's wait is missing
        return Path(f"/proc/{proc.pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def flag_value(procs: list[ProcessId], flag: str) -> str | None:
    """The value of `--flag=value` (or `--flag value`) on any of these command lines."""
    for proc in procs:
        parts = proc.cmdline.split()
        for i, part in enumerate(parts):
            if part.startswith(flag + "="):
                return part.split("=", 1)[1]
            if part == flag and i + 1 < len(parts):
                return parts[i + 1]
    return None
