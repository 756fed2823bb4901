"""The recorded request set (tests/served_replay.py, tests/data/served_replay.json) answered
again by the current tree: every response's status, content type and normalized body exactly
as recorded, so a change below the API that alters a byte the client sees fails here."""

from __future__ import annotations

import difflib
import json

import pytest

from tests.served_replay import DATA, REQUESTS, replay, served

pytestmark = pytest.mark.timeout(120)


def _text(answer: dict) -> list[str]:
    return json.dumps(answer, indent=1, sort_keys=True, ensure_ascii=False).splitlines()


def differences(expected: dict, got: dict) -> list[str]:
    """One unified diff per request whose answer is not the recorded one."""
    out = []
    for name in sorted(set(expected) | set(got)):
        if expected.get(name) != got.get(name):
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
