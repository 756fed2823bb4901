"""Workers that share a node's cores with the router (and the clients): how much their steps
stretch as the rest of the node's CPU work grows with the traffic.

A worker's step needs `threads` cores. While it runs, the node's other runnable work is the
other workers that are busy at the same moment (each with its threads) and the CPU that the
router, the clients and the workers' own work outside their steps (streaming tokens, sending
KV) take while the cluster computes, and the background CPU that runs all the time. When that adds up to more than the node's cores, the
kernel shares them and every step takes longer in proportion:

    stretch(w) = max(1, (threads(w) + sum over others o of threads(o) x P(o busy | w busy)
                         + background cores + traffic CPU / time any worker is busy) / cores)

The cost model's step costs were fitted during the calibration sweep, which ran under its own
(lower) load; the stretch is taken relative to that one. The simulator computes P(o busy | w
busy) from the busy intervals of its own run, so it runs again with the stretched costs until
the two agree (planner/simulator.py: simulate).
"""

from __future__ import annotations

import numpy as np

from planner.costs import HostCosts


def overlap_s(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Seconds two workers are busy at once: each list in time order, its intervals disjoint."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if end > start:
            total += end - start
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return total


def union_s(lists: list[list[tuple[float, float]]]) -> float:
    """Seconds at least one worker is busy."""
    spans = sorted(span for busy in lists for span in busy)
    total, start, end = 0.0, None, None
    for s, e in spans:
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (end - start if end is not None else 0.0)


def stretches(busy: dict[str, list[tuple[float, float]]], threads: dict[str, int],
              host: HostCosts, traffic_cpu_s: float) -> dict[str, float]:
    """Each worker's step stretch on the shared node, relative to the calibration's:
    `traffic_cpu_s`, the CPU that requests and tokens cost (spent while the workers compute
    them), over the time any worker is busy, plus the background that runs all the time."""
    any_busy = union_s(list(busy.values()))
    traffic = traffic_cpu_s / any_busy if any_busy > 0 else 0.0
    load = min(float(host.cores), host.idle_cores + traffic)
    own = {w: sum(e - s for s, e in spans) for w, spans in busy.items()}
    out = {}
    for w, spans in busy.items():
        others = 0.0
        if own[w] > 0:
            others = sum(threads[o] * overlap_s(spans, busy[o]) / own[w]
                         for o in busy if o != w)
        demand = threads[w] + others + load
        calibrated = threads[w] + host.calibration_cores
        out[w] = max(1.0, demand / host.cores) / max(1.0, calibrated / host.cores)
    return out


# ------------------------------------------------------------------------- the calibration's fit
def nnls(rows: list[list[float]], y: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0, for a handful of columns: the best of the
    unconstrained fits over each subset of columns whose coefficients all come out >= 0."""
    a, b = np.asarray(rows, dtype=float), np.asarray(y, dtype=float)
    n = a.shape[1] if a.ndim == 2 else 0
    best, best_err = np.zeros(n), float(b @ b)
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        x, _, rank, _ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if rank < len(cols) or x.min() < 0:
            continue
        full = np.zeros(n)
        full[cols] = x
        err = float(((a @ full - b) ** 2).sum())
        if err < best_err:
            best, best_err = full, err
    return best.tolist()


def fit_host(stages: list[dict], cores: int) -> HostCosts:
    """From the sweep's stages, each with its seconds, requests, output tokens and the CPU
    seconds the router, the client and the workers outside their steps spent meanwhile."""
    def fit(key: str, idle: bool) -> list[float]:
        rows = [([s["seconds"]] if idle else []) + [s["requests"], s["tokens"]] for s in stages]
        return nnls(rows, [s[key] for s in stages])

    router, runtime, client = fit("router_cpu_s", True), fit("runtime_cpu_s", True), \
        fit("client_cpu_s", False)
    seconds = sum(s["seconds"] for s in stages)
    busy = sum(s["router_cpu_s"] + s["runtime_cpu_s"] + s["client_cpu_s"] for s in stages)
    return HostCosts(cores=cores, idle_cores=router[0] + runtime[0],
                     router_request_cpu_s=router[1], router_token_cpu_s=router[2],
                     runtime_request_cpu_s=runtime[1], runtime_token_cpu_s=runtime[2],
                     client_request_cpu_s=client[0], client_token_cpu_s=client[1],
                     calibration_cores=busy / seconds if seconds > 0 else 0.0)
