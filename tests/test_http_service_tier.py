"""OpenAI's service_tier: "flex" work (evaluation runs, batch jobs) is not held to the latency
targets; under targets no option can meet, a default-tier request gets its early 429 and a
flex one is served. Over HTTP with the official `openai` client."""

from __future__ import annotations

import time

import openai
import pytest

from pd_runtime.config import RouterConfig
from tests.router_support.serving import local

IMPOSSIBLE = {"mode": "slo", "slo": {"ttft_s": 1e-6, "tpot_s": 1e-6}}


@pytest.fixture(scope="module")
def served(llama_dir):
    with local(llama_dir, RouterConfig(routing=IMPOSSIBLE)) as (backend, port):
        yield backend, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                     max_retries=0)


def test_flex_is_served_where_the_default_tier_is_refused(served):
    """Targets no worker meets even idle, and the worker's ledger holds a prefill a minute
    long (as a long prompt ahead would): the default tier gets its early 429, flex is served
    (routed by load, at a later priority), and says so."""
    backend, client = served
    ledger = backend.ledgers[backend.client.decode[0].worker_id]
    ledger.add_prefill("ahead", 60.0, time.monotonic())
    try:
        for tier in (None, "default", "auto"):
            with pytest.raises(openai.RateLimitError) as caught:
                client.completions.create(model=backend.model_name, prompt="hello",
                                          max_tokens=4, extra_body={"service_tier": tier})
            assert "predicted" in caught.value.body["message"]
        done = client.completions.create(model=backend.model_name, prompt="hello", max_tokens=4,
                                         temperature=0, extra_body={"service_tier": "flex"})
        assert done.to_dict()["service_tier"] == "flex" and done.usage.completion_tokens == 4
        chat = client.chat.completions.create(model=backend.model_name, max_tokens=3,
                                              messages=[{"role": "user", "content": "hi"}],
                                              service_tier="flex", stream=True)
        events = list(chat)
        assert events and all(e.service_tier == "flex" for e in events)
        assert "".join(e.choices[0].delta.content or "" for e in events if e.choices)
    finally:
        ledger.prefill_done("ahead", time.monotonic(), ran=False)
    # A flex prefill is not booked in the queue the default tier's admission predicts from
    # (the engine runs it later): it neither delays their predictions nor teaches a slowdown.
    booked = ledger.done_total
    client.completions.create(model=backend.model_name, prompt="a flex prompt", max_tokens=2,
                              extra_body={"service_tier": "flex"})
    assert ledger.done_total == booked and not ledger.prefills
    plain = client.completions.create(model=backend.model_name, prompt="hello", max_tokens=2)
    assert "service_tier" not in plain.to_dict()  # not named: not reported
    assert ledger.done_total > booked  # the default tier's prefill was booked and done


def test_unsupported_tiers_are_refused_by_name(served):
    backend, client = served
    for tier in ("priority", "scale"):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=backend.model_name, prompt="x", max_tokens=2,
                                      extra_body={"service_tier": tier})
        assert caught.value.body["param"] == "service_tier"
        assert caught.value.body["code"] == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=backend.model_name, prompt="x", max_tokens=2,
                                  extra_body={"service_tier": "cheap"})
    assert caught.value.body["param"] == "service_tier"
