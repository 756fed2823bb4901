"""Worker pools in this process, without Ray: the same PDWorker and the same PoolClient, so the
router's PoolBackend (authentication, tenants, routing, metrics, the serve loop) serves them
exactly as it serves the Ray pools. For tests and single-process runs.

Each worker lives on its own event-loop thread, as a Ray async actor does: its methods run on
that loop whichever loop calls them, through a handle with Ray's call shape:
`handle.method.remote(...)` is an awaitable (already running, so a call nobody awaits still
happens), or, for a streaming method, an async iterator of awaitables; a stream its consumer
drops is closed on the worker's loop, which ends the request there as a dropped Ray stream does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any, Optional

from pd_runtime.api import ModelCard
from pd_runtime.config import ClusterConfig
from pd_runtime.workers.client import PoolClient, WorkerRef

_END = object()


class _ActorLoop:
    """One worker's event loop, on its own thread."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class _Ref:
    """An item a stream already produced, awaitable like a Ray ObjectRef."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        return self.value
        yield  # noqa: unreachable: makes this a generator, as __await__ must be


class _Call:
    """A method call running on the worker's loop; awaitable from any loop."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()


class _Stream:
    """A worker's async generator, pulled item by item on the worker's loop."""

    def __init__(self, actor: _ActorLoop, agen):
        self._actor, self._agen = actor, agen
        self._closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> _Ref:
        async def pull():
            try:
                return await self._agen.__anext__()
            except StopAsyncIteration:
                return _END

        item = await asyncio.wrap_future(self._actor.submit(pull()))
        if item is _END:
            self._closed = True
            raise StopAsyncIteration
        return _Ref(item)

    def close(self) -> None:
        """End the generator on the worker's loop (its `finally` releases the request)."""
        if not self._closed:
            self._closed = True
            try:
                self._actor.submit(self._agen.aclose())
            except RuntimeError:  # the worker's loop is gone already
                pass

    def __del__(self):
        self.close()


class _Method:
    def __init__(self, actor: _ActorLoop, fn):
        self._actor, self._fn = actor, fn

    def remote(self, *args, **kwargs):
        if inspect.isasyncgenfunction(self._fn):
            return _Stream(self._actor, self._fn(*args, **kwargs))
        return _Call(self._actor.submit(self._fn(*args, **kwargs)))


class LocalHandle:
    """A Ray-actor-like handle on a worker object living on its own loop."""

    def __init__(self, worker, name: str):
        self.worker = worker
        self._actor = _ActorLoop(name)

    def __getattr__(self, name: str) -> _Method:
        fn = getattr(self.worker, name)
        if not inspect.iscoroutinefunction(fn) and not inspect.isasyncgenfunction(fn):
            raise AttributeError(f"{name} is not a worker method callable remotely")
        return _Method(self._actor, fn)

    def close(self) -> None:
        try:
            self._actor.submit(self.worker.shutdown()).result(timeout=10)
        finally:
            self._actor.stop()


class LocalPool(PoolClient):
    """The pools of a ClusterConfig as in-process workers (see the module doc)."""

    def __init__(self, cfg: ClusterConfig, model_dir: str):
        from pd_runtime.workers.pool import check_tensor_parallel
        from pd_runtime.workers.worker import PDWorker

        check_tensor_parallel(cfg.model_copy(update={"kv_transfer": cfg.kv_transfer.model_copy(
            update={"backend": "local"})}))
        refs: dict[str, list[WorkerRef]] = {role: [] for role in cfg.pools()}
        for role, pool in cfg.pools().items():
            for i in range(pool.num_workers):
                worker_id = f"{role}-{i}"
                worker = PDWorker(role, worker_id, pool.engine_config(model_dir).model_dump(),
                                  cfg.kv_transfer.model_dump(), cfg.recovery.model_dump())
                refs[role].append(WorkerRef(worker_id, role, LocalHandle(worker, worker_id)))
        workers = [w for ws in refs.values() for w in ws]
        if not workers:
            raise ValueError("the config has no workers (every pool's num_workers is 0)")
        cards = [ModelCard.from_dict(w.handle.worker.model_card()) for w in workers]
        super().__init__(refs["prefill"], refs["decode"] + refs["colocated"],
                         recovery_wait_s=cfg.recovery.decode_recovery_wait_s,
                         model_card=cards[0])

    def worker(self, worker_id: str) -> Any:
        """The worker object itself (its engine, for tests)."""
        return next(w.handle.worker for w in self.prefill + self.decode
                    if w.worker_id == worker_id)

    def close(self) -> None:
        for w in self.prefill + self.decode:
            w.handle.close()


def local_pool(cfg: ClusterConfig, model_dir: Optional[str] = None) -> LocalPool:
    return LocalPool(cfg, model_dir or cfg.model)
