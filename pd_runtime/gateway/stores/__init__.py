"""Run stores: the RunStore operations in SQL (sql_store.py) on SQLite and PostgreSQL, each with
its way of waking readers (sqlite_notify.py, postgres_notify.py), and the schema's migrations."""
