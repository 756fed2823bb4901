"""The recorded request set (tests/served_replay.py, tests/data/served_replay.json) answered
again by the current tree: every response's status, content type and normalized body exactly
as recorded, so a change below the API that alters a byte the client sees fails here. But one
thing: a float (a logprob) may differ from the recording in its last bits, within 1e-6. It was
recorded on an AVX2 CPU, and torch's float32 reductions (log-softmax, norms) take AVX2 or
AVX-512 code by the machine, rounding differently in the last place (seen on an AVX512-BF16 +
AMX Xeon: logprobs 2e-7 apart, every token and every byte of text the same). Within one
machine the replay is bit for bit (tests/test_batch_invariance.py and the engine's own tests
check that much more closely)."""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

import pytest

from tests.served_replay import DATA, REQUESTS, replay, served

pytestmark = pytest.mark.timeout(120)


def _text(answer: dict) -> list[str]:
    return json.dumps(answer, indent=1, sort_keys=True, ensure_ascii=False).splitlines()


def same(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-6 (see the module doc); every other value exactly."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def differences(expected: dict, got: dict) -> list[str]:
    """One unified diff per request whose answer is not the recorded one."""
    out = []
    for name in sorted(set(expected) | set(got)):
        if not same(expected.get(name), got.get(name)):
            diff = difflib.unified_diff(_text(expected.get(name)), _text(got.get(name)),
                                        f"recorded {name}", f"replayed {name}", lineterm="")
            out.append("\n".join(diff))
    return out


def test_recorded_requests_replay_identically(llama_dir):
    expected = json.loads(DATA.read_text())
    assert sorted(expected) == sorted(name for name, *_ in REQUESTS), \
        "the request set and its recording disagree: record it again (see served_replay.py)"
    # llama_dir is the recorder's model (same make_tiny_model arguments, byte-identical files).
    with served(llama_dir) as base_url:
        got = replay(base_url)
    diffs = differences(expected, got)
    assert not diffs, f"{len(diffs)} of {len(expected)} responses differ:\n" + "\n".join(diffs)


def test_a_changed_byte_is_reported():
    expected = json.loads(DATA.read_text())
    changed = json.loads(json.dumps(expected))
    changed["completion_greedy"]["body"]["choices"][0]["text"] += "!"
    diffs = differences(expected, changed)
    assert len(diffs) == 1 and "completion_greedy" in diffs[0] and '+' in diffs[0]


def test_a_logprob_counts_as_changed_past_a_millionth():
    expected = json.loads(DATA.read_text())
    body = expected["chat_top_logprobs"]["body"]
    entry = body["choices"][0]["logprobs"]["content"][0]
    for shift, reported in ((2e-7, False), (1e-4, True)):
        changed = json.loads(json.dumps(expected))
        changed["chat_top_logprobs"]["body"]["choices"][0]["logprobs"]["content"][0][
            "logprob"] = entry["logprob"] + shift
        assert bool(differences(expected, changed)) is reported, shift
