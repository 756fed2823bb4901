"""The router's side of run records (`RunRecorder`): each generation request is a run
(pd_runtime/gateway/run_state.py) whose output a task of its own produces once, into a buffer that
any number of HTTP responses follow.

That one split gives the gateway's guarantees: a retry with the same Idempotency-Key follows
the run already going (or replays the finished one) instead of computing it again; a dropped
stream resumes from `Last-Event-ID` out of the buffer, or out of the store once the run is
over; the run outlives a client that left it, for `detach_grace_s`, when that client said it
would retry. Store writes go through one background thread (`RunWriter`), which reads the
runs' state itself, so none sits on the token path; only an idempotency claim waits for its
write (it must, to be one).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import socket
import time
from typing import AsyncIterator, Callable, Optional

from pd_runtime.gateway.live_run import Following, LiveRun, end_as_cut, split_events
from pd_runtime.gateway.record_writer import RunWriter
from pd_runtime.gateway.run_state import IdempotencyConflict, Runs, TRANSITIONS
from pd_runtime.gateway.store import STATE_TIME, RunStore
from pd_runtime.router.backend import BackendError

log = logging.getLogger(__name__)

# How often a client's wait for a run another process owns is written down (the owner does not
# cancel a run followed lately). The run itself is read again when a write of it commits
# (pd_runtime/gateway/wakeups.py).
FOLLOW_MARK_S = 1.0
# Finished runs kept in memory hold at most this much output (older ones: from the store).
KEEP_FINISHED_BYTES = 64 << 20


def owner_name(host: str, port: int, replica: int = 0) -> str:
    """Who serves a run: a router restarted on the same port (and replica slot) is the same
    owner, and fails the runs its former self left in flight; an ephemeral port never is."""
    if port:
        return f"{socket.gethostname()}:{port}/{replica}"
    return f"{socket.gethostname()}:pid{os.getpid()}"


class RunRecorder:
    def __init__(self, store: RunStore, store_url: Optional[str], owner: str,
                 detach_grace_s: float = 10.0, keep_finished: int = 1024,
                 event_ids: str = "auto", owner_lease_s: float = 30.0,
                 keep_outputs_s: Optional[float] = None, keep_runs_s: Optional[float] = None):
        """`store` for this process's own reads and idempotency claims; `store_url` names the
        same store for the record writer's process (which deletes outputs and runs past
        `keep_outputs_s` / `keep_runs_s`; None keeps them)."""
        self.store = store
        self.runs = Runs(store)
        self.owner = owner
        self.detach_grace_s = detach_grace_s
        self.keep_finished = keep_finished
        self.always_event_ids = event_ids == "always"
        self.writer = RunWriter(store_url, owner, owner_lease_s=owner_lease_s,
                                keep_outputs_s=keep_outputs_s, keep_runs_s=keep_runs_s)
        self.writer.on_cancel_asked = self._cancel_asked
        self.writer.on_recorded = store.committed
        # Other replicas' follows and cancels of our runs heard as they commit; looked up on a
        # poll only as often as readers poll where they are not heard.
        self.writer.ask_poll_s = lambda: store.wakeups.poll_s
        store.wakeups.add_asker(self.writer.asked)
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # the serving loop, once known
        self.live: dict[str, LiveRun] = {}
        self._by_key: dict[tuple[str, str], str] = {}
        self._claims: dict[tuple[str, str], asyncio.Future] = {}
        self._finished: collections.deque[tuple[str, int]] = collections.deque()
        self._kept_bytes = 0
        # Alive from now (before any run of ours is in the store: other replicas fail the
        # runs of an owner last seen longer ago than the lease, a former self's included).
        self.store.owner_seen(owner, time.time())
        self.recovered = self.runs.recover(owner)
        if self.recovered:
            log.warning("%d runs left in flight by this router's last process marked failed",
                        self.recovered)

    def close(self) -> None:
        self.store.wakeups.remove_asker(self.writer.asked)
        self.writer.close()
        self.store.close()

    # -- starting a run ------------------------------------------------------------------------
    async def open(self, run_id: str, tenant: str, stream: bool, key: Optional[str],
                   body: Optional[dict], digest: Optional[str] = None) -> tuple[LiveRun, bool]:
        """(run, created). With an Idempotency-Key the tenant already used: the run that holds
        it (this process's, or a stub for another's: `task` None, not done), created False;
        IdempotencyConflict (422) when the body differs."""
        self._loop = self._loop or asyncio.get_running_loop()
        if key is None:
            live = self._add(LiveRun(run_id, tenant, stream))
            self.writer.begun(live)
            return live, True
        digest = digest or _digest(body)
        while True:
            held_id = self._by_key.get((tenant, key))
            if held_id in self.live:
                held = self.live[held_id]
                if held.digest != digest:
                    raise _conflict(key)
                return held, False
            claim = self._claims.get((tenant, key))
            if claim is None:
                break
            # Another request of this process is claiming the key now: its outcome is ours.
            try:
                held = await asyncio.shield(claim)
            except Exception:
                continue  # its claim failed (another body?): make our own
            if held.digest != digest:
                raise _conflict(key)
            return held, False
        # The claim is the store's unique (tenant, key): the one write a request waits for.
        claim = self._claims[(tenant, key)] = asyncio.get_running_loop().create_future()
        write = asyncio.ensure_future(asyncio.to_thread(
            self.runs.create, tenant, body, key, run_id, self.owner))
        try:
            try:
                record, created = await asyncio.shield(write)
            except asyncio.CancelledError:
                # The write goes on in its thread: a run it creates is nobody's, so it is
                # recorded cancelled and its key freed once the write is done.
                write.add_done_callback(
                    lambda done: self._abandon(done, LiveRun(run_id, tenant, stream, key, digest)))
                raise
            if created:
                live = self._add(LiveRun(run_id, tenant, stream, key, digest,
                                         created_at=record["created_at"], stored="queued"))
                self.writer.begun(live)
            else:  # somebody else's run holds the key: follow that one
                live = self.live.get(record["id"]) or _stub(record, tenant)
            claim.set_result(live)
        except BaseException as exc:
            claim.set_exception(exc if isinstance(exc, Exception) else RuntimeError("cancelled"))
            claim.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            del self._claims[(tenant, key)]
        return live, created

    @staticmethod
    def cancel(live: LiveRun) -> None:
        """Stop a background response of this process where it is (its client's cancel, here
        or asked through the store by another replica's)."""
        if live.background and not live.done and live.task is not None and not live.cancelled:
            live.cancelled = True
            live.task.cancel()

    def _cancel_asked(self, live: LiveRun) -> None:
        """The writer thread read that another replica asked to cancel `live`."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.cancel, live)
        except RuntimeError:  # the loop has closed: nothing runs any more
            pass

    def _abandon(self, write: asyncio.Future, live: LiveRun) -> None:
        if write.cancelled() or write.exception() is not None or not write.result()[1]:
            return
        live.created_at, live.stored = write.result()[0]["created_at"], "queued"
        live.info["idempotency_key"] = None
        self.advance(live, "cancelled", error="cancelled while its key was claimed")
        live.done = True
        self.writer.ended(live)

    def _add(self, live: LiveRun) -> LiveRun:
        self.live[live.id] = live
        if live.key is not None:
            self._by_key[(live.tenant, live.key)] = live.id
        return live

    def forget(self, live: LiveRun) -> None:
        """The run gone from memory (its record, if any, is what is read of it from now on)."""
        self.live.pop(live.id, None)
        if live.key is not None and self._by_key.get((live.tenant, live.key)) == live.id:
            del self._by_key[(live.tenant, live.key)]

    # -- what the producer reports -------------------------------------------------------------
    def advance(self, live: LiveRun, state: str, **fields) -> None:
        """The run moves on (its record follows within a writer round)."""
        if state not in TRANSITIONS[live.state]:
            log.warning("run %s: %s -> %s ignored", live.id, live.state, state)
            return
        info = live.info
        for name, value in fields.items():
            if value is not None:
                info[name] = value
        info[STATE_TIME[state]] = time.time()
        live.state = state  # after its fields: the writer reads the state first

    def append(self, live: LiveRun, payload: bytes) -> None:
        live.events.append(payload)
        if live._changed is not None:  # someone waits (a follower); most runs have none
            live.notify()

    def finish(self, live: LiveRun, state: str, **fields) -> None:
        """The run is over: its final row goes to the writer, with its output when a client
        can come back for it (it has an Idempotency-Key, its stream has event ids, or it is a
        stored response with its conversation; written
        in the same transaction as the final state, so such a run found finished has its
        output) and its usage when completed. Other runs' output stays in memory only, while
        the run is among the kept finished ones: most of the bytes a record would write."""
        output = b"".join(live.events) if live.stream else live.body
        if not live.events and (live.error is not None or live.body is None):
            # Refused, failed or cancelled before any output: nothing was served, so the key
            # is free for a retry to run the request anew (and nothing is billed).
            output = None
            if live.error is None:
                live.error = BackendError(409, f"run {live.id} was {state} before any output; "
                                          "send the request again", code=f"run_{state}")
            if live.key is not None:
                live.info["idempotency_key"] = None
                if self._by_key.get((live.tenant, live.key)) == live.id:
                    del self._by_key[(live.tenant, live.key)]
        if output is not None and (live.key is not None or live.conversation is not None or
                                   (live.stream and live.event_ids)):
            live.kept_output = ("sse" if live.stream else "json", output)
        self.advance(live, state, **fields)
        live.done = True
        self.writer.ended(live)
        live.notify()
        size = (len(output) if output is not None else 0) + len(live.conversation or b"")
        self._finished.append((live.id, size))
        self._kept_bytes += size
        while self._finished and (len(self._finished) > self.keep_finished
                                  or self._kept_bytes > KEEP_FINISHED_BYTES):
            old_id, old_size = self._finished.popleft()
            self._kept_bytes -= old_size
            old = self.live.get(old_id)
            if old is not None:
                self.forget(old)

    # -- following a run -----------------------------------------------------------------------
    def join(self, live: LiveRun) -> None:
        live.followers += 1
        if live.detach_timer is not None:  # someone came back within the grace
            live.detach_timer.cancel()
            live.detach_timer = None

    def leave(self, live: LiveRun) -> None:
        """A follower is gone; the last one leaving a run still going cancels it, at once or
        (the client sent an Idempotency-Key: it will retry) after detach_grace_s."""
        live.followers -= 1
        if live.followers == 0 and live.settling is not None and not live.done:
            live.settling.cancel()  # a stub nobody reads any more: stop polling the store
            live.settling = None  # a follower who joins later has it followed again
        if live.followers > 0 or live.done or live.task is None or live.background:
            return
        grace = self.detach_grace_s if live.key is not None else 0.0

        def cancel_if_alone() -> None:
            if live.followers == 0 and not live.done and live.task is not None:
                if grace <= 0:
                    live.task.cancel()
                else:  # a client of another replica may be waiting for it: ask the store
                    asyncio.ensure_future(self._cancel_unless_followed(live, cancel_if_alone))

        if grace <= 0:
            cancel_if_alone()
        else:
            live.detach_timer = asyncio.get_running_loop().call_later(grace, cancel_if_alone)

    async def _cancel_unless_followed(self, live: LiveRun, again: Callable[[], None]) -> None:
        record = await asyncio.to_thread(self.runs.get, live.id)
        followed_at = (record or {}).get("followed_at")
        if live.followers or live.done or live.task is None:
            return
        if followed_at is not None and time.time() - followed_at < 2 * FOLLOW_MARK_S:
            live.detach_timer = asyncio.get_running_loop().call_later(FOLLOW_MARK_S, again)
        else:
            live.task.cancel()

    async def shutdown(self) -> None:
        """Server shutdown: the runs still going are cancelled (their backend requests
        aborted) and recorded, then every record is written and the writer stopped."""
        tasks = [live.task for live in self.live.values()
                 if live.task is not None and not live.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.to_thread(self.close)

    async def wait_ready(self, live: LiveRun) -> None:
        """Until a response may begin: a stream's every choice has its first chunk, or the
        run is over (a JSON body is whole only then)."""
        self._settle(live)
        while not (live.done or (live.stream and live.started)):
            await live.changed()

    def _settle(self, live: LiveRun) -> None:
        """A run another process owns (a stub): follow it through the store, once per stub."""
        if live.remote and not live.done and live.settling is None:
            live.settling = asyncio.ensure_future(self._follow_remote(live))

    async def _follow_remote(self, live: LiveRun) -> None:
        """Read the run's record, again after each write of it, until it is over, then take
        its output; meanwhile mark it followed, which has its producer publish its events (a
        stream's), and pass them on as they come."""
        marked = 0.0
        try:
            with self.store.watch(live.id) as watch:  # before the first read: no write missed
                while True:
                    record = await asyncio.to_thread(self.runs.get, live.id)
                    if record is None or not TRANSITIONS.get(record["state"]):
                        break
                    if time.monotonic() - marked >= FOLLOW_MARK_S:  # keep its producer going
                        marked = time.monotonic()
                        await asyncio.to_thread(self.store.mark_followed, live.id, time.time())
                    fresh = await asyncio.to_thread(self.store.events_after, live.id,
                                                    len(live.events) - 1)
                    if fresh:
                        live.events.extend(fresh)
                        live.started = True
                        live.notify()
                    await watch.wait(marked + FOLLOW_MARK_S - time.monotonic())
            output = await asyncio.to_thread(self.store.get_output, live.id) if record else None
            self._load_finished(live, record, output)
        except Exception as exc:  # the store failed us: the followers end with it
            log.warning("following run %s through the store failed: %s", live.id, exc)
            live.error = BackendError(503, f"following run {live.id} failed: the run store "
                                      "did not answer; resume it again shortly",
                                      code="store_unavailable", retry_after_s=2.0)
            live.started = live.done = True
        if live.error is not None:
            # Published events passed on and no output to finish them (its producer stopped,
            # or the store failed us): the stream says so, not as if whole.
            end_as_cut(live, live.error, lambda payload: live.events.append(
                live.next_event(payload)))
        live.notify()

    @staticmethod
    def _load_finished(live: LiveRun, record: Optional[dict], output) -> None:
        live.state = record["state"] if record else "failed"
        if output is not None:
            kind, data = output
            live.stream = kind == "sse"
            if live.stream:
                live.events = split_events(data)
            else:
                live.body = data
        elif live.state == "completed":
            live.error = BackendError(
                409, f"run {live.id} completed; its output is not kept (a run's output is "
                "kept when it has an Idempotency-Key, or is a stream sent with "
                "Accept: text/event-stream, for router.runs.keep_outputs_s after it began)",
                code="output_not_kept")
        else:
            live.error = BackendError(
                409, f"run {live.id} ended {live.state} without output"
                + (f": {record['error']}" if record and record.get("error") else "")
                + "; send the request again with a new Idempotency-Key", code="run_failed")
        live.started = live.done = True

    def follow(self, live: LiveRun, after: int = -1) -> "Following":
        """The run's events after sequence number `after`, as they come, ending with the run,
        for a follower that has joined: closing the iterator (always done by SSEResponse,
        started or not) is its leave()."""
        return Following(self._events(live, after), lambda: self.leave(live))

    async def _events(self, live: LiveRun, after: int) -> AsyncIterator[bytes]:
        self._settle(live)
        seq = after + 1
        while True:
            while seq < len(live.events):
                yield live.events[seq]
                seq += 1
            if live.done:
                return
            await live.changed()

    async def find(self, run_id: str, tenant: str) -> Optional[LiveRun]:
        """The caller's run by id (this process's, or from the store as a finished or
        followable stub); None when it is not there or belongs to another tenant."""
        live = self.live.get(run_id)
        if live is not None:
            return live if live.tenant == tenant else None
        record = await asyncio.to_thread(self.runs.get, run_id, tenant)
        if record is None:
            return None
        return _stub(record, tenant)

    async def record(self, run_id: str, tenant: str) -> Optional[dict]:
        """GET /v1/runs/{id}: the stored record, with this process's newer view of a live run."""
        record = await asyncio.to_thread(self.runs.get, run_id, tenant)
        live = self.live.get(run_id)
        if live is not None and live.tenant == tenant:
            record = {**(record or {"id": live.id, "tenant": live.tenant,
                                    "created_at": live.created_at}),
                      **live.info, "state": live.state}
        if record is None:
            return None
        record.pop("body_hash", None)
        record.pop("idempotency_key", None)
        if isinstance(record.get("workers"), str):
            record["workers"] = json.loads(record["workers"])
        return record


def output_of(live: LiveRun) -> Optional[tuple[str, bytes]]:
    """A finished run's output as its record keeps it (or would)."""
    if live.kept_output is not None:
        return live.kept_output
    if live.stream:
        return ("sse", b"".join(live.events)) if live.events else None
    return ("json", live.body) if live.body is not None else None


def _stub(record: dict, tenant: str) -> LiveRun:
    return LiveRun(record["id"], tenant, True, record["idempotency_key"], record["body_hash"],
                   record["state"], remote=True)


def _digest(body: Optional[dict]) -> Optional[str]:
    from pd_runtime.gateway.run_state import body_hash

    return body_hash(body) if body is not None else None


def _conflict(key: str) -> IdempotencyConflict:
    return IdempotencyConflict(
        f"Idempotency-Key {key!r} was used for a different request body; use a new key for a "
        "new request")
