"""Module-scoped fixtures for HTTP tests against the router over one in-process worker (the
test model), with the offline engine beside it to compare with; import them into a test module.
"""

from __future__ import annotations

import openai
import pytest

from pd_runtime import LLM, SamplingParams
from tests.router_support.serving import ENGINE, local


@pytest.fixture(scope="module")
def server(llama_dir):
    with local(llama_dir) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    backend, port = server
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
