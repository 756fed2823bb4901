"""The run store's schema, versioned: migration N brings the schema from version N - 1 to N.
A store applies the ones it has not yet recorded, in order, in one transaction each; never edit
a released migration, add the next one."""

from __future__ import annotations

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (1, "runs, their transitions, the usage ledger", [
        """CREATE TABLE runs (
               id TEXT PRIMARY KEY,
               tenant TEXT NOT NULL,
               state TEXT NOT NULL,
               created_at REAL NOT NULL,
               updated_at REAL NOT NULL,
               idempotency_key TEXT,
               body_hash TEXT,
               path TEXT,
               route_reason TEXT,
               prompt_tokens INTEGER,
               cached_tokens INTEGER,
               output_tokens INTEGER,
               workers TEXT,
               error TEXT,
               UNIQUE (tenant, idempotency_key))""",
        "CREATE INDEX runs_by_state ON runs (state)",
        """CREATE TABLE run_transitions (
               run_id TEXT NOT NULL REFERENCES runs (id),
               state TEXT NOT NULL,
               at REAL NOT NULL)""",
        "CREATE INDEX run_transitions_by_run ON run_transitions (run_id)",
        """CREATE TABLE usage (
               run_id TEXT PRIMARY KEY REFERENCES runs (id),
               tenant TEXT NOT NULL,
               input_tokens INTEGER NOT NULL,
               cached_tokens INTEGER NOT NULL,
               output_tokens INTEGER NOT NULL,
               duration_s REAL NOT NULL,
               finished_at REAL NOT NULL)""",
        "CREATE INDEX usage_by_tenant_time ON usage (tenant, finished_at)",
    ]),
    (2, "run owners (router replicas), recorded outputs for resume, shared rate buckets", [
        # The router replica that serves the run: its restart fails only its own runs.
        "ALTER TABLE runs ADD COLUMN owner TEXT",
        # A finished run's output as the client got it (SSE events or the JSON body), so a
        # retry or a resumed stream replays it without recomputation.
        """CREATE TABLE run_outputs (
               run_id TEXT PRIMARY KEY REFERENCES runs (id),
               kind TEXT NOT NULL,
               body BLOB NOT NULL)""",
        # Token buckets every router replica draws from (tenants' rate limits).
        """CREATE TABLE rate_buckets (
               name TEXT PRIMARY KEY,
               level REAL NOT NULL,
               stamp REAL NOT NULL)""",
    ]),
    (3, "index only the runs in flight (what start-up recovery looks for)", [
        # Most runs are written once, finished: they need not enter a state index at all.
        "DROP INDEX runs_by_state",
        "CREATE INDEX runs_in_flight ON runs (state) "
        "WHERE state IN ('queued', 'prefilling', 'streaming')",
    ]),
    (4, "when a run was last waited for by a client of another router replica", [
        # The replica producing the run does not cancel it while this is recent.
        "ALTER TABLE runs ADD COLUMN followed_at REAL",
    ]),
    (5, "a run's transition times as its own columns (one row per run, not one per state)", [
        # Each state is entered at most once (the machine only moves forward), so a column per
        # state holds what run_transitions did, and a short run is one row in one statement.
        "ALTER TABLE runs ADD COLUMN prefilling_at REAL",
        "ALTER TABLE runs ADD COLUMN streaming_at REAL",
        "ALTER TABLE runs ADD COLUMN ended_at REAL",
        """UPDATE runs SET
               prefilling_at = (SELECT MIN(at) FROM run_transitions t
                                WHERE t.run_id = runs.id AND t.state = 'prefilling'),
               streaming_at = (SELECT MIN(at) FROM run_transitions t
                               WHERE t.run_id = runs.id AND t.state = 'streaming'),
               ended_at = (SELECT MIN(at) FROM run_transitions t WHERE t.run_id = runs.id
                           AND t.state IN ('completed', 'failed', 'cancelled'))""",
        # Routers of an older version write run_transitions: replicas sharing a store are
        # upgraded together (stop all, start all), not one by one.
        "DROP TABLE run_transitions",
    ]),
    (6, "when each router replica last showed it was alive (runs of a lapsed one are failed)", [
        """CREATE TABLE run_owners (
               name TEXT PRIMARY KEY,
               seen_at REAL NOT NULL)""",
    ]),
    (7, "retention: runs found by age, and the usage of deleted runs kept per tenant and day", [
        # What the retention passes walk (pd_runtime/gateway/retention.py): runs, and the outputs kept,
        # older than a cutoff (an output's time is its run's, copied so that neither walk
        # reads the other table).
        "CREATE INDEX runs_by_created ON runs (created_at)",
        "ALTER TABLE run_outputs ADD COLUMN created_at REAL",
        """UPDATE run_outputs SET created_at = (SELECT created_at FROM runs r
                                                WHERE r.id = run_outputs.run_id)""",
        "CREATE INDEX run_outputs_by_created ON run_outputs (created_at)",
        # A deleted run's usage row is added here first: the ledger's totals per UTC day
        # (`day`: its first second) outlive the runs they count.
        # BIGINT: a tenant's day of tokens passes 2^31 at ~25k tokens/s (PostgreSQL's INTEGER
        # is 4 bytes; SQLite's is 8 either way).
        """CREATE TABLE usage_days (
               tenant TEXT NOT NULL,
               day REAL NOT NULL,
               runs BIGINT NOT NULL,
               input_tokens BIGINT NOT NULL,
               cached_tokens BIGINT NOT NULL,
               output_tokens BIGINT NOT NULL,
               duration_s REAL NOT NULL,
               PRIMARY KEY (tenant, day))""",
    ]),
    (8, "the events of a run still going, for a client following it from another replica", [
        # Written by the producing replica only while another replica's client follows the
        # run (runs.followed_at), deleted with its final row (its output then holds them).
        """CREATE TABLE run_events (
               run_id TEXT NOT NULL REFERENCES runs (id),
               seq INTEGER NOT NULL,
               data BLOB NOT NULL,
               PRIMARY KEY (run_id, seq))""",
    ]),
    (9, "a stored response's conversation, for the next request's previous_response_id", [
        # The chat messages a Responses API run was given and answered (JSON), written with
        # its output and deleted with it.
        "ALTER TABLE run_outputs ADD COLUMN conversation BLOB",
    ]),
    (10, "background responses: their first event, and a cancel asked of their owner", [
        # Set by the replica a client asked to cancel a background response another replica
        # runs; the owner reads it with the runs followed from elsewhere, and cancels it.
        "ALTER TABLE runs ADD COLUMN cancel_asked_at REAL",
        # A background response's created event, written while it runs: what a poll reads
        # should its router stop before the end, and how another replica knows it is one. A
        # table of its own (no foreign key): routers of an older version sharing the store
        # never read it, and delete their runs without it.
        """CREATE TABLE run_openings (
               run_id TEXT PRIMARY KEY,
               body BLOB NOT NULL)""",
    ]),
]
