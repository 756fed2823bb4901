"""A request's output (RequestOutput), one shape for the engine and the offline LLM: what a
step gives each request that progressed, with the stop-string cut and the merge of several
tokens kept in one step (speculation); and, gathered, vLLM's offline result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pd_runtime.engine.sequence import Request


@dataclass
class Logprob:
    """A token's log-probability, as vLLM's Logprob: with its rank (1: the likeliest, under the
    model's raw logits) and its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# Per position: the token there first, then the top-n, by token id (vLLM's SampleLogprobs).
Logprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence, as vLLM's CompletionOutput."""

    index: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    # One entry per generated token when logprobs were asked.
    logprobs: Optional[Logprobs] = None
    # The stop string or stop token that ended it; None for EOS or a length limit (as vLLM's).
    stop_reason: Union[int, str, None] = None

    @property
    def cumulative_logprob(self) -> Optional[float]:
        """The sum of the generated tokens' logprobs (None when logprobs were not asked)."""
        if self.logprobs is None:
            return None
        return sum(entry[token].logprob for token, entry in zip(self.token_ids, self.logprobs))


@dataclass
class RequestOutput:
    """A request's output. The engine gives one per step (`LLMEngine.step`): what the step
    added (`new_token_ids`, `new_text`, `new_logprobs`) and the request so far (`token_ids`,
    `text`). The offline LLM returns one per prompt, as vLLM's RequestOutput: `prompt`,
    `outputs` (a CompletionOutput per sequence), `prompt_logprobs` as Logprob dicts; there
    `text`, `token_ids`, `finish_reason` and `stop_reason` are its first output's, and
    `logprobs` reads the first output's (the new_ fields stay empty)."""

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: Optional[str] = None
    # What stopped a finished request, as vLLM reports it: the stop string it matched, or the
    # token of stop_token_ids it sampled; None for EOS, a length limit or an abort.
    stop_reason: Union[int, str, None] = None
    # Per new token: (logprob of the token, {token_id: logprob} of the top-n, the token's
    # rank); None if not asked.
    new_logprobs: Optional[list[tuple[float, dict[int, float], int]]] = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    queue_s: Optional[float] = None  # arrival to first scheduled; on the final output only
    # The engine's: on the first output of a request that asked for them
    # (prompt_logprobs.PromptLogprobs); the offline result's: per prompt position (None for
    # the first, which nothing precedes), as `logprobs` is per generated token.
    prompt_logprobs: Optional[list] = None
    # -- the offline result's -----------------------------------------------------------------
    prompt: Optional[str] = None  # the prompt as given, when it was text
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def logprobs(self) -> Optional[Logprobs]:
        return self.outputs[0].logprobs if self.outputs else None


def apply_stop_strings(req: Request, text_before: int) -> Optional[str]:
    """Cut the text before the first stop string that the new text completed (after it, with
    include_stop_str_in_output); returns that string (None when none was completed)."""
    longest = max(len(s) for s in req.params.stop)
    window_start = max(0, text_before - longest + 1)
    best = None
    for stop in req.params.stop:
        pos = req.text.find(stop, window_start)
        if pos != -1 and (best is None or pos < best[0]):
            best = (pos, stop)
    if best is None:
        return None
    pos, stop = best
    req.text = req.text[:pos + len(stop)] if req.params.include_stop_str_in_output \
        else req.text[:pos]
    return stop


def merged(first: Optional[RequestOutput], then: RequestOutput) -> RequestOutput:
    """One output of a request per step: a verification can add several tokens."""
    if first is None:
        return then
    logprobs = None
    if first.new_logprobs is not None or then.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (then.new_logprobs or [])
    then.new_token_ids = first.new_token_ids + then.new_token_ids
    then.new_text = first.new_text + then.new_text
    then.new_logprobs = logprobs
    return then
