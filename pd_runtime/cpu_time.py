"""CPU seconds of a process or thread from Linux's /proc (its utime + stime): the router's host
report, the record writer's process and the bench's cost figures read them one way."""

from __future__ import annotations

import os
from typing import Optional

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_stat(path: str) -> Optional[list[str]]:
    """The fields of a /proc/<pid>[/task/<tid>]/stat file after the command name (which may
    hold spaces and parentheses): [0] state, [1] parent pid, [11] utime, [12] stime; None
    when it cannot be read (gone, or not Linux)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_s(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / _TICK
