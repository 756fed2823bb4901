"""The run state machine: every generation request a run with an id and validated transitions

    queued -> prefilling -> streaming -> completed | failed | cancelled
    (queued and prefilling may also end failed or cancelled)

with a timestamp per transition, the routing decision, token counts, the workers and the
error; a completion writes the run's usage row in the same transaction (one per run: a retry
or a second replica cannot bill twice); an `Idempotency-Key` per tenant names one run (a reused
key with another body is refused); at start-up, runs a crash left in flight are marked failed,
with no usage row.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Optional

from pd_runtime.gateway.store import IN_FLIGHT, RunStore

TRANSITIONS = {
    "queued": ("prefilling", "failed", "cancelled"),
    "prefilling": ("streaming", "failed", "cancelled"),
    "streaming": ("completed", "failed", "cancelled"),
    "completed": (), "failed": (), "cancelled": (),
}


class InvalidTransition(RuntimeError):
    """A transition the state machine does not allow (e.g. completed -> streaming)."""


class IdempotencyConflict(ValueError):
    """An Idempotency-Key reused with a different request body (HTTP 422)."""


def body_hash(body: dict) -> str:
    """The request body's identity for idempotency: its canonical JSON, hashed."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Runs:
    def __init__(self, store: RunStore):
        self.store = store

    def recover(self, owner: Optional[str] = None) -> int:
        """At start-up: runs left in flight by a process that is gone (this replica's former
        self, when `owner` names it), to failed (no usage)."""
        return self.store.fail_in_flight(IN_FLIGHT, "the router stopped during this run",
                                         time.time(), owner)

    def keep_alive(self, owner: str, lease_s: float, now: Optional[float] = None,
                   judge: bool = True) -> int:
        """This replica is alive; with `judge`, runs left in flight by a replica not seen for
        `lease_s` (it stopped and did not come back on its port) to failed; how many."""
        now = time.time() if now is None else now
        self.store.owner_seen(owner, now)
        if not judge:
            return 0
        return self.store.fail_lapsed(
            IN_FLIGHT, f"its router replica stopped answering (not seen for {lease_s:g} s)",
            now, now - lease_s, owner)

    @staticmethod
    def new_run(tenant: str, run_id: Optional[str] = None, owner: Optional[str] = None,
                idempotency_key: Optional[str] = None, digest: Optional[str] = None,
                now: Optional[float] = None) -> dict:
        now = time.time() if now is None else now
        return {"id": run_id or f"run-{uuid.uuid4().hex}", "tenant": tenant, "state": "queued",
                "created_at": now, "updated_at": now, "idempotency_key": idempotency_key,
                "body_hash": digest, "owner": owner}

    def create(self, tenant: str, body: Optional[dict] = None,
               idempotency_key: Optional[str] = None, run_id: Optional[str] = None,
               owner: Optional[str] = None) -> tuple[dict, bool]:
        """(run, created): with a key the tenant already used, the run that has it (created
        False), or IdempotencyConflict if its body differs."""
        digest = body_hash(body) if body is not None else None
        run = self.new_run(tenant, run_id, owner, idempotency_key, digest)
        held = self.store.insert_run(run)
        if held is None:
            return run, True
        if held["body_hash"] != digest:
            raise IdempotencyConflict(
                f"Idempotency-Key {idempotency_key!r} was used for a different request body; "
                "use a new key for a new request")
        return held, False

    def get(self, run_id: str, tenant: Optional[str] = None) -> Optional[dict]:
        """The run, or None (also when it belongs to another tenant than `tenant`)."""
        run = self.store.get_run(run_id)
        if run is None or (tenant is not None and run["tenant"] != tenant):
            return None
        return run

    def advance(self, run_id: str, state: str, **fields) -> None:
        """Move a run on (fields: path, route_reason, prompt_tokens, workers, error, ...)."""
        allowed = tuple(s for s, nexts in TRANSITIONS.items() if state in nexts)
        if not allowed:
            raise InvalidTransition(f"no run can move to {state!r}")
        usage = None
        if state == "completed":
            run = self.store.get_run(run_id)
            if run is None:
                raise KeyError(run_id)
            usage = {"tenant": run["tenant"],
                     "input_tokens": fields.get("prompt_tokens", run["prompt_tokens"]) or 0,
                     "cached_tokens": fields.get("cached_tokens", run["cached_tokens"]) or 0,
                     "output_tokens": fields.get("output_tokens", run["output_tokens"]) or 0,
                     "duration_s": time.time() - run["created_at"]}
        if fields.get("workers") is not None and not isinstance(fields["workers"], str):
            fields["workers"] = json.dumps(list(fields["workers"]))
        was = self.store.transition(run_id, allowed, state, time.time(), fields, usage)
        if was is None:
            current = (self.store.get_run(run_id) or {}).get("state")
            raise InvalidTransition(f"run {run_id}: {current} -> {state} is not allowed")

    def record_items(self, items: list[dict], events: list = ()) -> list[str]:
        """Runs' rows as `record_item` makes them, and events of runs still going, in one
        transaction; what could not be recorded, one line each."""
        problems = []
        for item, ok in zip(items, self.store.record(items, events)):
            if not ok:
                try:  # committed already: a failing look-up must not undo the answer
                    current = (self.store.get_run(item["run_id"]) or {}).get("state")
                except Exception:
                    current = "?"
                problems.append(f"run {item['run_id']}: {current} -> {item['first']} could "
                                "not be recorded")
        return problems

    def usage(self, tenant: str, since: float = 0.0, until: Optional[float] = None) -> dict:
        return self.store.usage_totals(tenant, since, until if until is not None
                                       else time.time() + 1)


def record_item(run_id: str, tenant: str, created_at: float, row: dict, insert: bool,
                expect: tuple[str, ...] = IN_FLIGHT, output=None, first: str = "") -> dict:
    """One run's write for RunStore.record: its `row` (the whole row when `insert`, else the
    columns to change on a run in one of `expect`), with its usage row when the row completes
    it (one per run: the ledger's primary key)."""
    usage = None
    if row.get("state") == "completed":
        usage = {"tenant": tenant, "input_tokens": row.get("prompt_tokens") or 0,
                 "cached_tokens": row.get("cached_tokens") or 0,
                 "output_tokens": row.get("output_tokens") or 0,
                 "duration_s": row["updated_at"] - created_at}
    return {"run_id": run_id, "insert": insert, "row": row, "expect": expect, "usage": usage,
            "output": output, "created_at": created_at, "first": first or row.get("state")}
