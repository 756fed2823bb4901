"""Peer-engine benchmark drivers (run under their own virtualenvs)."""
