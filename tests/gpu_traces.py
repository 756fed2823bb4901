"""Comparing generated sequences across runs whose bits differ (bf16 on a GPU: GEMM shapes
depend on the batch), as vLLM's tests do: equal token for token, with matching logprobs, up to a
first difference that must be a near tie. tests/test_gpu.py uses them on the device; their own
tests run everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Where transformers' float32 router has the last expert it picks within this many logits of
# the first it passes over, a bf16 run may route otherwise (measured on CPU for the device
# tests' tiny MoE models: bf16 moves router logits by 0.003 at the median, 0.02 at p99).
ROUTER_TIE = 0.02
# ... and the most an excused step may differ by (the device run's ties: 0.16-0.27 nats); a
# fault at a tie moves it further.
EXCUSED_MOST = 1.0


@dataclass
class Trace:
    """One generated sequence: its tokens, each one's logprob, and the top-n at each step."""

    tokens: list[int]
    logprobs: list[float]
    top: list[dict[int, float]]


def compare_traces(a: list[Trace], b: list[Trace], tol: float, min_shared: float,
                   tie_at_divergence: bool = True,
                   excuse: Optional[Callable[[int, int], bool]] = None,
                   excused: Optional[list[str]] = None,
                   detail: Optional[Callable[[int, int], str]] = None) -> list[str]:
    """Problems found (none: the runs agree). Per sequence, before the first differing token
    each token's logprob must agree within `tol` nats (a broken kernel moves them far more);
    at that token, for greedy runs (`tie_at_divergence`), the other run's token must be in this
    run's top-n within `tol` of the chosen one, or the other way round. Over all sequences at
    least `min_shared` of the tokens come before any difference: a broken path parts early.
    `excuse(sequence, step)` true (a mixture of experts' router tie, router_margins): a
    difference there of at most EXCUSED_MOST, in the token's logprob or between the two runs'
    tokens, goes to `excused` instead, and the sequence is compared no further (from that step
    on the runs hold other KV, as after a parting at a near tie); it counts as shared up to
    there. `detail(sequence, step)` is appended to such a step's message."""
    problems, shared, total = [], 0, 0
    excused = [] if excused is None else excused
    suffix = (lambda i, t: detail(i, t)) if detail else (lambda i, t: "")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        n = min(len(x.tokens), len(y.tokens))
        total += max(len(x.tokens), len(y.tokens))
        first = next((t for t in range(n) if x.tokens[t] != y.tokens[t]), n)
        end = first  # where this sequence stops being compared
        for t in range(first):
            gap = abs(x.logprobs[t] - y.logprobs[t])
            if gap > tol:
                found = (f"sequence {i} step {t}: token {x.tokens[t]} has logprob "
                         f"{x.logprobs[t]:.3f} in one run, {y.logprobs[t]:.3f} in the other"
                         + suffix(i, t))
                excusable = excuse is not None and excuse(i, t) and gap <= EXCUSED_MOST
                (excused if excusable else problems).append(found)
                end = t
                break
        shared += end
        if end == first < n and tie_at_divergence and not (_near_tie(x, y, first, tol)
                                                           or _near_tie(y, x, first, tol)):
            found = (f"sequence {i} parts at step {first} ({x.tokens[first]} vs "
                     f"{y.tokens[first]}) where no run has the two within {tol} nats")
            excusable = excuse is not None and excuse(i, first) and (
                _near_tie(x, y, first, EXCUSED_MOST) or _near_tie(y, x, first, EXCUSED_MOST))
            (excused if excusable else problems).append(found + suffix(i, first))
        if end == first == n and len(x.tokens) != len(y.tokens):
            problems.append(f"sequence {i}: {len(x.tokens)} tokens vs {len(y.tokens)}")
    if shared < min_shared * total:
        problems.append(f"only {shared} of {total} tokens before the runs part "
                        f"(at least {min_shared:.0%} expected)")
    return problems


def _near_tie(x: Trace, y: Trace, t: int, tol: float) -> bool:
    other = x.top[t].get(y.tokens[t])
    return other is not None and x.logprobs[t] - other <= tol


def ours_traces(outs) -> list[Trace]:
    return [Trace(list(o.token_ids), [e[t].logprob for t, e in zip(o.token_ids, o.logprobs)],
                  [{t: lp.logprob for t, lp in e.items()} for e in o.logprobs])
            for o in outs]


def logits_traces(tokens: list[list[int]], logits: list[torch.Tensor], top_n: int = 5):
    """Traces from per-step logits `[steps, vocab]` of each sequence (transformers' scores)."""
    traces = []
    for seq, steps in zip(tokens, logits):
        lps = torch.log_softmax(steps.float(), dim=-1)
        values, ids = lps.topk(top_n, dim=-1)
        traces.append(Trace(list(seq), [lps[t, tok].item() for t, tok in enumerate(seq)],
                            [dict(zip(i.tolist(), v.tolist())) for v, i in zip(values, ids)]))
    return traces


def router_margins(hf, prompts: list[list[int]], tokens: list[list[int]],
                   prompt_min: Optional[list[float]] = None) -> list[list[float]]:
    """Per sequence and generated step: the smallest gap, over the layers, between the last
    expert transformers' router picks and the first it passes over, at the position whose
    logits chose that step's token (one forward pass of prompt and tokens, router logits out).
    Router logits order the experts as their softmax does (Mixtral) or are what top-k reads
    (gpt-oss), so the gap is in logits either way. `prompt_min` (a list) gets each sequence's
    smallest margin over the prompt's earlier positions (a tie there moves every step)."""
    k = hf.config.num_experts_per_tok
    margins = []
    device = next(hf.parameters()).device
    with torch.inference_mode():
        for prompt, seq in zip(prompts, tokens):
            ids = torch.tensor([prompt + seq[:-1]], device=device)
            out = hf(ids, output_router_logits=True)
            gaps = []
            for logits in out.router_logits:
                top = logits.reshape(-1, logits.shape[-1]).float().topk(k + 1, dim=-1).values
                gaps.append(top[:, k - 1] - top[:, k])
            per_position = torch.stack(gaps).amin(0)
            margins.append(per_position[len(prompt) - 1:].tolist())
            if prompt_min is not None:
                earlier = per_position[:len(prompt) - 1]
                prompt_min.append(earlier.min().item() if earlier.numel() else float("inf"))
    return margins
