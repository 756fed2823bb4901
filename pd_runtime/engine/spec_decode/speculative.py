"""Speculative decoding by prompt lookup: a running request's next tokens are guessed from its
own context (the tokens that followed the latest earlier occurrence of its last n tokens), and
one forward of the target model checks them all.

Verification and acceptance (engine.py): the step computes the last token and the k drafted
ones as one chunk, and the sampler draws a target token at each of the k + 1 positions as it
would without speculation (same adjustments, same history up to that position, the same
generator draw for a seeded request). Draft i is accepted while the target token at position
i equals it; the tokens emitted are the target tokens up to and including the first that
differs (or the bonus one after the last draft). For a drafter that proposes one token with
certainty this is the standard rejection rule: draft d is kept with probability p(d), and on a
rejection the emitted token is a draw from p without d, renormalized, so the output follows
the target distribution exactly; under greedy sampling it is plain decoding token for token,
and a seeded request's generator is put back to where the emitted tokens leave it (so seeded
outputs equal plain decoding's too).

How many to guess is a cost decision, per request and step: the n-th guess is kept with
probability p^n (p: the request's measured rate at which a guess holds, given the ones before
it held), and a kept guess saves the request's share of a decode step, while every guess costs
a prompt token's compute (both from the engine's live step-cost fit), and with a draft model
what the draft spends per guess (measured). Guesses stop where
p^n x saving < cost: many on repetitive text at batch 1, where a step is mostly fixed cost;
few or none in a large batch or where guesses fail. A drafter that keeps missing also backs
off: after a verification that kept nothing, the request proposes nothing for 1, 2, 4, ... up
to `max_backoff` steps, so random text costs little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

_DECAY = 0.7          # per verification, of a request's guess record
_PRIOR_HELD = 0.5     # a request's first guesses: as if one of two held


@dataclass
class LookupState:
    """Per request: where each n-gram of its context last ended, for the lengths looked up."""

    index: dict[tuple, int] = field(default_factory=dict)
    indexed: int = 0        # n-grams ending before this position are in `index`
    backoff: int = 0        # steps to skip proposing
    misses: int = 0         # verifications in a row that accepted nothing
    held: float = 0.0       # guesses kept (decayed), and guesses checked with all before kept
    checked: float = 0.0
    idle: int = 0           # steps since guesses were last worth making


class PromptLookup:
    def __init__(self, num_tokens: int, ngram_max: int = 4, ngram_min: int = 2,
                 max_backoff: int = 16):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("speculative ngram sizes need 1 <= ngram_min <= ngram_max")
        self.k, self.n_max, self.n_min, self.max_backoff = num_tokens, ngram_max, ngram_min, \
            max_backoff

    def propose(self, state: LookupState, tokens: list[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens that followed the latest earlier occurrence of the
        context's last n tokens (the longest n that occurs), or none."""
        if limit <= 0 or self.k <= 0:
            return []
        if state.backoff > 0:
            state.backoff -= 1
            return []
        end = len(tokens)
        # Index every n-gram that ends before the context's last position: the suffix itself
        # must match an earlier occurrence, not itself.
        for stop in range(max(state.indexed, self.n_min), end):
            for n in range(self.n_min, min(self.n_max, stop) + 1):
                state.index[tuple(tokens[stop - n:stop])] = stop
        state.indexed = max(state.indexed, end)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            at = state.index.get(tuple(tokens[end - n:]))
            if at is not None and at < end:
                # The continuation may run into the guesses themselves (a repeat that is
                # still going on: with period end - at, the guesses go on repeating it).
                out: list[int] = []
                for i in range(min(self.k, limit)):
                    out.append(tokens[at + i] if at + i < end else out[at + i - end])
                return out
        return []

    def verified(self, state: LookupState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        # Guesses checked: the kept ones and the first rejected one (those after it were not
        # in question); decayed so the rate follows the text.
        state.held = _DECAY * state.held + accepted
        state.checked = _DECAY * state.checked + accepted + (accepted < drafted)
        if accepted == 0:
            state.misses += 1
            state.backoff = min(self.max_backoff, 1 << (state.misses - 1))
        else:
            state.misses = 0


def accepted_count(drafts: list[int], targets: list[int]) -> int:
    """How many drafts the target tokens confirm: the longest prefix where they agree."""
    m = 0
    while m < len(drafts) and targets[m] == drafts[m]:
        m += 1
    return m


@dataclass
class SpeculationStats:
    """Counters since the worker started (load report, /metrics)."""

    verifications: int = 0  # (request, step) pairs that verified drafts
    drafted: int = 0
    accepted: int = 0

    def report(self) -> dict:
        return {"verifications": self.verifications, "drafted_tokens": self.drafted,
                "accepted_tokens": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
                # tokens a verifying request gains per step: the accepted drafts and the one
                # the target model adds
                "tokens_per_verification": (self.accepted + self.verifications)
                / self.verifications if self.verifications else None}


class Speculator:
    """The engine's side of speculative decoding: drafts for the scheduler (prompt lookup, or
    a draft model's, pd_runtime/engine/spec_decode/draft_model.py), and per verification the tokens kept."""

    def __init__(self, config, draft_model=None):
        self.lookup = PromptLookup(config.speculative_tokens, config.speculative_ngram_max,
                                   config.speculative_ngram_min)
        self.draft_model = draft_model
        self.stats = SpeculationStats()
        self.costs: dict = {}
        self.batch = 1
        self.pending: dict[str, list[int]] = {}  # the draft model's guesses for this step

    def plan_step(self, coefficients: dict, running: list) -> None:
        """Before a step is scheduled: the live step-cost fit and the running requests (those
        decoding get the draft model's guesses now, batched)."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        self.costs, self.batch = coefficients, max(1, len(decoding))
        if self.draft_model is None:
            return
        wanted, k = [], 0
        for req in decoding:
            state = _state(req)
            if state.backoff > 0:
                state.backoff -= 1
                continue
            allowed = self.allowed(state, req.num_tokens)
            if allowed > 0:
                wanted.append(req)
                k = max(k, allowed)
        self.pending = self.draft_model.propose(wanted, k)

    def worth(self, state: LookupState, context: int) -> int:
        """Guesses worth their compute for a request at this context length (see above)."""
        c = self.costs
        saving = c.get("step_s", 0.0) / self.batch + c.get("decode_seq_s", 0.0) \
            + c.get("decode_context_s", 0.0) * context
        cost = c.get("prefill_token_s", 0.0) + c.get("prefill_attention_s", 0.0) * context
        if self.draft_model is not None:  # and what the draft model spends on a guess
            cost += self.draft_model.guess_s
        if cost <= 0 or saving <= 0:  # no fit yet
            return self.lookup.k
        p = (state.held + _PRIOR_HELD) / (state.checked + 1.0)
        if p >= 1.0:
            return self.lookup.k
        if p <= 0.0 or saving * p < cost:
            return 0
        return min(self.lookup.k, int(math.log(cost / saving) / math.log(p)))

    def allowed(self, state: LookupState, context: int) -> int:
        """Guesses to make now: those worth it, or one every max_backoff steps when none is
        (it keeps the request's hold-rate estimate alive)."""
        worth = self.worth(state, context)
        if worth <= 0 and state.idle + 1 >= self.lookup.max_backoff:
            return 1
        return worth

    def draft(self, req, budget: int, max_model_len: int) -> list[int]:
        # The last emitted token is the bonus one: at most max_tokens - 1 drafts before it.
        limit = min(budget, req.params.max_tokens - len(req.output_token_ids) - 1,
                    max_model_len - req.num_tokens - 1)
        if limit <= 0:
            return []
        state = _state(req)
        allowed = self.allowed(state, req.num_tokens)
        if allowed <= 0:
            state.idle += 1
            return []
        state.idle = 0
        limit = min(limit, allowed)
        if self.draft_model is not None:
            return self.pending.get(req.request_id, [])[:limit]
        return self.lookup.propose(state, req.all_token_ids, limit)

    def verify(self, req, drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens to emit: the target tokens up to the first that differs from its draft."""
        m = accepted_count(drafts, targets)
        self.lookup.verified(req.lookup, len(drafts), m)
        self.stats.verifications += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += m
        return targets[:m + 1]


def _state(req) -> LookupState:
    if req.lookup is None:
        req.lookup = LookupState()
    return req.lookup
