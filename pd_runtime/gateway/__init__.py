"""The gateway's durable state: run records, idempotency keys, recorded outputs, the usage
ledger and shared rate buckets (pd_runtime/gateway/runs.py), behind one storage interface (pd_runtime/gateway/store.py:
SQLite embedded; pd_runtime/gateway/postgres.py: PostgreSQL; pd_runtime/gateway/open.py picks one by URL)."""
