"""What a step gives each request that progressed: its new tokens and text (RequestOutput),
with the stop-string cut and the merge of several tokens kept in one step (speculation)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from pd_runtime.engine.sequence import Request


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
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
    # On the first output of a request that asked for them (prompt_logprobs.PromptLogprobs).
    prompt_logprobs: Optional[list] = None


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
