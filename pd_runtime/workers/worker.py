"""The worker: one Ray actor per engine, with a role (prefill | decode | colocated).

A decode or colocated worker serves whole requests (`generate`); a decode worker also serves
the decode half of a disaggregated request (`generate_disaggregated`): it reserves blocks, asks
a prefill worker to fill them (`prefill`), streams the prefill worker's first token at once,
and decodes once the KV has arrived. Any failure on that path falls back to a local prefill;
the client sees one stream either way.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from typing import AsyncIterator, Optional

from pd_runtime.api import (EngineOverloadedError, GenerationRequest, InvalidRequestError,
                            ModelCard, StreamChunk)
from pd_runtime.config import EngineConfig, KVTransferConfig, RecoveryConfig
from pd_runtime.workers import node_signals, tp_rank
from pd_runtime.workers.deadlines import DeadlineWatch
from pd_runtime.workers.decode_half import (PrefillRate, RemotePrefill, ReservationQueue, Stage,
                                            cancel_receive, run_remote_prefill)
from pd_runtime.workers.engine_loop import EngineLoop
from pd_runtime.workers.prefill_half import LayerStreamer, TransferOverlap, serve_prefill

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


class PDWorker:
    def __init__(self, role: str, worker_id: str, engine_config: dict, kv_config: dict,
                 recovery: Optional[dict] = None, rank_resources: Optional[dict] = None):
        """`rank_resources` (num_cpus, num_gpus of one rank): this is a Ray actor in its
        placement group, and its other tensor-parallel ranks are actors there too
        (workers/tp_rank.py); None: they are local processes (an in-process server)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        import torch

        from pd_runtime.engine.engine import LLMEngine

        self.role = role
        self.worker_id = worker_id
        self.engine_config = EngineConfig(**engine_config)
        if role == "prefill":  # it computes prompts and first tokens: no decode steps to replay
            self.engine_config = self.engine_config.model_copy(update={"cuda_graphs": False})
        if self.engine_config.num_threads:
            torch.set_num_threads(self.engine_config.num_threads)
        self.num_threads = torch.get_num_threads()  # the cores its steps use
        # Its other tensor-parallel ranks (if any) each run a transfer agent of their own.
        self.engine = LLMEngine(self.engine_config,
                                launch_ranks=tp_rank.launcher(rank_resources))
        warm_s = self.engine.warm_up(self.engine_config.warmup_tokens)
        # A restarted actor is a new incarnation: peers must not mistake it for the old one.
        self.engine_id = f"{worker_id}-{uuid.uuid4().hex[:8]}"
        rec = RecoveryConfig(**(recovery or {}))
        self.remote_prefill_timeout_s = rec.remote_prefill_timeout_s
        self.reservation_timeout_s = rec.reservation_timeout_s
        self.hedge_min_s, self.hedge_factor = rec.hedge_min_s, rec.hedge_factor
        self.prefill_rate = PrefillRate()  # measured remote prefill speed: when to hedge
        self.hedged_prefills = 0
        kv = KVTransferConfig(**kv_config)
        if kv.host == "auto":  # this node's address, so peers on other nodes reach the agent
            import ray

            kv = kv.for_node(ray.util.get_node_ip_address())
        self.agent = self._group_agent(kv)
        self._prefill_degrees: dict = {}  # a prefill worker (_handle_key) -> its ranks
        self._peers: dict[str, str] = {}  # peer engine_id -> agent peer id
        # Decode side: each disaggregated request from its reservation to its last chunk.
        self.remote_prefills: dict[str, RemotePrefill] = {}
        # Prefill side: aborted before or while their prefill ran, with when (pruned after a
        # minute: an abort that arrives after the whole prefill has nothing left to stop).
        self.cancelled: dict[str, float] = {}
        self.ship_tasks: dict[str, asyncio.Future] = {}  # prefill side: KV sends in progress
        # Prefill side: sends waiting for room on a link (or for it to come up), woken by the
        # agent's sendable signal.
        self.send_waiters: set[asyncio.Future] = set()
        # Decode side: remote prefills waiting for blocks, served by the engine loop.
        self.reservations = ReservationQueue()
        self.deadlines: Optional[DeadlineWatch] = None  # made with the engine loop
        # Prefill side: each prompt's KV shipped layer by layer from its last step (or only
        # timed, with kv_transfer.stream_layers off); until its transfer's lease ends.
        self.stream_layers = kv.stream_layers
        self.shipments: dict[str, LayerStreamer] = {}
        self.transfer_overlap = TransferOverlap()
        # Fault injection for chaos tests: hold the KV send this long after the first token.
        self.fault_delay_kv_send_s = 0.0
        self.loop: Optional[EngineLoop] = None
        self.draining = False
        self.started = time.time()
        log.info("worker %s (%s) up: engine %s, %d KV blocks, %s, warm-up %.1fs", worker_id,
                 role, self.engine_id, self.engine.block_manager.num_blocks,
                 self.engine.runner.dtype, warm_s)

    # -- plumbing ----------------------------------------------------------------------------
    def _engine_loop(self) -> EngineLoop:
        if self.loop is None:  # the actor's event loop exists only inside async methods
            aio = asyncio.get_running_loop()
            self.loop = EngineLoop(self.engine, aio, self._on_step_failure,
                                   *node_signals.for_worker(self.role, self.engine_config))
            self.loop.add_tick_hook(self.reservations.tick)
            self.deadlines = DeadlineWatch(self.loop.end_stream)
            self.loop.add_tick_hook(self.deadlines.tick)

            def sendable():  # a link thread: hand the news to this loop, only when awaited
                if self.send_waiters:
                    aio.call_soon_threadsafe(self._wake_senders)

            self.agent.add_sendable_listener(sendable)
        return self.loop

    def _wake_senders(self) -> None:
        waiters, self.send_waiters = self.send_waiters, set()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _on_release(self, status) -> None:
        # Agent thread: a sender lease ended; free the held blocks on the engine thread.
        from pd_runtime.kv_transfer.base import Role

        if status.role is Role.SEND:
            from pd_runtime.kv_transfer.base import TransferState

            streamer = self.shipments.pop(status.request_id, None)
            measured = streamer.finished(status.state is TransferState.DONE) if streamer else None
            if measured is not None:
                self.transfer_overlap.observe(*measured)
        if status.role is Role.SEND and self.loop is not None:
            rid = status.request_id
            self.loop.post(lambda e: e.remote.release_held(rid))
        if status.role is Role.RECV:
            from pd_runtime.kv_transfer.base import TransferState

            record = self.remote_prefills.get(status.request_id)
            if record is None:
                return
            if self.loop is not None:  # first: the engine moves the request on at once
                arrived = status.state is TransferState.DONE
                self.loop.post(lambda e: record.receive_ended(e, arrived))
            if record.arrival is not None:
                record.arrival.get_loop().call_soon_threadsafe(_settle, record.arrival, status)

    async def ready(self) -> dict:
        self._engine_loop()
        return {"worker_id": self.worker_id, "role": self.role, "engine_id": self.engine_id,
                "kv_metadata": self.agent.metadata(), "pid": os.getpid(),
                "node_id": _ray_node_id(), "num_blocks": self.engine.block_manager.num_blocks,
                "model_card": self.model_card()}

    def model_card(self) -> dict:
        """What the router must know of the model (api.ModelCard), so it reads no model files."""
        e = self.engine
        return ModelCard(e.model_config.identity, e.block_manager.block_size, e.max_model_len,
                         e.tokenizer.files, e.sampling_defaults).to_dict()

    async def ping(self) -> bool:
        """Liveness, as cheap as a call gets: answers unless the actor is stopped or its
        engine thread has died (then it raises)."""
        if self.loop is not None and not self.loop.alive():
            raise RuntimeError(f"worker {self.worker_id}: the engine thread has stopped")
        return True

    def _group_agent(self, kv: KVTransferConfig):
        """One transfer agent per rank over that rank's cache, the others' in their rank's
        process (workers/tp_rank.py), behind one agent interface (kv_transfer/group.py)."""
        from pd_runtime.engine.tp_ranks import HOST
        from pd_runtime.kv_transfer.group import GroupAgent, released_by
        from pd_runtime.kv_transfer.rank_rpc import RemoteRankAgent
        from pd_runtime.kv_transfer.registry import create_agent

        model = self.engine.model_config
        degree = self.engine_config.tensor_parallel_size
        group = GroupAgent([], model.num_kv_heads, on_release=self._on_release)

        def extra(rank: int) -> dict:
            return {"model_kv_heads": model.num_kv_heads, "tp_rank": rank, "tp_size": degree}

        ranks = [create_agent(kv, self.engine.runner.kv_caches, engine_id=self.engine_id,
                              model_id=model.identity, on_release=released_by(group, 0),
                              extra=extra(0))]
        for rank in range(1, degree):
            port = int(self.engine.runner.tp.store.get(
                tp_rank.AGENT_PORT_KEY.format(rank=rank)))
            # (port 0: a configured port is the driver's, and the ranks share its node)
            ranks.append(RemoteRankAgent(HOST, port, released_by(group, rank),
                                         kv.model_copy(update={"port": 0}).model_dump(),
                                         f"{self.engine_id}/r{rank}",
                                         model.identity, extra(rank)))
        group.ranks, group.degree = ranks, degree
        return group

    async def prefill_degree(self, prefill_worker) -> int:
        """How many ranks a prefill worker has (what our ranks' receives are cut by): asked
        once per worker (a restart keeps its pool's degree)."""
        from pd_runtime.kv_transfer.group import rank_metadata

        key = _handle_key(prefill_worker)
        if key not in self._prefill_degrees:
            try:
                metadata = await asyncio.wait_for(prefill_worker.kv_metadata.remote(), 10.0)
            except Exception:  # unreachable: its prefill call fails too, and we prefill here
                return 1
            self._prefill_degrees[key] = len(rank_metadata(metadata))
        return self._prefill_degrees[key]

    def _on_step_failure(self, exc: Exception) -> None:
        """A tensor-parallel rank lost is this worker lost: the process ends, so Ray restarts
        the actor, which starts its ranks anew (the group restarts as one unit) while the
        router migrates its streams. (Its other ranks end with it: Ray ends the actors a dead
        actor owned, and a local process's plan channel closes.)"""
        from pd_runtime.model.parallel_comm import TensorParallelError

        in_actor = "ray" in sys.modules and sys.modules["ray"].is_initialized() and \
            sys.modules["ray"].get_runtime_context().get_actor_id() is not None
        if isinstance(exc, TensorParallelError) and in_actor:  # (in-process: the worker ends)
            log.error("worker %s: a tensor-parallel rank is lost (%s); restarting the worker",
                      self.worker_id, exc)
            logging.shutdown()
            os._exit(1)

    async def kv_metadata(self) -> bytes:
        return self.agent.metadata()

    async def load(self) -> dict:
        """The engine's latest load report (published by its thread between steps, so a long
        step does not make this worker look dead) with the worker's own fields."""
        loop = self._engine_loop()
        report = loop.latest_report()
        if report is None:
            report = await loop.call(lambda e: e.load_report())
        report["records"] = self._records()
        report.update(worker_id=self.worker_id, role=self.role, engine_id=self.engine_id,
                      kv_transfer=self.agent.metrics(), draining=self.draining,
                      pid=os.getpid(), rank_pids=self.engine.rank_pids(),
                      tensor_parallel_size=self.engine_config.tensor_parallel_size,
                      hedged_prefills=self.hedged_prefills,
                      kv_overlap=self.transfer_overlap.report(),
                      cuda_graph_capture_s=self.engine.runner.graph_capture_s,
                      host=socket.gethostname(), num_threads=self.num_threads,
                      cpu_s=time.process_time())
        return report

    async def kv_events(self, epoch: Optional[str] = None, seq: int = 0) -> dict:
        """What this worker's prefix cache stored and removed after `seq` of `epoch`, or a
        snapshot of every block it holds (a reader that never read, an engine restarted, a
        reader too far behind): engine/kv_cache/kv_events.py."""
        log = self.engine.block_manager.events
        reply = log.since(epoch, seq)
        if reply is None:
            reply = await self._engine_loop().call(
                lambda e: e.block_manager.events.snapshot(e.block_manager.held_blocks()))
        return reply

    def _records(self) -> dict:
        """Per-request state this worker keeps; all zero when it is idle (a leak shows here)."""
        e = self.engine
        return {"engine_requests": len(e.requests), "held": len(e.remote.held),
                "remote_waiting": len(e.remote.waiting),
                "streams": len(self.loop._streams) if self.loop else 0,
                "remote_prefills": len(self.remote_prefills), "ship_tasks": len(self.ship_tasks),
                "shipments": len(self.shipments),
                "reservations": len(self.reservations), "send_waiters": len(self.send_waiters),
                # The transfer agent's per-request tables (its capped recent-status cache aside).
                **{f"agent_{name}": size for name, size in self.agent.table_sizes().items()
                   if name != "recent"}}

    async def set_draining(self, draining: bool = True) -> None:
        """A draining worker finishes what it has and is routed nothing new (for a restart
        or a scale-down); the router sees it in the next load report."""
        self.draining = draining

    async def set_role(self, role: str, num_threads: Optional[int] = None,
                       min_step_interval_s: Optional[float] = None) -> dict:
        """Serve `role` from now on, weights, KV cache and prefix cache kept (the autoscaler's
        re-role, workers/elastic.py): what changes is what the role decides here, its torch
        threads, its step pacing (`min_step_interval_s`) and its prefill flag. Only an idle
        worker (drained: every per-request table empty) changes role. Its engine settings
        otherwise stay its pool's (a prefill worker on a GPU turned decode runs its decode
        steps without CUDA graphs: a prefill worker captures none)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        loop = self._engine_loop()
        busy = {name: n for name, n in self._records().items() if n}
        if busy:
            raise RuntimeError(f"worker {self.worker_id} is not idle ({busy}): drain it first")
        update = {} if num_threads is None else {"num_threads": num_threads}
        if min_step_interval_s is not None:
            update["min_step_interval_s"] = min_step_interval_s
        config = self.engine_config.model_copy(update=update)

        def apply(engine) -> int:
            import torch

            if num_threads:  # on the engine thread: a thread's OpenMP team is its own
                torch.set_num_threads(num_threads)
            loop.retune(config.min_step_interval_s or 0.0,
                        lambda: node_signals.for_worker(role, config))
            return torch.get_num_threads()

        was = self.role
        self.num_threads = await loop.call(apply)
        self.role, self.engine_config = role, config
        log.info("worker %s re-roled %s -> %s (%d threads, steps paced to %.3f s)",
                 self.worker_id, was, role, self.num_threads, config.min_step_interval_s or 0.0)
        return {"worker_id": self.worker_id, "role": role, "was": was,
                "num_threads": self.num_threads}

    async def free_blocks(self) -> int:
        return await self._engine_loop().call(lambda e: e.block_manager.num_free_blocks)

    async def reset_prefix_cache(self) -> int:
        """Empty this worker's prefix cache (the router's POST /reset_prefix_cache)."""
        return await self._engine_loop().call(lambda e: e.reset_prefix_cache())

    async def cached_prefix_tokens(self, token_ids: list[int], cache_salt: Optional[str]) -> int:
        return await self._engine_loop().call(
            lambda e: e.block_manager.cached_prefix_tokens(token_ids, cache_salt))

    async def set_fault_injection(self, delay_kv_send_s: float = 0.0,
                                  link_faults: Optional[dict] = None) -> None:
        """Chaos testing: widen the window between a prefill's first token and its KV send;
        `link_faults`: the keywords of KVTransferAgent.set_link_faults (drop, corrupt,
        duplicate, delay, delay_s, seed, max_faults) for the KV this worker sends from now on,
        {} for clean links (needs kv_transfer.fault_injection: true)."""
        self.fault_delay_kv_send_s = delay_kv_send_s
        if link_faults is not None:
            self.agent.set_link_faults(**link_faults)

    async def abort(self, request_id: str) -> bool:
        """Cancel a request here; blocks leased to an unfinished transfer are freed when the
        lease ends (the agent tells the peer, which fails its side)."""
        if self.role == "prefill" and request_id not in self.shipments:
            # Its prefill call has not come (or has ended): refuse it if it comes late.
            now = time.monotonic()
            self.cancelled = {r: t for r, t in self.cancelled.items() if now - t < 60.0}
            self.cancelled[request_id] = now
        self.agent.cancel(request_id)

        def abort(engine):
            if request_id in engine.remote.held:
                return True  # the lease end (on_release) frees these blocks
            return engine.abort(request_id)

        loop = self._engine_loop()
        aborted = await loop.call(abort)
        loop.close_stream(request_id)  # wake whoever still waits on its output
        return aborted

    async def _stream(self, request_id: str, q: asyncio.Queue,
                      path: str) -> AsyncIterator[StreamChunk]:
        while True:
            out = await q.get()
            if out is None:  # aborted from elsewhere: nothing more will come
                return
            if isinstance(out, Exception):  # ended in the engine loop (its deadline passed)
                self.remote_prefills.pop(request_id, None)
                yield StreamChunk.from_error(out)
                return
            chunk = StreamChunk.from_output(out, path)
            # Outputs that queued up while the caller read the last chunk leave as one: a Ray
            # object per chunk is the streaming path's main cost when the router falls behind.
            while not out.finished and not q.empty():
                later = q.get_nowait()
                if later is None or isinstance(later, Exception):
                    q.put_nowait(later)  # the next turn ends the stream
                    break
                out = later
                chunk.absorb(StreamChunk.from_output(out, path))
            record = self.remote_prefills.pop(request_id, None) if out.finished else None
            if record is not None and record.transfer_s is not None:
                chunk.kv_transfer_s, chunk.kv_arrived = record.transfer_s, record.kv_arrived
                chunk.remote_prefill_s = record.prefill_s
            yield chunk
            if out.finished:
                return

    def _watch(self, request: GenerationRequest) -> None:
        """On the engine thread, once the request is in the engine: its deadline, if any."""
        if request.deadline is not None:
            self.deadlines.add(request.request_id, request.deadline)

    async def _abort_unfinished(self, request_id: str) -> None:
        loop = self._engine_loop()
        loop.close_stream(request_id)
        await cancel_receive(self, request_id)  # a chunk being read lands before the free
        self.remote_prefills.pop(request_id, None)
        await loop.call(lambda e: e.abort(request_id))

    # -- whole requests (colocated, or resumed after a lost worker) ---------------------------
    async def generate(self, request: GenerationRequest,
                       resume_output_ids: Optional[list[int]] = None,
                       resume_text_len: Optional[int] = None) -> AsyncIterator[StreamChunk]:
        """The request's chunks, prefilled and decoded here (colocated), or continued after
        the `resume_output_ids` a lost worker streamed."""
        request_id = request.request_id
        loop = self._engine_loop()
        q = loop.open_stream(request_id)
        finished = False
        try:
            try:
                await loop.call(lambda e: (e.add_request(
                    request_id, request.prompt, request.params, request.priority,
                    request.cache_salt, resume_output_ids=resume_output_ids,
                    resume_text_len=resume_text_len), self._watch(request)))
            except (InvalidRequestError, EngineOverloadedError) as exc:
                finished = True
                yield StreamChunk.from_error(exc)
                return
            async for chunk in self._stream(request_id, q, "colocated"):
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:  # the caller went away or the stream broke: release everything
                await self._abort_unfinished(request_id)

    # -- disaggregated: decode side ----------------------------------------------------------
    async def generate_disaggregated(self, request: GenerationRequest, prefill_worker,
                                     prefill_degree: Optional[int] = None
                                     ) -> AsyncIterator[StreamChunk]:
        """The request's chunks, its prompt prefilled by `prefill_worker` (decode_half.py),
        whose tensor-parallel degree the caller may know (else it is asked). Handed itself as
        the prefill worker (a prefill worker standing in for decode), it serves the request
        whole: a transfer to itself would wait for blocks it holds."""
        if _is_self(self, prefill_worker):
            async for chunk in self.generate(request):
                yield chunk
            return
        if prefill_degree:
            self._prefill_degrees[_handle_key(prefill_worker)] = prefill_degree
        request_id = request.request_id
        loop = self._engine_loop()
        q = loop.open_stream(request_id)
        finished = False
        try:
            # A first chunk that finishes the request comes after its reservation was freed
            # (run_remote_prefill): nothing is left to do after a yield that ends the request,
            # which a consumer that stops reading there never resumes.
            async for chunk in run_remote_prefill(self, request, prefill_worker):
                finished = chunk.finished
                yield chunk
            if not finished:
                record = self.remote_prefills.get(request_id)
                fell_back = record is not None and record.stage is Stage.FALLBACK
                async for chunk in self._stream(request_id, q, "disaggregated"):
                    finished = chunk.finished
                    if fell_back:  # its first token is ours, not the prefill worker's
                        chunk.prefill_fallback, fell_back = True, False
                    yield chunk
        finally:
            if finished:
                loop.close_stream(request_id)
                self.remote_prefills.pop(request_id, None)
            else:
                record = self.remote_prefills.get(request_id)
                await self._abort_unfinished(request_id)
                # Only a prefill not answered yet is the prefill worker's to stop; after the
                # first token, cancelling our receive fails its send (and ends its lease).
                if record is not None and record.stage is Stage.PREFILLING:
                    try:
                        prefill_worker.abort.remote(request_id)
                    except Exception:  # the prefill worker may be gone; nothing of ours there
                        pass

    # -- disaggregated: prefill side ---------------------------------------------------------
    async def prefill(self, request: GenerationRequest, decode_metadata: bytes,
                      dst_block_ids: list[int], skip_blocks: int,
                      not_after: Optional[float] = None) -> StreamChunk:
        """Compute the prompt's KV and first token, return the token at once, and ship the
        blocks after `skip_blocks` into the decode worker's `dst_block_ids` in the background
        (the blocks stay held until the transfer's lease ends); a send that cannot start is
        reported to the decode side on the link (`KVTransferAgent.cancel_at_peer`).
        `not_after` (time.time()): the decode side may hedge from then on, so a call that starts
        later (this worker was stopped or stalled) is refused, not computed twice. The prefill
        half: prefill_half.py."""
        return await serve_prefill(self, request, decode_metadata, dst_block_ids, skip_blocks,
                                   not_after)

    async def shutdown(self) -> None:
        # The engine closes (its tensor-parallel ranks stop) only once no step runs: a step
        # still running would send its plan to ranks already gone.
        stopped = self.loop is None or self.loop.stop(timeout_s=60.0)
        self.agent.close()
        if stopped:
            self.engine.close()
        else:
            log.warning("worker %s: the engine's step outlived 60 s at shutdown; its engine "
                        "is left open", self.worker_id)


def _is_self(worker: "PDWorker", handle) -> bool:
    """Whether `handle` is `worker`'s own (an in-process handle, or this Ray actor's)."""
    if getattr(handle, "worker", None) is worker:
        return True
    actor = getattr(handle, "_actor_id", None)
    if actor is None or "ray" not in sys.modules or not sys.modules["ray"].is_initialized():
        return False
    return actor.hex() == sys.modules["ray"].get_runtime_context().get_actor_id()


def _handle_key(handle):
    """A worker handle's identity across calls (a Ray handle arrives deserialized anew each
    time; its actor id stays)."""
    return getattr(handle, "_actor_id", None) or id(handle)


def _ray_node_id() -> Optional[str]:
    """The Ray node this worker runs on (None outside Ray: an in-process pool)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None


def _settle(arrival: asyncio.Future, status) -> None:
    if not arrival.done():
        arrival.set_result(status)
