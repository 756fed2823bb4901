"""Runs an engine on its own thread inside a worker: steps continuously while work exists,
takes commands between steps, and hands each request's outputs to asyncio streams.

The engine is single-threaded by design; every call into it goes through `call()` so it runs
on the engine thread between two steps. Outputs reach the actor's event loop thread-safely.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Optional

from pd_runtime.engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05
_REPORT_EVERY_S = 0.02  # how often the engine thread republishes its load report
# Steps count as paced (the load report's min_step_interval_s) this long after a step last found
# the cores wanted by others.
_CONTENDED_S = 2.0


def cores_wanted_by_others(cores: int) -> bool:
    """Whether more threads are runnable on this machine than it has cores, this one aside
    (/proc/stat's procs_running: an instant's count, read in ~20 us). False where unknown."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"procs_running"):
                    return int(line.split()[1]) - 1 >= cores
    except (OSError, ValueError, IndexError):
        pass
    return False


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 on_step_failure: Optional[Callable[[Exception], None]] = None):
        self.engine = engine
        self.loop = loop
        self._on_step_failure = on_step_failure  # before the thread ends
        self._commands: "queue.Queue[tuple[Callable, asyncio.Future | None]]" = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._tick_hooks: list[Callable[[LLMEngine], None]] = []
        self._stopped = threading.Event()
        self.steps = 0
        # engine.min_step_interval_s: steps paced while other threads want the cores
        self._min_step_s = (engine.config.min_step_interval_s or 0.0) \
            if engine.config.device == "cpu" else 0.0
        self._cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            (os.cpu_count() or 1)
        self.paced_s = 0.0  # time spent waiting between steps for the cores' sake
        self._contended_at = -_CONTENDED_S  # when a step last found the cores wanted
        self._report: Optional[dict] = None  # the engine's load report, as of _report_at
        self._report_at = 0.0
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- called from the event loop ----------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps; returns its result."""
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

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the engine thread after its current step; whether it ended within `timeout_s`."""
        self._stopped.set()
        self._commands.put((lambda e: None, None))
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()

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

    def _pace(self, started: float) -> None:
        """Wait out the rest of min_step_interval_s after a step, while other threads want the
        cores: a decode worker beside a prefill worker that borrows every core gives it what its
        streams' TPOT target leaves (measured on the 2-core box: steps of ~16-20 ms back to back
        at 2 req/s took most of a core the long prompts' prefill was waiting for)."""
        now = time.monotonic()
        rest = self._min_step_s - (now - started)
        if rest <= 0.0 or not self.engine.has_work() or not cores_wanted_by_others(self._cores):
            return
        self._contended_at = now
        self._stopped.wait(rest)
        self.paced_s += rest

    def pacing_s(self, now: float) -> float:
        """The interval its steps are paced to now: min_step_interval_s while a step found the
        cores wanted within _CONTENDED_S, else 0 (the router predicts its steps from it: with
        the prefill worker stopped or idle the steps run back to back, ~15 ms, not 50)."""
        return self._min_step_s if now - self._contended_at <= _CONTENDED_S else 0.0

    def _run(self) -> None:
        engine = self.engine
        while not self._stopped.is_set():
            busy = engine.has_work()
            self._run_commands(block=not busy)
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
                report = engine.load_report()
                # This thread's CPU: the worker's process CPU less it is what its other
                # threads (KV writers, Ray, the event loop) take (pd_runtime/planner/profile.py).
                report["engine_thread_cpu_s"] = time.thread_time()
                report["min_step_interval_s"] = self.pacing_s(now)
                report["paced_s"] = self.paced_s
                self._report, self._report_at = report, now
