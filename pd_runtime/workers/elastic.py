"""Elastic pools: the autoscaler's decisions acted on a running deployment (planner.autoscale).

One controller per deployment, a thread of the serve process beside the router's health checks
(several router replicas are refused: each keeps its own lists of the pools). Every interval_s
it reads the traffic the router saw (router/traffic.py) and the workers' last load reports, asks
pd_runtime/planner/autoscale.py for a split, and moves towards it:
- up: new workers start as the pool's others did (its engine settings and resources, outside
  the pool's placement group), are waited for until ready (weights loaded, warmed up), answer a
  load check, and only then join the router's lists;
- down: the least busy worker is drained (routed nothing new; what it runs ends where it runs),
  then stopped. After drain_timeout_s it is stopped all the same: its streams migrate to another
  decode worker, as after a crash. The last decode worker is never drained.
- re-role: where one pool shrinks as the other grows and the two pools' workers differ only in
  what a role decides (same resources; engine settings alike but threads, step pacing and CUDA
  graphs), a worker of the shrinking pool is drained and turned (PDWorker.set_role): weights,
  KV cache and prefix cache kept, no cold start. It keeps its actor, its id and its placement.
Whatever a re-role does not cover of a re-split starts the new workers before it drains the old.
The lists are replaced, never changed in place: a request iterating them meanwhile sees the old.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from typing import Optional

from pd_runtime.api import ModelCard
from pd_runtime.workers.client import PoolClient, WorkerRef
from pd_runtime.workers.pool import pool_engine, start_pool_worker, wait_ready

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
_DRAIN_POLL_S = 0.5


def _idle(load: dict) -> bool:
    """Nothing of any request left on the worker (its per-request tables all empty)."""
    return not load.get("num_running") and not load.get("num_waiting") \
        and not any((load.get("records") or {}).values())


class ElasticPools:
    """Starts and drains the workers of a running deployment's pools."""

    def __init__(self, cfg, client: PoolClient, model_dir: str, ready_timeout_s: float = 600.0,
                 on_event=None):
        """`on_event(kind, worker_id, seconds)`: told of each start (to ready) and drain (to
        stopped)."""
        self.cfg = cfg
        self.on_event = on_event
        self.client = client
        self.model_dir = model_dir
        self.ready_timeout_s = ready_timeout_s
        # Worker ids are never reused: the router keys its ledgers and prefix index by them.
        self._next = {role: getattr(cfg, role).num_workers for role in ROLES}
        self.events: deque = deque(maxlen=64)  # the latest starts and drains, for status
        # Placement-group bundles of stopped workers (Ray keeps a bundle reserved after its
        # actor ends): (the bundle's resources, its scheduling strategy), taken by new workers
        # that ask for the same.
        self._free_bundles: list[tuple[dict, object]] = []

    def workers(self, role: str) -> list[WorkerRef]:
        return list(self.client.prefill if role == "prefill" else self.client.decode)

    def _set(self, role: str, workers: list[WorkerRef]) -> None:
        if role == "prefill":
            self.client.prefill = workers
        else:
            self.client.decode = workers

    def grow(self, role: str, count: int) -> list[WorkerRef]:
        """Start `count` workers of `role`, wait until each is ready, add those that are."""
        import ray

        pool = getattr(self.cfg, role)
        target = len(self.workers(role)) + count
        engine = pool_engine(self.cfg, role, pool.model_copy(update={"num_workers": target}),
                             self.model_dir)
        started = time.monotonic()
        refs = []
        bundle = pool.resources.bundle()
        for _ in range(count):
            worker_id = f"{role}-{self._next[role]}"
            self._next[role] += 1
            held = next((i for i, (b, _) in enumerate(self._free_bundles) if b == bundle), None)
            placement = self._free_bundles.pop(held)[1] if held is not None else None
            ref = start_pool_worker(self.cfg, role, worker_id, engine, placement)
            ref.placement = placement
            refs.append(ref)
        joined = []
        for ref in refs:
            try:
                info = wait_ready([ref], self.ready_timeout_s)[0]
                card = ModelCard.from_dict(info["model_card"])
                known = self.client.model_card
                diff = known.differs_from(card) if known is not None else None
                if diff is not None:
                    raise RuntimeError(f"it serves the model differently ({diff})")
                asyncio.run(self.client.probe(ref, timeout_s=10.0))  # its first load report
            except Exception as exc:
                log.error("autoscale: worker %s did not start: %s", ref.worker_id, exc)
                ray.kill(ref.handle, no_restart=True)
                self._release(ref)
                self._event("start_failed", role, ref.worker_id, time.monotonic() - started)
                continue
            joined.append(ref)
            self._set(role, self.workers(role) + [ref])
            self._event("start", role, ref.worker_id, time.monotonic() - started)
        return joined

    def shrink(self, role: str, count: int, drain_timeout_s: float) -> list[str]:
        """Drain and stop the `count` least busy workers of `role` (never the last decode
        worker); their ids."""
        return self._each(self._least_busy(role, count), self._retire, role, drain_timeout_s)

    def re_role(self, role: str, to: str, count: int, drain_timeout_s: float) -> list[str]:
        """Drain the `count` least busy workers of `role` (never the last decode worker) and
        turn them into `to` workers; the ids of those that serve as `to` now."""
        turned = self._each(self._least_busy(role, count), self._turn, role, drain_timeout_s,
                            to)
        return [w for w in turned if any(r.worker_id == w for r in self.workers(to))]

    def can_re_role(self) -> bool:
        """Whether a worker of one pool can serve in the other as it is: the same resources,
        the same engine settings but for what a role decides."""
        role_only = {"num_threads", "min_step_interval_s", "cuda_graphs"}
        a, b = self.cfg.prefill, self.cfg.decode
        return a.resources == b.resources and \
            a.engine.model_dump(exclude=role_only) == b.engine.model_dump(exclude=role_only)

    def reconcile(self) -> None:
        """A re-roled worker that Ray restarted (a crash) comes back in the role it was created
        with: turned again, once idle, to the role of the list it is in."""
        for role in ROLES:
            for w in self.workers(role):
                if w.load.get("role") not in (None, role) and not w.draining:
                    try:
                        self._set_role(w, role)
                    except Exception as exc:  # busy yet: the next round
                        log.info("autoscale: %s back as %s, not re-roled yet: %s",
                                 w.worker_id, w.load.get("role"), exc)
                    else:
                        w.load = {**w.load, "role": role}

    def _least_busy(self, role: str, count: int) -> list[WorkerRef]:
        live = sorted(self.workers(role), key=lambda w: (not w.healthy,
                                                         -(w.load.get("num_running") or 0)
                                                         - (w.load.get("num_waiting") or 0)),
                      reverse=True)
        keep = 1 if role == "decode" else 0
        return live[:max(0, min(count, len(live) - keep))]

    @staticmethod
    def _each(chosen: list[WorkerRef], task, *args) -> list[str]:
        threads = [threading.Thread(target=task, args=(w, *args), name=f"drain-{w.worker_id}")
                   for w in chosen]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [w.worker_id for w in chosen]

    def _drain(self, role: str, worker: WorkerRef, deadline: float) -> None:
        """Routed nothing new, out of `role`'s list, idle (or past `deadline`)."""
        import ray

        worker.draining = True  # routed nothing new from now on (the router reads this flag)
        ray.get(worker.handle.set_draining.remote(True), timeout=10.0)
        self._until_idle(worker, deadline)
        # Out of the lists, then idle once more: a request routed just before the flag was
        # read has reached it by now.
        self._set(role, [w for w in self.workers(role) if w.worker_id != worker.worker_id])
        time.sleep(_DRAIN_POLL_S)
        self._until_idle(worker, max(time.monotonic() + 2.0, deadline))

    def _retire(self, worker: WorkerRef, role: str, drain_timeout_s: float) -> None:
        started = time.monotonic()
        try:
            self._drain(role, worker, started + drain_timeout_s)
        except Exception as exc:  # dead or unreachable: nothing left to wait for
            log.warning("autoscale: draining %s: %s", worker.worker_id, exc)
        self._stop(worker, role, "drain", started)

    def _stop(self, worker: WorkerRef, role: str, kind: str, started: float) -> None:
        """Out of `role`'s list, its actor ended, its bundle free for the next start."""
        import ray

        self._set(role, [w for w in self.workers(role) if w.worker_id != worker.worker_id])
        try:
            ray.kill(worker.handle, no_restart=True)
        except Exception:
            pass
        self._release(worker)
        self._event(kind, role, worker.worker_id, time.monotonic() - started)

    def _turn(self, worker: WorkerRef, role: str, drain_timeout_s: float, to: str) -> None:
        """Drain `worker` out of `role` and add it to `to`; stopped instead where it cannot
        turn (still busy at the deadline, or gone)."""
        import ray

        started = time.monotonic()
        try:
            self._drain(role, worker, started + drain_timeout_s)
            self._set_role(worker, to)
            ray.get(worker.handle.set_draining.remote(False), timeout=10.0)
        except Exception as exc:
            log.warning("autoscale: re-roling %s: %s; stopped instead", worker.worker_id, exc)
            self._stop(worker, role, "re_role_failed", started)
            return
        worker.role, worker.draining = to, False
        self._set(to, self.workers(to) + [worker])
        self._event("re_role", to, worker.worker_id, time.monotonic() - started)

    def _set_role(self, worker: WorkerRef, role: str) -> None:
        """The worker's threads and pacing as a new worker of `role`'s pool would get them."""
        import ray

        pool = getattr(self.cfg, role)
        size = len(self.workers(role)) + (0 if worker in self.workers(role) else 1)
        engine = pool_engine(self.cfg, role, pool.model_copy(update={"num_workers": size}),
                             self.model_dir)
        threads = engine.num_threads or max(1, int(pool.resources.num_cpus or 1))
        ray.get(worker.handle.set_role.remote(role, threads, engine.min_step_interval_s or 0.0),
                timeout=30.0)

    @staticmethod
    def _until_idle(worker: WorkerRef, deadline: float) -> None:
        import ray

        while not _idle(ray.get(worker.handle.load.remote(), timeout=10.0)):
            if time.monotonic() >= deadline:
                log.warning("autoscale: %s still busy at its drain deadline; stopped, its "
                            "streams migrate", worker.worker_id)
                return
            time.sleep(_DRAIN_POLL_S)

    def _release(self, worker: WorkerRef) -> None:
        if worker.placement is not None:  # (a re-roled worker's pools ask for the same)
            self._free_bundles.append((getattr(self.cfg, worker.role).resources.bundle(),
                                       worker.placement))

    def _event(self, kind: str, role: str, worker_id: str, seconds: float) -> None:
        self.events.append({"kind": kind, "role": role, "worker_id": worker_id,
                            "seconds": round(seconds, 3), "at": time.time()})
        log.info("autoscale: %s %s (%s) in %.1f s", kind, worker_id, role, seconds)
        if self.on_event is not None:
            self.on_event(kind, worker_id, seconds)


class Autoscaler:
    """The controller: every interval_s, decide (planner/autoscale.py) and act (ElasticPools)."""

    def __init__(self, cfg, client: PoolClient, model_dir: str, backend):
        self.cfg = cfg
        self.scale = cfg.planner.autoscale
        self.backend = backend  # the router: its traffic log, metrics and SLO targets
        self.pools = ElasticPools(
            cfg, client, model_dir,
            on_event=self._on_event)
        self.last: Optional[object] = None  # the last ScaleDecision
        self.changed_at = time.monotonic()
        self._stamp = self._config_stamp()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _on_event(self, kind: str, worker_id: str, seconds: float) -> None:
        self.backend.metrics.autoscale_events.labels(kind).observe(seconds)
        if kind == "drain":  # gone: its series and its prefix-index entries with it
            self.backend.metrics.forget_worker(worker_id)
            self.backend.index.forget(worker_id)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoscale", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.scale.interval_s):
            try:
                self.step()
            except Exception:  # a bad decision round must not end the controller
                log.exception("autoscale round failed")

    def current(self) -> dict[str, int]:
        return {role: len(self.pools.workers(role)) for role in ROLES}

    def step(self, now: Optional[float] = None):
        """One round: decide from the traffic and the loads, then act. The decision."""
        from pd_runtime.config import SLOTarget
        from pd_runtime.planner.autoscale import Traffic, costs_from_loads, decide

        now = time.monotonic() if now is None else now
        self.reload()
        if not self.scale.enabled:  # turned off in the file: the pools stay as they are
            return None
        self.pools.reconcile()
        traffic = Traffic(self.scale.window_s,
                          self.backend.traffic.recent(self.scale.window_s, now))
        loads = {w.worker_id: {**w.load, "role": w.role}
                 for role in ROLES for w in self.pools.workers(role) if w.load}
        target = self.backend.reloader.current.slo
        slo = SLOTarget(ttft_s=self.scale.ttft_s or target.ttft_s,
                        tpot_s=self.scale.tpot_s or target.tpot_s)
        current = self.current()
        try:
            costs = costs_from_loads(loads)
        except ValueError as exc:  # (no decode worker has fitted its step costs yet)
            log.info("autoscale: no decision this round: %s", exc)
            return None
        per_worker = {role: getattr(self.cfg, role).resources for role in ROLES}
        # max_cpus null on a local Ray: the machine's (it will not grow); on a cluster, the
        # bounds alone (a worker Ray cannot place yet waits for its autoscaler to add a node)
        budget = self._cpu_budget()
        scale = self.scale if budget == self.scale.max_cpus else \
            self.scale.model_copy(update={"max_cpus": budget})
        decision = decide(traffic, current, scale, costs, slo,
                          since_change_s=now - self.changed_at,
                          cpus={r: res.num_cpus for r, res in per_worker.items()},
                          gpus={r: res.num_gpus for r, res in per_worker.items()},
                          routing=self.backend.reloader.current)
        self.last = decision
        metrics = self.backend.metrics
        metrics.autoscale_decisions.labels(decision.reason).inc()
        for role in ROLES:
            metrics.autoscale_workers.labels(role, "desired").set(decision.desired[role])
        if decision.desired != current:
            log.info("autoscale: %s", decision.describe())
            self.act(current, decision.desired)
            self.changed_at = time.monotonic()
        for role, n in self.current().items():
            metrics.autoscale_workers.labels(role, "actual").set(n)
        return decision

    def act(self, current: dict[str, int], desired: dict[str, int]) -> None:
        """Re-roles first, where the pools allow them and one shrinks as the other grows (a
        drain, no cold start); then up, then down: what is left of a re-split keeps its old
        workers until the new ones serve; down first where the CPUs (max_cpus, or the
        cluster's) cannot hold both at once (a new worker would wait for the CPUs of one still
        draining)."""
        if self.pools.can_re_role():
            for role, to in (("prefill", "decode"), ("decode", "prefill")):
                n = min(current[role] - desired[role], desired[to] - current[to])
                if n > 0:
                    self.pools.re_role(role, to, n, self.scale.drain_timeout_s)
            current = self.current()

        def grow():
            for role in ROLES:
                if desired[role] > current[role]:
                    self.pools.grow(role, desired[role] - current[role])

        def shrink():
            for role in ROLES:
                if desired[role] < current[role]:
                    self.pools.shrink(role, current[role] - desired[role],
                                      self.scale.drain_timeout_s)

        cpus = {role: getattr(self.cfg, role).resources.num_cpus for role in ROLES}
        both = sum(max(current[r], desired[r]) * cpus[r] for r in ROLES)
        budget = self._cpu_budget()
        if budget is not None and both > budget + 1e-9:
            shrink()
            grow()
        else:
            grow()
            shrink()

    def _config_stamp(self) -> Optional[tuple]:
        path = getattr(self.backend.reloader, "path", None)
        try:
            st = os.stat(path) if path else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st else None

    def reload(self) -> bool:
        """planner.autoscale re-read from the config file (the router's, `--config`) when the
        file changed, as the router reloads its routing: a bad edit is logged with its field
        and line and the settings in force stay. True: new settings took effect."""
        from pd_runtime.config_loading import ConfigError, load_autoscale_config

        stamp = self._config_stamp()
        if stamp is None or stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            new = load_autoscale_config(self.backend.reloader.path)
        except (ConfigError, OSError) as exc:
            log.error("planner.autoscale reload rejected, keeping the settings in force: %s",
                      exc)
            return False
        if new == self.scale:
            return False
        log.info("planner.autoscale reloaded: %s", new.model_dump())
        self.scale = new
        return True

    def _cpu_budget(self) -> Optional[float]:
        """max_cpus, else a local Ray's CPUs; None: no budget but the pools' bounds."""
        if self.scale.max_cpus is not None or self.cfg.ray.address:
            return self.scale.max_cpus
        import ray

        return float(ray.cluster_resources().get("CPU", 0.0))

    def status(self) -> dict:
        """What /v1/router/config shows of it: the last decision, the pools now, the events."""
        last = self.last
        return {"enabled": True, "workers": self.current(),
                "desired": getattr(last, "desired", None),
                "reason": getattr(last, "reason", None),
                "rate": getattr(last, "rate", None),
                "decision": last.describe() if last is not None else None,
                "events": list(self.pools.events)}
