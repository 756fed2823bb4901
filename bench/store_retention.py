"""What retention (pd_runtime/gateway/retention.py) costs the embedded run store, against the store's own
write cost in the same run: two SQLite stores filled alike on this machine's disk, one as the
current schema makes it and one without the two age indexes retention walks (what writes paid
before it).

    python bench/store_retention.py [--runs 200000] [--days 40] [--round 50] [--rounds 60]

1. Writes: rounds of `--round` new runs (as the record writer sends them: whole rows, a usage
   row each completed run, a quarter with a 2 KB output) into each store, alternated: µs per
   run, with the indexes over without.
2. Deleting: a pass of the default keeps (outputs 1 day, runs 30 days) over the current store,
   a batch at a time as the writer process runs it: how long each batch holds the store's write
   lock (what a round of records may wait behind), and µs per run deleted against µs per run
   written: under 1, retention keeps up with any rate the store can write.
3. The upgrade: the second store taken back to schema 6, then opened (migration 7 builds the
   indexes and copies the outputs' ages; 8 adds a table).
"""

from __future__ import annotations

import argparse
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pd_runtime.gateway.stores.migrations import MIGRATIONS  # noqa: E402
from pd_runtime.gateway.retention import BATCH, Retention  # noqa: E402
from pd_runtime.gateway.run_state import IN_FLIGHT, Runs, record_item  # noqa: E402
from pd_runtime.gateway.stores.sqlite import SqliteRunStore  # noqa: E402
from pd_runtime.gateway.store import DAY_S  # noqa: E402

OUTPUT = b"data: " + b"x" * 2040 + b"\n\n"


def items(count: int, start: float, step_s: float, rng: random.Random, first: int) -> list:
    out = []
    for i in range(count):
        created = start + i * step_s
        row = Runs.new_run("acme", f"run-{first + i:09d}", owner="bench:8000/0", now=created)
        state = "completed" if rng.random() < 0.95 else "failed"
        row.update(state=state, prefilling_at=created + 0.001, streaming_at=created + 0.05,
                   ended_at=created + 0.4, updated_at=created + 0.4, path="colocated",
                   route_reason="slo: colocated meets ttft", prompt_tokens=rng.randrange(900),
                   cached_tokens=0, output_tokens=rng.randrange(200), workers='["decode-0"]')
        output = ("sse", OUTPUT) if rng.random() < 0.25 else None
        out.append(record_item(row["id"], "acme", created, row, True, IN_FLIGHT, output))
    return out


def opened(path: Path, indexed: bool) -> SqliteRunStore:
    store = SqliteRunStore(path)
    store.cache_pages(16384)  # as the writer process opens it
    if not indexed:
        store._db().execute("DROP INDEX runs_by_created")
        store._db().execute("DROP INDEX run_outputs_by_created")
    return store


def back_to_schema_6(path: Path) -> None:
    """Undo migrations 7 and 8 on a store: what a router of the version before retention
    left."""
    db = sqlite3.connect(path, isolation_level=None)
    for statement in ("DROP TABLE run_events", "DROP INDEX IF EXISTS runs_by_created",
                      "DROP INDEX IF EXISTS run_outputs_by_created",
                      "ALTER TABLE run_outputs DROP COLUMN created_at", "DROP TABLE usage_days",
                      "DELETE FROM schema_migrations WHERE version >= 7"):
        db.execute(statement)
    db.close()


def fill(store, runs: int, days: float, seed: int) -> None:
    rng = random.Random(seed)
    now = time.time()
    step = days * DAY_S / runs
    for first in range(0, runs, 2000):
        store.record(items(min(2000, runs - first), now - days * DAY_S + first * step, step,
                           rng, first))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200_000)
    parser.add_argument("--days", type=float, default=40.0)
    parser.add_argument("--round", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batch", type=int, default=BATCH, help="runs a retention step deletes")
    args = parser.parse_args()
    assert MIGRATIONS[-1][0] == 8, "part 3 undoes migrations 7 and 8"
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"without": Path(tmp) / "without.sqlite3", "current": Path(tmp) / "current.sqlite3"}
        stores = {"without": opened(paths["without"], indexed=False),
                  "current": opened(paths["current"], indexed=True)}
        began = time.perf_counter()
        for store in stores.values():
            fill(store, args.runs, args.days, seed=1)
        print(f"filled two stores with {args.runs} runs over {args.days:g} days each in "
              f"{time.perf_counter() - began:.1f} s")

        rng = random.Random(2)
        per_run = {name: [] for name in stores}
        first = args.runs
        for r in range(args.rounds):
            order = list(stores) if r % 2 == 0 else list(stores)[::-1]
            batch = items(args.round, time.time(), 0.001, rng, first)
            first += args.round
            for name in order:
                start = time.perf_counter()
                stores[name].record(batch)
                per_run[name].append((time.perf_counter() - start) / args.round * 1e6)
        write = {name: statistics.median(v) for name, v in per_run.items()}
        print(f"\n1. writes, {args.rounds} alternated rounds of {args.round} runs "
              "(median µs per run):")
        for name in stores:
            print(f"   {'with' if name == 'current' else 'without'} the age indexes: "
                  f"{write[name]:.1f}")
        print(f"   with / without: {write['current'] / write['without']:.3f}")

        current = stores["current"]
        ledger = current.usage_totals("acme", 0, time.time() + 1)
        retention = Retention(current, 86400.0, 30 * 86400.0, batch=args.batch)
        held = []
        began = time.perf_counter()
        more = True
        while more:
            start = time.perf_counter()
            more = retention.step()
            held.append((time.perf_counter() - start) * 1e3)
        total = time.perf_counter() - began
        remaining = current._db().execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        deleted_runs = first - remaining
        per_deleted = total / max(1, deleted_runs) * 1e6
        held.sort()
        print(f"\n2. a pass of the default keeps: {deleted_runs} runs (and the outputs of a "
              f"day's more) in {len(held)} batches, {total:.2f} s")
        print(f"   write lock held per batch: p50 {held[len(held) // 2]:.1f} ms, "
              f"p99 {held[int(len(held) * 0.99)]:.1f} ms, max {held[-1]:.1f} ms")
        print(f"   µs per run deleted {per_deleted:.1f} / per run written "
              f"{write['current']:.1f} = {per_deleted / write['current']:.2f}")
        after = current.usage_totals("acme", 0, time.time() + 1)
        print(f"   ledger: {ledger['runs']} completed runs, {ledger['output_tokens']} output "
              f"tokens before; {after['runs']}, {after['output_tokens']} after")

        for store in stores.values():
            store.close()
        back_to_schema_6(paths["without"])
        start = time.perf_counter()
        SqliteRunStore(paths["without"]).close()
        print(f"\n3. upgrade of a schema-6 store ({first} runs) to schema 8: "
              f"{time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
