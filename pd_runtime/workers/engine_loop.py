"""Runs an engine on its own thread inside a worker: steps continuously while work exists,
takes commands between steps, and hands each request's outputs to asyncio streams.

The engine is single-threaded by design; every call into it goes through `call()` so it runs
on the engine thread between two steps. Outputs reach the actor's event loop thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional

from pd_runtime.engine.engine import LLMEngine, RequestOutput
from pd_runtime.workers.node_signals import BusyFlag, PrefillWatch

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_REPORT_EVERY_S = 0.02  # how often the engine thread republishes its load report
_PACE_POLL_S = 0.005    # a paced step looks this often whether the prefill workers are done
_PACE_EWMA = 0.02       # per step: the wait a step paid lately, over ~50 steps


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_step_failure: Optional[Callable[[Exception], None]] = None,
                 busy_flag: Optional[BusyFlag] = None,
                 prefill_watch: Optional[PrefillWatch] = None):
        """busy_flag: a prefill worker's, set while its engine has work; prefill_watch: a
        decode worker's view of those flags on its machine, which paces its steps."""
        self.engine = engine
        self.loop = loop
        self._on_step_failure = on_step_failure  # before the thread ends
        self._commands: "queue.Queue[tuple[Callable, asyncio.Future | None]]" = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._tick_hooks: list[Callable[[LLMEngine], None]] = []
        self._stopped = threading.Event()
        self.steps = 0
        # engine.min_step_interval_s: steps paced while a prefill worker on this machine computes
        self._min_step_s = (engine.config.min_step_interval_s or 0.0) \
            if engine.config.device == "cpu" else 0.0
        self._busy_flag, self._watch = busy_flag, prefill_watch
        self.paced_s = 0.0  # time spent waiting between steps for the prefill workers' sake
        self.pace_wait_s = 0.0  # the wait per step lately (EWMA): what the router adds to a step
        self._report: Optional[dict] = None  # the engine's load report, as of _report_at
        self._report_at = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- called from the event loop ----------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps; returns its result. Raises
        at once (or when the thread ends before it ran) once the engine thread is gone."""
        if not self._thread.is_alive():
            raise RuntimeError("the engine thread has stopped")
        fut = self.loop.create_future()
        self._commands.put((fn, fut))
        return await fut

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Fire-and-forget `fn(engine)` on the engine thread (callable from any thread)."""
        self._commands.put((fn, None))

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """Outputs of `request_id`, in order; open it before the request can produce any."""
        q = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        """Stop delivering; a reader still waiting gets None (the request ended elsewhere)."""
        q = self._streams.pop(request_id, None)
        if q is not None:
            q.put_nowait(None)

    def end_stream(self, request_id: str, error: Exception) -> None:
        """From the engine thread: the request ended here with `error` (its deadline passed);
        its reader gets the error after every output delivered before it."""
        def end():
            q = self._streams.pop(request_id, None)
            if q is not None:
                q.put_nowait(error)

        self.loop.call_soon_threadsafe(end)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def latest_report(self) -> Optional[dict]:
        """The engine's load report as of the last loop iteration (at most one step old), with
        its age; None before the first."""
        if not self._thread.is_alive():  # a step raised: this worker serves nothing any more
            raise RuntimeError("the engine thread has stopped")
        report = self._report
        if report is None:
            return None
        return {**report, "report_age_s": time.monotonic() - self._report_at}

    def add_tick_hook(self, hook: Callable[[LLMEngine], None]) -> None:
        """Called on the engine thread once per loop iteration (poll transfers, deadlines)."""
        self._tick_hooks.append(hook)

    def retune(self, min_step_s: float,
               signals: Callable[[], tuple[Optional[BusyFlag], Optional[PrefillWatch]]]) -> None:
        """On the engine thread (through `call`): a re-roled worker's pacing and node signals.
        The old ones close first: a new prefill flag takes the same file (one per process)."""
        for signal in (self._busy_flag, self._watch):
            if signal is not None:
                signal.close()
        self._busy_flag, self._watch = signals()
        self._min_step_s = min_step_s if self.engine.config.device == "cpu" else 0.0
        self._publish(time.monotonic())  # a load() right after sees the new pacing

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the engine thread after its current step; whether it ended within `timeout_s`."""
        self._stopped.set()
        self._commands.put((lambda e: None, None))
        self._thread.join(timeout=timeout_s)
        ended = not self._thread.is_alive()
        if ended:
            for signal in (self._busy_flag, self._watch):
                if signal is not None:
                    signal.close()
        return ended

    # -- the engine thread -------------------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
            if out.finished:
                self._streams.pop(out.request_id, None)

    def _resolve(self, fut: Optional[asyncio.Future], result=None, error=None) -> None:
        def settle():
            if fut.done():
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(result)

        if fut is not None:
            self.loop.call_soon_threadsafe(settle)

    def _run_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=_IDLE_WAIT_S) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, fut = item
            try:
                result = fn(self.engine)
            except Exception as exc:  # the caller gets it; the loop goes on
                if fut is None:
                    log.exception("engine command failed")
                self._resolve(fut, error=exc)
            else:
                self._resolve(fut, result)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _publish(self, now: float) -> None:
        """On the engine thread: the load report load() hands out until the next one."""
        report = self.engine.load_report()
        # This thread's CPU: the worker's process CPU less it is what its other threads (KV
        # writers, Ray, the event loop) take (pd_runtime/planner/profile.py).
        report["engine_thread_cpu_s"] = time.thread_time()
        report["min_step_interval_s"] = self._min_step_s
        report["paced_s"] = self.paced_s
        report["pace_wait_s"] = self.pace_wait_s
        self._report, self._report_at = report, now

    def _pace(self, started: float) -> None:
        """While a prefill worker on this machine computes, wait out the rest of
        min_step_interval_s after a step (and no longer than it computes): a decode worker
        beside a prefill worker that borrows every core gives it what its streams' TPOT target
        leaves (measured on the 2-core box: steps of ~16-20 ms back to back at 2 req/s took
        most of a core the long prompts' prefill was waiting for), and steps back to back
        while the prefill workers are idle, stopped or gone."""
        if self._watch is None or self._min_step_s <= 0.0:
            return
        now = time.monotonic()
        deadline, waited = started + self._min_step_s, 0.0
        while now < deadline and self.engine.has_work() and self._watch.busy(now) \
                and not self._stopped.is_set():
            self._stopped.wait(min(_PACE_POLL_S, deadline - now))
            later = time.monotonic()
            waited, now = waited + later - now, later
        self.paced_s += waited
        self.pace_wait_s += _PACE_EWMA * (waited - self.pace_wait_s)

    def _run(self) -> None:
        try:
            self._turns()
        except BaseException:
            log.exception("the engine loop ended")
            raise
        finally:  # nothing waits forever on a command this thread will never run
            while True:
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._resolve(fut, error=RuntimeError("the engine thread has stopped"))

    def _turns(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            busy = engine.has_work()
            flag = self._busy_flag
            if flag is not None:
                flag.set(busy)  # idle before it blocks for the next command
            self._run_commands(block=not busy)
            flag = self._busy_flag  # (a command may have swapped it: a re-role)
            if flag is not None:
                flag.set(engine.has_work())
            for hook in self._tick_hooks:
                try:
                    hook(engine)
                except Exception:
                    log.exception("tick hook failed")
            if engine.has_work():
                started = time.monotonic()
                try:
                    outputs = engine.step()
                except Exception as exc:
                    log.exception("engine step failed")
                    if self._on_step_failure is not None:
                        self._on_step_failure(exc)
                    raise
                self.steps += 1
                if outputs:
                    self.loop.call_soon_threadsafe(self._deliver, outputs)
                self._pace(started)
            # Republished every _REPORT_EVERY_S while busy, and whenever it goes idle: the
            # state a step or command left (blocks held for a transfer, a queue emptied) must
            # not wait for the next command to show.
            now = time.monotonic()
            if now - self._report_at >= _REPORT_EVERY_S or not engine.has_work():
                self._publish(now)
