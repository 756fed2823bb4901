"""Shared fixtures: small random-weight model directories, built once per test session."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# The Triton kernels (pd_runtime/kernels/triton_paged.py) run on CPU tensors only when this is set before
# triton is first imported; nothing on the CPU path uses triton otherwise.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Run records (the router's SQLite store) go to a directory of this test session's own, never
# the user's data directory; servers the tests start as subprocesses inherit it.
_DATA_DIR = tempfile.mkdtemp(prefix="pd-runtime-test-data-")
os.environ["PD_RUNTIME_DATA_DIR"] = _DATA_DIR
atexit.register(shutil.rmtree, _DATA_DIR, True)

import pytest
import torch

# Test models are tiny; with two threads on a shared two-core box, thread barriers cost more
# than the math (measured 50x slower under load), so tests compute on one thread.
torch.set_num_threads(1)

from pd_runtime.model.tiny import make_tiny_model


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    cache = {}

    def make(architecture: str = "llama", **overrides):
        key = (architecture, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"model-{architecture}")
            cache[key] = str(make_tiny_model(path, preset="test", architecture=architecture,
                                             **overrides))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(model_factory):
    return model_factory("llama")


@pytest.fixture(scope="session")
def postgres_server():
    """A real PostgreSQL server for the session (tests/postgres_server.py), started when a
    test first asks for it."""
    from tests.postgres_server import running_server

    with running_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A URL for a new, empty run store of each kind (PostgreSQL: a fresh database)."""
    if request.param == "sqlite":
        return f"sqlite://{tmp_path / 'runs.sqlite3'}"  # an absolute path: three slashes
    # Asked for here, not as an argument: a SQLite-only selection starts no server.
    return request.getfixturevalue("postgres_server").create_database()
