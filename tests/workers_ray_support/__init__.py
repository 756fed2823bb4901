"""Helpers for the Ray runtime's tests: the local Ray cluster, the reference tokens, and how a
test reads a stream and waits for every worker to give its blocks back."""
