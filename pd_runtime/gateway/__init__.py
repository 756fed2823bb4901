"""Run records: every generation request a run. The durable state (run_state.py: the runs' state
machine, idempotency keys, recorded outputs, the usage ledger and shared rate buckets) behind one
storage interface (store.py; open.py picks one by URL; retention.py) written once in SQL in stores/
(sql_store.py; sqlite.py embedded, postgres.py; migrations.py), and the serving process's side of it: the
runs it produces and follows (recorder.py, each one's buffer of events in live_run.py, which
retries and resumed streams read), the writer that records them in rounds (record_writer.py,
through its child process, record_process.py) and the readers woken when a write they wait for
commits (wakeups.py; stores/postgres_notify.py, stores/sqlite_notify.py). It may import, of pd_runtime, the
router's Backend contract (router/backend.py: the error a run ends with) and cpu_time; never the
HTTP layer (entrypoints), which imports it (docs/architecture.md, "Who may import what").
"""
