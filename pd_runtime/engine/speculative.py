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

A drafter that keeps missing backs off: after a verification that accepted nothing, the
request proposes nothing for 1, 2, 4, ... up to `max_backoff` steps; random text costs little.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LookupState:
    """Per request: where each n-gram of its context last ended, for the lengths looked up."""

    index: dict[tuple, int] = field(default_factory=dict)
    indexed: int = 0        # n-grams ending before this position are in `index`
    backoff: int = 0        # steps to skip proposing
    misses: int = 0         # verifications in a row that accepted nothing


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
                return tokens[at:at + min(self.k, limit)]
        return []

    def verified(self, state: LookupState, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
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
    """The engine's side of speculative decoding: drafts for the scheduler, and per
    verification the tokens kept."""

    def __init__(self, config):
        self.lookup = PromptLookup(config.speculative_tokens, config.speculative_ngram_max,
                                   config.speculative_ngram_min)
        self.stats = SpeculationStats()

    def draft(self, req, budget: int, max_model_len: int) -> list[int]:
        # The last emitted token is the bonus one: at most max_tokens - 1 drafts before it.
        limit = min(budget, req.params.max_tokens - len(req.output_token_ids) - 1,
                    max_model_len - req.num_tokens - 1)
        if limit <= 0:
            return []
        if req.lookup is None:
            req.lookup = LookupState()
        return self.lookup.propose(req.lookup, req.all_token_ids, limit)

    def verify(self, req, drafts: list[int], targets: list[int]) -> list[int]:
        """The tokens to emit: the target tokens up to the first that differs from its draft."""
        m = accepted_count(drafts, targets)
        self.lookup.verified(req.lookup, len(drafts), m)
        self.stats.verifications += 1
        self.stats.drafted += len(drafts)
        self.stats.accepted += m
        return targets[:m + 1]
