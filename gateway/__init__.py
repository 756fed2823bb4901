"""The gateway's durable state: run records, idempotency keys, recorded outputs, the usage
ledger and shared rate buckets (gateway/runs.py), behind one storage interface (gateway/store.py:
SQLite embedded; gateway/postgres.py: PostgreSQL; gateway/open.py picks one by URL)."""
