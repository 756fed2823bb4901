"""The gateway's durable state: run records, idempotency keys and the usage ledger
(gateway/runs.py), behind one small storage interface (gateway/store.py: SQLite embedded)."""
