"""What the clients send, for the simulator: arrival processes (Poisson, bursty gamma gaps, a
trace's own times) and request lengths (the bimodal mix, fixed, a trace's rows).

A workload file (YAML or JSON) holds the fields of `Workload`; a trace is JSON lines of
{"t": seconds, "input_len": n, "output_len": n} ("t" optional: then the arrival process draws
the times) or a bench/goodput.py --json file, whose requests are replayed as they were sent.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import yaml


@dataclass(frozen=True)
class SimRequest:
    index: int
    arrival_s: float
    prompt_len: int
    max_tokens: int


@dataclass
class Workload:
    mix: str = "bimodal"         # bimodal | fixed | trace
    arrival: str = "poisson"     # poisson | gamma | trace (the trace's own times)
    burstiness: float = 1.0      # gamma: shape of the gaps (CV = 1/sqrt(shape); <1 is bursty)
    short_len: int = 128
    long_len: int = 2048
    long_fraction: float = 0.2
    input_len: int = 256         # fixed
    output_len: int = 64
    trace: Optional[str] = None  # mix or arrival `trace`: the file
    trace_point: int = 0         # a bench/goodput.py --json trace: which of its points

    def __post_init__(self):
        if self.mix not in ("bimodal", "fixed", "trace"):
            raise ValueError(f"workload.mix: {self.mix!r} is not bimodal, fixed or trace")
        if self.arrival not in ("poisson", "gamma", "trace"):
            raise ValueError(f"workload.arrival: {self.arrival!r} is not poisson, gamma or trace")
        if "trace" in (self.mix, self.arrival) and not self.trace:
            raise ValueError("workload.trace: a file is needed for a trace mix or arrival")
        if not 0.0 <= self.long_fraction <= 1.0:
            raise ValueError("workload.long_fraction must be within [0, 1]")
        if self.burstiness <= 0:
            raise ValueError("workload.burstiness must be > 0")
        self._rows: Optional[list[tuple[Optional[float], int, int]]] = None

    @classmethod
    def load(cls, path: str | Path) -> "Workload":
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"workload {path}: expected a mapping of fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"workload {path}: unknown fields {unknown}")
        workload = cls(**data)
        if workload.trace and not Path(workload.trace).is_absolute():
            workload.trace = str(Path(path).parent / workload.trace)
        return workload

    # -- requests --------------------------------------------------------------------------
    def requests(self, rate: Optional[float] = None, num_requests: Optional[int] = None,
                 duration_s: Optional[float] = None, seed: int = 0) -> list[SimRequest]:
        """The requests of one run: `rate` per second until `num_requests` or `duration_s`
        (a trace's own times need neither)."""
        # Times and lengths from their own streams: the first n requests of a longer run are
        # the n requests of a shorter one.
        rng, lengths = random.Random(f"{seed}:arrivals"), random.Random(f"{seed}:lengths")
        rows = self._trace_rows() if "trace" in (self.mix, self.arrival) else None
        if self.arrival == "trace":
            times = [t for t, _, _ in rows]
            if any(t is None for t in times):
                raise ValueError(f"workload.trace {self.trace}: rows without 't' cannot give "
                                 "the arrival times")
            if num_requests is not None:
                times = times[:num_requests]
        else:
            if not rate or rate <= 0:
                raise ValueError("a rate > 0 is needed for a poisson or gamma arrival")
            if num_requests is None and duration_s is None:
                raise ValueError("num_requests or duration_s is needed")
            shape = 1.0 if self.arrival == "poisson" else self.burstiness
            times = arrival_offsets(rate, rng, num_requests, duration_s, shape)
        out = []
        for i, t in enumerate(times):
            if self.mix == "trace":
                _, prompt_len, max_tokens = rows[i % len(rows)]
            elif self.mix == "fixed":
                prompt_len, max_tokens = self.input_len, self.output_len
            else:
                long = lengths.random() < self.long_fraction
                prompt_len = self.long_len if long else self.short_len
                max_tokens = self.output_len
            out.append(SimRequest(i, t, prompt_len, max_tokens))
        return out

    def _trace_rows(self) -> list[tuple[Optional[float], int, int]]:
        if self._rows is None:
            self._rows = read_trace(self.trace, self.trace_point)
        return self._rows


def arrival_offsets(rate: float, rng: random.Random, num_requests: Optional[int] = None,
                    duration_s: Optional[float] = None, burstiness: float = 1.0) -> list[float]:
    """Arrival times from the start: gamma gaps of mean 1/rate and CV 1/sqrt(burstiness)
    (1 is Poisson), until num_requests or duration_s, whichever comes first (the load
    generator, bench/goodput.py, draws its send times with this too)."""
    if num_requests is None and duration_s is None:
        raise ValueError("arrival_offsets needs num_requests or duration_s")
    offsets, now = [], 0.0
    while num_requests is None or len(offsets) < num_requests:
        now += rng.gammavariate(burstiness, 1.0 / (burstiness * rate))
        if duration_s is not None and now > duration_s:
            break
        offsets.append(now)
    return offsets


def read_trace(path: str | Path, point: int = 0) -> list[tuple[Optional[float], int, int]]:
    """(arrival seconds or None, input_len, output_len) rows, in arrival order; `point`: which
    point of a bench/goodput.py --json file."""
    text = Path(path).read_text()
    rows: list[tuple[Optional[float], int, int]] = []
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None  # JSON lines
    if isinstance(data, dict) and "points" in data:
        # bench/goodput.py --json: every request as it was sent
        if not 0 <= point < len(data["points"]):
            raise ValueError(f"trace {path}: no point {point} (it has {len(data['points'])})")
        records = sorted(data["points"][point]["requests"], key=lambda r: r["scheduled_s"])
        rows.extend((r["scheduled_s"], r["input_len"], r["output_len"]) for r in records)
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                rows.append((item.get("t"), int(item["input_len"]), int(item["output_len"])))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"trace {path} line {number}: {exc}") from None
    if not rows:
        raise ValueError(f"trace {path}: no requests")
    return rows
