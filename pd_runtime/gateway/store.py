"""Where run records live: one small interface (`RunStore`, the operations
pd_runtime/gateway/run_state.py needs, each one transaction), written once in SQL for every
database (pd_runtime/gateway/stores/sql_store.py; pd_runtime/gateway/stores/sqlite.py, the embedded default;
pd_runtime/gateway/stores/postgres.py). Every method opens no transaction the caller must close: each is
atomic on its own.
"""

from __future__ import annotations

from typing import Optional, Protocol

RUN_FIELDS = ("id", "tenant", "state", "created_at", "updated_at", "idempotency_key",
              "body_hash", "path", "route_reason", "prompt_tokens", "cached_tokens",
              "output_tokens", "workers", "error", "owner", "followed_at", "prefilling_at",
              "streaming_at", "ended_at")
# When a run entered each state: the column that holds it (the machine only moves forward,
# so each is set at most once; the three ends share one).
STATE_TIME = {"queued": "created_at", "prefilling": "prefilling_at",
              "streaming": "streaming_at", "completed": "ended_at", "failed": "ended_at",
              "cancelled": "ended_at"}
# The states a run ends in, and those it is in until then.
ENDED = ("completed", "failed", "cancelled")
IN_FLIGHT = ("queued", "prefilling", "streaming")
DAY_S = 86400.0  # the usage of deleted runs is kept per tenant and UTC day
# A run's idempotency key may only be cleared: a run refused before it served anything frees
# its key for a retry to run anew.
UPDATABLE = set(RUN_FIELDS) - {"id", "tenant", "created_at", "body_hash", "owner"}


class StoreUnavailable(RuntimeError):
    """The run store did not answer: unreachable, restarting, out of disk, or a lock held past
    the busy timeout (not a wrong statement). The operation is not done (a commit that failed
    this way may have been); the caller may try again later."""


class RunStore(Protocol):
    def insert_run(self, run: dict) -> Optional[dict]:
        """Add the run; when (tenant, idempotency_key) is taken, add nothing and return the
        run that holds it."""

    def get_run(self, run_id: str) -> Optional[dict]: ...

    def transition(self, run_id: str, expect: tuple[str, ...], state: str, at: float,
                   fields: dict, usage: Optional[dict] = None) -> Optional[str]:
        """Move the run to `state` if it is in one of `expect` (with `fields` and, for a
        completion, its usage row, at most one per run); returns the state it was in, or None
        when it was not in `expect` (nothing changed)."""

    def record(self, items: list[dict], events: list[tuple[str, int, bytes]] = ()
               ) -> list[bool]:
        """Several runs' rows, and events of runs still going (as add_events), in one
        transaction: each item's `row` (column -> value, its
        state and transition times among them) inserted (`insert` true) or, for a run already
        there, written over it if the run is in one of `expect`; then its `usage` row (a
        dict, or None) and its `output` ((kind, body), or None, kept with the run's
        `created_at`); with `drop_events`, its published events deleted. Per item: False when it
        could not be (a run not in `expect`, a row the database refused: nothing of it
        changed)."""

    def transitions(self, run_id: str) -> list[tuple[str, float]]:
        """(state, when) for each state the run has been in, in order."""

    def fail_in_flight(self, states: tuple[str, ...], error: str, at: float,
                       owner: Optional[str] = None) -> int:
        """Every run in one of `states` (of `owner` only, when given) to failed; how many."""

    def owner_seen(self, owner: str, at: float) -> None:
        """A router replica (the owner of the runs it serves) is alive at `at`."""

    def fail_lapsed(self, states: tuple[str, ...], error: str, at: float, seen_before: float,
                    alive: str) -> int:
        """Every run in one of `states` whose owner was last seen before `seen_before` (not
        `alive`, the caller) to failed; how many."""

    def save_output(self, run_id: str, kind: str, body: bytes) -> None:
        """The finished run's output as the client got it ("sse" events or a "json" body)."""

    def get_output(self, run_id: str) -> Optional[tuple[str, bytes]]: ...

    def get_opening(self, run_id: str) -> Optional[bytes]:
        """A background response's first event (the SSE bytes of its created event), written
        with its first rows (record_item's "opening"); None for any other run."""

    def get_conversation(self, run_id: str) -> Optional[bytes]:
        """A stored response's conversation (saved with its output), or None."""

    def delete_output(self, run_id: str, at: float) -> None:
        """A stored response's output and conversation deleted (DELETE /v1/responses/{id}):
        a tombstone from then on (get_output and get_conversation give None)."""

    def output_deleted(self, run_id: str) -> bool:
        """Whether the run's output was deleted (a replica holding it in memory asks)."""

    def mark_followed(self, run_id: str, at: float) -> None:
        """A client of another process waits for this run (its producer keeps it going)."""

    def take(self, bucket: str, capacity: float, per_s: float, amount: float,
             now: float) -> float:
        """Draw `amount` from a shared token bucket (created full): 0 if drawn, else seconds
        until it could be (nothing drawn; inf if it never can)."""

    def give_back(self, bucket: str, capacity: float, amount: float) -> None: ...

    def usage_totals(self, tenant: str, since: float, until: float) -> dict:
        """The tenant's usage over [since, until): its runs' rows, and the totals of each UTC day
        whose first second is in the window for runs already deleted."""

    def add_events(self, events: list[tuple[str, int, bytes]]) -> None:
        """(run id, seq, event) of runs still going, for clients of other replicas; an event
        already there is left as it is."""

    def events_after(self, run_id: str, after: int) -> list[bytes]:
        """The run's published events after sequence number `after`, in order."""

    def followed(self, owner: str, since: float) -> list[str]:
        """The runs of `owner` in flight that a client of another replica has waited for
        since `since` (runs.followed_at)."""

    def ask_cancel(self, run_id: str, at: float) -> bool:
        """Ask the run's owner to cancel it (runs.cancel_asked_at); False when it is not in
        flight."""

    def cancels_asked(self, owner: str) -> list[str]:
        """The runs of `owner` in flight whose cancel another replica asked for."""

    def delete_outputs(self, before: float, limit: int) -> int:
        """The kept outputs of up to `limit` runs created before `before`, oldest first; how
        many."""

    def delete_runs(self, before: float, limit: int) -> int:
        """Up to `limit` ended runs created before `before`, oldest first, with their outputs;
        their usage rows added to the per-day totals first (in the same transaction, each row
        once whichever process deletes it); how many."""

    def watch(self, run_id: str):
        """A context manager giving what a reader of the run waits on for its next write,
        opened before the read it follows (pd_runtime/gateway/wakeups.py Watch)."""

    def committed(self, run_ids) -> None:
        """Writes of these runs committed in another process that this one heard of (its record
        writer's round): wake their readers here, where the store does not itself."""

    def close(self) -> None: ...
