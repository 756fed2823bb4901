"""Workers that share a node's cores with the router (and the clients): how much their steps
stretch while other work runs on the same cores.

A worker's step needs `threads` cores. While it runs, the node's other runnable work is the
other workers busy at that moment (each with its threads), and the CPU that the router, the
clients and the workers' own work outside their steps take: the background that runs all the
time plus the traffic's share (CPU per request and per token, spread over the time any worker is
busy). When that adds up to more than the node's cores, the kernel shares them and every step
in progress advances that much slower:

    stretch(w, t) = max(1, (threads(w) + sum of threads(o) over the others o busy at t
                            + background cores + traffic cores) / cores)

relative to the same figure during the calibration sweep, which fitted the step costs under its
own (lower) load. NodeCores applies it moment by moment in the simulator: a step is an amount
of work, and when a worker starts or stops, the steps in progress on the others are re-timed.
(One factor per worker averaged over the run would miss the steps that overlap: at 1 req/s
on two cores a 2048-token prefill beside a decoding worker measured +27% while the average
demand stays under the two cores.) The traffic's share comes from the simulator's previous
run over the same requests (pd_runtime/planner/simulator.py: simulate).
"""

from __future__ import annotations

import numpy as np

from pd_runtime.planner.costs import HostCosts


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


def load_cores(host: HostCosts, busy: list[list[tuple[float, float]]],
               traffic_cpu_s: float) -> float:
    """The cores the node's work besides the steps takes while any worker is busy: the
    background, and `traffic_cpu_s` (what requests and tokens cost) over the busy time."""
    any_busy = union_s(busy)
    traffic = traffic_cpu_s / any_busy if any_busy > 0 else 0.0
    return min(float(host.cores), host.idle_cores + traffic)


class NodeCores:
    """The workers of one node sharing its cores, for the simulator's engines: each piece of
    work (a step, or a run of decode steps) is `seconds` of compute at no contention and
    advances at 1 / stretch, the stretch set by which workers are busy at the moment (`load`:
    the other work's cores, load_cores)."""

    def __init__(self, sim, host: HostCosts, load: float):
        self.sim, self.cores, self.load = sim, float(host.cores), load
        # What the step costs were fitted under (besides the worker's own threads).
        self.calibration_cores = host.calibration_cores + host.calibration_others_cores
        self.busy_threads = 0
        self.busy: set = set()
        # engine -> [work, done, since, stretch, fn]: its piece in progress
        self.pieces: dict = {}
        self.work_s: dict = {}  # engine -> compute seconds of its pieces begun (stretch: busy / this)

    def stretch(self, engine) -> float:
        t = engine.costs.threads
        others = self.busy_threads - (t if engine in self.busy else 0)
        demand = (t + others + self.load) / self.cores
        return max(1.0, demand) / max(1.0, (t + self.calibration_cores) / self.cores)

    def begin(self, engine, seconds: float, fn) -> None:
        """`engine` starts a piece of `seconds` of compute; `fn` runs when it is done."""
        if engine not in self.busy:
            self.busy.add(engine)
            self.busy_threads += engine.costs.threads
            self._retime(engine)
        stretch = self.stretch(engine)
        now = self.sim.now

        def finished() -> None:  # done: no longer re-timed (fn may start other workers' work)
            self.pieces.pop(engine, None)
            fn()

        self.pieces[engine] = [seconds, 0.0, now, stretch, finished]
        self.work_s[engine] = self.work_s.get(engine, 0.0) + seconds
        engine._event = self.sim.at(now + seconds * stretch, finished)

    def rest(self, engine) -> None:
        """`engine` has nothing to do: the others' steps speed up."""
        self.pieces.pop(engine, None)
        if engine in self.busy:
            self.busy.discard(engine)
            self.busy_threads -= engine.costs.threads
            self._retime(engine)

    def done(self, engine) -> float:
        """Compute seconds of its piece in progress done by now."""
        work, done, since, stretch, _ = self.pieces[engine]
        return done + (self.sim.now - since) / stretch

    def resize(self, engine, seconds: float) -> None:
        """Its piece in progress is now `seconds` of compute in all (a decode run cut short)."""
        piece = self.pieces[engine]
        self.work_s[engine] += seconds - piece[0]
        piece[0] = seconds
        self._reschedule(engine, piece, moved=True)

    def _retime(self, changed) -> None:
        for engine, piece in self.pieces.items():
            if engine is not changed:
                self._reschedule(engine, piece)

    def _reschedule(self, engine, piece: list, moved: bool = False) -> None:
        """Its progress brought up to now at the stretch it had; its end at the stretch now."""
        now = self.sim.now
        work, done, since, stretch, fn = piece
        done += (now - since) / stretch
        new = self.stretch(engine)
        piece[1], piece[2], piece[3] = done, now, new
        if new != stretch or moved:
            self.sim.cancel(engine._event)
            engine._event = self.sim.at(now + max(0.0, work - done) * new, fn)


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
    seconds the router, the client and the workers outside their steps spent meanwhile (and,
    where the workers say, their steps' busy time and the others' engine CPU beside it:
    `engine_busy_s`, `engine_beside_s`)."""
    def fit(key: str, idle: bool) -> list[float]:
        rows = [([s["seconds"]] if idle else []) + [s["requests"], s["tokens"]] for s in stages]
        return nnls(rows, [s[key] for s in stages])

    router, runtime, client = fit("router_cpu_s", True), fit("runtime_cpu_s", True), \
        fit("client_cpu_s", False)
    seconds = sum(s["seconds"] for s in stages)
    busy = sum(s["router_cpu_s"] + s["runtime_cpu_s"] + s["client_cpu_s"] for s in stages)
    # Each worker's steps weighted by their time, beside the others' engine CPU over the stage.
    steps = sum(s.get("engine_busy_s", 0.0) for s in stages)
    beside = sum(s.get("engine_beside_s", 0.0) for s in stages)
    return HostCosts(cores=cores, idle_cores=router[0] + runtime[0],
                     router_request_cpu_s=router[1], router_token_cpu_s=router[2],
                     runtime_request_cpu_s=runtime[1], runtime_token_cpu_s=runtime[2],
                     client_request_cpu_s=client[0], client_token_cpu_s=client[1],
                     calibration_cores=busy / seconds if seconds > 0 else 0.0,
                     calibration_others_cores=beside / steps if steps > 0 else 0.0)
