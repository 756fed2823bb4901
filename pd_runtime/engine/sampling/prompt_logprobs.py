"""Log-probabilities of a prompt's own tokens (completions with echo and logprobs: how
evaluation harnesses score a text), computed from the logits of the prompt's chunks.

A request that asks for them gets every row of its prefill chunks from the model runner, not
only the last; the logits at position p score prompt token p + 1, so entry 0 stays None (a
one-token prompt has only that entry). It is admitted with a cache salt of its own (no
prefix-cache hit: every position must be computed). The first output carries them.
"""

from __future__ import annotations

from typing import Optional

import torch

# Per prompt position: (logprob of the token there, {token id: logprob} of the top-n, the
# token's rank: how many were at least as likely), or None.
PromptLogprobs = list[Optional[tuple[float, dict[int, float], int]]]


def isolating_salt(cache_salt: Optional[str], request_id: str) -> str:
    """A cache salt no other request shares, so no prompt position is served from the cache."""
    return f"{cache_salt or ''}\x00prompt-logprobs\x00{request_id}"


def chunks_wanting_rows(scheduled: list, requests: dict) -> list:
    """The scheduled chunks (plan order) whose rows score prompt tokens: none once the request
    has output (its entries went out with the first; a recompute or a resumed request would
    only compute them again)."""
    return [s for s in scheduled
            if (req := requests[s.request_id]).prompt_logprobs is not None
            and not req.output_token_ids and s.start < req.num_prompt_tokens - 1]


def record(chunks: list, requests: dict, hidden: torch.Tensor, project) -> None:
    """`hidden`: every row of `chunks`, in order, before `project` (the vocabulary projection,
    applied a slice at a time). Writes each scored prompt token's entry."""
    row = 0
    for s in chunks:
        req = requests[s.request_id]
        # Position p scores token p + 1; only prompt tokens are scored here.
        scored = min(len(s.token_ids), req.num_prompt_tokens - 1 - s.start)
        for first in range(0, max(scored, 0), _SLICE_ROWS):
            count = min(_SLICE_ROWS, scored - first)
            _score(req, s.start + first, project(hidden[row + first:row + first + count]))
        row += len(s.token_ids)


# Rows projected and scored at once: a long chunk's logits over a large vocabulary (128k
# entries a row) would otherwise all be held together, past what the memory plan counts.
_SLICE_ROWS = 256


def _score(req, start: int, logits: torch.Tensor) -> None:
    """Entries for prompt positions start + 1 .. start + len(logits)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    n = len(logits)
    targets = torch.tensor(req.prompt_token_ids[start + 1:start + 1 + n], device=logprobs.device)
    picked = logprobs.gather(1, targets[:, None])
    chosen = picked.view(-1).tolist()
    # How many tokens the model found at least as likely (vLLM's rank of a prompt token, ties
    # counted against it): one more pass over the rows, as cheap as the log_softmax before it.
    ranks = (logprobs >= picked).sum(dim=-1).tolist()
    top_n = req.params.prompt_logprobs
    tops: list[dict[int, float]] = [{} for _ in range(n)]
    if top_n:
        values, ids = logprobs.topk(top_n, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    for j in range(n):
        req.prompt_logprobs[start + 1 + j] = (chosen[j], tops[j], ranks[j])
