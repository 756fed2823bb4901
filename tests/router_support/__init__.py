"""Helpers for the router's HTTP tests: scripted backends and server fixtures."""
