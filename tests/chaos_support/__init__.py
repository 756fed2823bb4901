"""Chaos harness for the served product: start `pd-runtime serve`, drive streaming load over HTTP,
inject worker and link faults, and classify every request against a fault-free reference.

Shared by tests/test_chaos.py (short phases) and bench/chaos.py (long phases, the table).
"""
