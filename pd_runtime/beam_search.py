"""Beam search's one algorithm, stepped by whoever computes the next tokens: the router over
one-token requests (pd_runtime/entrypoints/openai/beam_search.py, vLLM's `use_beam_search`), the
offline LLM over its engine (`LLM.beam_search`). Torch-free.

Each step asks every live beam's top next tokens (2 x width, raw log-probabilities), keeps the
`width` best extensions by score, sets aside a beam that ends in EOS, and after `max_tokens`
steps the `width` best of the finished and the live are the result. A beam's score is its
summed log-probability over its length (prompt included, its EOS not) to the power
`length_penalty`, vLLM's. With no EOS reached (`ignore_eos`) this keeps the same beams as
transformers' `generate(num_beams=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

MAX_WIDTH = 10  # 2 x width candidates a beam: the most logprobs a request may ask (20)


@dataclass(frozen=True)
class BeamSpec:
    width: int
    length_penalty: float
    include_stop: bool  # a finished beam's EOS token is in its output (include_stop_str_in_output)


@dataclass
class Beam:
    tokens: list[int]  # the output, without a final EOS
    logprob: float
    eos: Optional[int] = None  # the EOS token that ended it


def score(beam: Beam, prompt_len: int, length_penalty: float) -> float:
    return beam.logprob / ((prompt_len + len(beam.tokens)) ** length_penalty)


class Search:
    """One prompt's beams: `prompts()` to compute next, `advance()` with their top tokens,
    until `prompts()` is empty; then `best()`."""

    def __init__(self, prompt: list[int], spec: BeamSpec, max_tokens: int, eos_ids: frozenset,
                 ignore_eos: bool):
        self.prompt, self.spec, self.eos_ids, self.ignore_eos = prompt, spec, eos_ids, ignore_eos
        self.steps_left = max_tokens
        self.live, self.done = [Beam([], 0.0)], []

    def _key(self, beam: Beam) -> float:
        return score(beam, len(self.prompt), self.spec.length_penalty)

    def prompts(self) -> list[list[int]]:
        """Each live beam's prompt for the next step ([]: the search is over)."""
        return [self.prompt + beam.tokens for beam in self.live] if self.steps_left else []

    def advance(self, tops: list[dict[int, float]]) -> None:
        """`tops`: per live beam, its top next tokens, {token: logprob}."""
        candidates = []
        for beam, top in zip(self.live, tops):
            for token, logprob in sorted(top.items(), key=lambda item: -item[1]):
                if token in self.eos_ids and not self.ignore_eos:
                    self.done.append(Beam(beam.tokens, beam.logprob + logprob, eos=token))
                else:
                    candidates.append(Beam(beam.tokens + [token], beam.logprob + logprob))
        # (a stable sort: ties keep their beam's and rank's order)
        self.live = sorted(candidates, key=self._key, reverse=True)[:self.spec.width]
        self.steps_left = self.steps_left - 1 if self.live else 0

    def best(self) -> list[Beam]:
        """The `width` best beams, best first."""
        return sorted(self.done + self.live, key=self._key, reverse=True)[:self.spec.width]


Step = Callable[[list[list[int]]], Awaitable[list[dict[int, float]]]]


async def search(step: Step, prompt: list[int], spec: BeamSpec, max_tokens: int,
                 eos_ids: frozenset, ignore_eos: bool) -> list[Beam]:
    """The `spec.width` best beams after `prompt`, best first. `step(prompts)`: each prompt's
    top next tokens, {token: logprob}."""
    run = Search(prompt, spec, max_tokens, eos_ids, ignore_eos)
    while prompts := run.prompts():
        run.advance(await step(prompts))
    return run.best()


