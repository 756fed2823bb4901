"""Beam search over HTTP (vLLM's `use_beam_search`, `n` the beam width, `length_penalty`),
run by the router as vLLM's server runs it: pd_runtime/beam_search.py's algorithm, each step
one ordinary one-token request per live beam (raw log-probabilities, the top 2 x width), which
hits the prefix cache (a beam's prompt is its last step's plus one token), so a step costs
about one token per beam. The chosen beams go to the response as the choices' whole outputs,
in score order, once the search ends (a stream sends each at its end). Sampling fields are
refused (`stop`, logprobs, penalties, logit_bias, structured outputs, ...): they would be
ignored.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import AsyncIterator, Optional

from pd_runtime.api import SamplingParams, StreamChunk
from pd_runtime.beam_search import MAX_WIDTH, Beam, BeamSpec, search
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest

# Fields that would change a sampled output but not a beam's: refused rather than ignored.
# name -> the values that mean "not asked".
_REFUSED = {"stop": (None, [], ""), "stop_token_ids": (None, []), "min_tokens": (0, None),
            "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
            "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
            "allowed_token_ids": (None,), "bad_words": (None, []), "prompt_logprobs": (None,),
            "logprobs": (None, False), "top_logprobs": (None,), "best_of": (None,)}


def spec(body, data: dict, structured: bool) -> Optional[BeamSpec]:
    """The request's beam search, or None when it asks for none."""
    if not body.use_beam_search:
        return None
    if not 1 <= body.n <= MAX_WIDTH:
        raise InvalidRequest(f"n (the beam width with use_beam_search) must be in "
                             f"[1, {MAX_WIDTH}], got {body.n}", param="n")
    if not math.isfinite(body.length_penalty):
        raise InvalidRequest("length_penalty must be a finite number", param="length_penalty")
    for name, off in _REFUSED.items():
        value = data.get(name)
        if value is not None and not any(value == o and type(value) is type(o) for o in off):
            raise InvalidRequest(f"{name} does not apply to beam search (use_beam_search)",
                                 param=name)
    if structured:
        raise InvalidRequest("structured outputs do not apply to beam search "
                             "(use_beam_search)", param="use_beam_search")
    return BeamSpec(body.n, float(body.length_penalty), body.include_stop_str_in_output)


def streams(backend, prepared, response_id: str, tenant, timeout_s: float) -> list:
    """One stream per choice (merge_streams' input): each prompt's search runs once, its beams
    handed to the prompt's choices in score order."""
    searches: dict[int, _Search] = {}
    out = []
    for choice in prepared.choices:
        run = searches.get(choice.prompt_index)
        if run is None:
            run = searches[choice.prompt_index] = _Search(
                backend, prepared, choice, f"{response_id}-beam{choice.prompt_index}", tenant,
                timeout_s)
        out.append(run.stream(len(run.takers)))
        run.takers.append(choice.index)
    return out


class _Search:
    """One prompt's search, started by the first of its choices' streams to be read and
    cancelled when the last one closes before it ends."""

    def __init__(self, backend, prepared, choice, request_id: str, tenant, timeout_s: float):
        self.backend, self.prepared, self.params = backend, prepared, choice.params
        self.prompt = prepared.prompts[choice.prompt_index]
        self.request_id, self.tenant, self.timeout_s = request_id, tenant, timeout_s
        self.takers: list[int] = []
        self.open = 0
        self.task: Optional[asyncio.Task] = None
        self.steps = 0
        self.first: Optional[StreamChunk] = None  # the first step's: the prompt's token counts

    async def stream(self, rank: int) -> AsyncIterator[StreamChunk]:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run())
        self.open += 1
        try:
            result = await asyncio.shield(self.task)
            yield result if isinstance(result, StreamChunk) else self._chunk(result, rank)
        finally:
            self.open -= 1
            if not self.open and not self.task.done():
                self.task.cancel()

    async def _run(self):
        spec: BeamSpec = self.prepared.beam
        # The tenant's rate limits count the search once, as one request of its prompt and
        # every beam's tokens, not each of its steps.
        refusal = await self.backend.admit_tenant(
            self.tenant, len(self.prompt) + spec.width * self.params.max_tokens)
        if refusal is not None:
            return refusal
        try:
            return await search(self._step, self.prompt, spec, self.params.max_tokens,
                                 self.backend.tokenizer.eos_token_ids, self.params.ignore_eos)
        except _StepError as exc:
            return exc.chunk

    async def _step(self, prompts: list[list[int]]) -> list[dict[int, float]]:
        width = self.prepared.beam.width
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width,
                                ignore_eos=True)
        self.steps += 1
        return await asyncio.gather(*(self._next(f"{self.request_id}-{self.steps}-{i}", p, params)
                                      for i, p in enumerate(prompts)))

    async def _next(self, request_id: str, prompt: list[int], params) -> dict[int, float]:
        top: dict[int, float] = {}
        async for chunk in self.backend.generate(
                request_id, prompt, params, priority=self.prepared.priority, tenant=self.tenant,
                deadline=time.time() + self.timeout_s, cache_salt=self.prepared.cache_salt,
                flex=self.prepared.service_tier == "flex", prepaid=True):
            if chunk.error is not None:
                raise _StepError(chunk)
            if self.first is None:
                self.first = chunk
            for entry in chunk.logprobs or ():
                top = dict(entry[1])
        return top

    def _chunk(self, beams: list[Beam], rank: int) -> StreamChunk:
        """Choice `rank`'s output as one finished chunk, as a worker's would read."""
        beam = beams[min(rank, len(beams) - 1)]  # (fewer beams than choices: a tiny vocabulary)
        tokens = beam.tokens + ([beam.eos] if beam.eos is not None and
                                self.prepared.beam.include_stop else [])
        text = self.backend.tokenizer.decode(tokens, self.params.skip_special_tokens)
        first = self.first
        return StreamChunk(
            request_id=self.request_id, token_ids=tokens, text=text, finished=True,
            finish_reason="stop" if beam.eos is not None else "length",
            num_prompt_tokens=first.num_prompt_tokens if first else len(self.prompt),
            num_cached_tokens=first.num_cached_tokens if first else 0,
            path=first.path if first else None, queue_s=first.queue_s if first else None)


class _StepError(Exception):
    def __init__(self, chunk: StreamChunk):
        super().__init__(chunk.error)
        self.chunk = chunk

