"""Each request's class against its fault-free reference: correct (token strings, their ids where
a string pins one, and text identical), failed (a clear OpenAI-format error), wrong (silently
different), hung (no end within the bound), unclear (broken without a usable error), cancelled.
"""

from __future__ import annotations

from collections import Counter

from tests.chaos_support.client import RequestResult
from tests.chaos_support.workload import Expected

CLASSES = ("correct", "failed", "wrong", "hung", "unclear", "cancelled")


def _first_difference(got: list, want: tuple) -> int:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return min(len(got), len(want))


def _token_mismatch(r: RequestResult, ref: Expected, ambiguous: set[str],
                    logprob_tol: float, prefix_only: bool) -> str:
    """'' if the tokens seen agree with the reference (as a prefix when `prefix_only`)."""
    n = len(r.tokens)
    want = ref.tokens if not prefix_only else ref.tokens[:n]
    if list(want) != r.tokens:
        i = _first_difference(r.tokens, want)
        return (f"tokens differ at {i}: got {r.tokens[i:i + 3]!r} (of {n}), "
                f"want {list(want[i:i + 3])!r} (of {len(want)})")
    for i, s in enumerate(r.tokens):
        # Several ids print as this string; a different id has a different logprob.
        if s in ambiguous and i < len(r.logprobs) and \
                abs(r.logprobs[i] - ref.logprobs[i]) > logprob_tol:
            return (f"token {i} ({s!r}) has logprob {r.logprobs[i]:.6f}, the reference "
                    f"{ref.logprobs[i]:.6f}: another id with the same string")
    return ""


def classify(r: RequestResult, ref: Expected, ambiguous: set[str],
             logprob_tol: float = 1e-3) -> str:
    """Sets r.label_class and r.detail and returns the class."""
    cls, detail = _classify(r, ref, ambiguous, logprob_tol)
    r.label_class, r.detail = cls, detail
    return cls


def _classify(r: RequestResult, ref: Expected, ambiguous: set[str],
              logprob_tol: float) -> tuple[str, str]:
    if r.hung:
        return "hung", f"no end within the bound; {len(r.tokens)} tokens seen"
    # Whatever arrived before an error or a cancel must still be the reference's beginning.
    partial = _token_mismatch(r, ref, ambiguous, logprob_tol, prefix_only=True)
    if partial or not ref.text.startswith(r.text):
        return "wrong", partial or f"text {r.text!r} is not a prefix of {ref.text!r}"
    if r.cancelled:
        return "cancelled", f"client closed after {len(r.tokens)} tokens"
    if r.error is not None:
        where = "stream event" if r.error_in_stream else f"HTTP {r.status}"
        return "failed", (f"{where} {r.error.get('type')}: {r.error.get('message')}"
                          f" (retry-after {r.retry_after}, {len(r.tokens)} tokens before)")
    if r.broken is not None:
        return "unclear", r.broken
    full = _token_mismatch(r, ref, ambiguous, logprob_tol, prefix_only=False)
    if full:
        return "wrong", full
    if r.text != ref.text:
        return "wrong", f"text {r.text!r} != reference {ref.text!r}"
    if r.finish_reason != ref.finish_reason:
        return "wrong", f"finish_reason {r.finish_reason!r} != {ref.finish_reason!r}"
    return "correct", ""


def counts(results: list[RequestResult]) -> Counter:
    c = Counter({k: 0 for k in CLASSES})
    c.update(r.label_class for r in results)
    return c
