"""Turns logits into next tokens: logit bias and repetition penalties, then greedy, temperature,
top-k, top-p, min-p, seeds, logprobs.

A seeded request draws its noise from its own generator, one draw per sampled token, and every
adjustment is computed row by row, so its tokens do not depend on what else shares the batch
(or on preemption and recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pd_runtime.engine.sampling_params import SamplingParams

# Per row: (prompt token ids, generated token ids so far).
History = tuple[list[int], list[int]]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the sampled token, {token: logprob} of the top-n), or None.
    logprobs: list[Optional[tuple[float, dict[int, float]]]]


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def make_generator(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    @staticmethod
    def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
        """Advance a seeded generator past one sample drawn elsewhere (a remote prefill's first
        token), so the rest of the stream matches a colocated run."""
        torch.empty(vocab_size).exponential_(generator=generator)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[Optional[torch.Generator]],
                 histories: Optional[list[History]] = None) -> SampleResult:
        rows, vocab = logits.shape
        want_logprobs = [p.logprobs is not None for p in params]
        # Logprobs are those of the model's raw logits, before bias, penalties and temperature:
        # what vLLM reports by default (logprobs_mode "raw_logprobs").
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self.adjust_logits(logits, params, histories)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = torch.tensor(random_rows)
            probs = self._filtered_probs(logits[idx], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                noise[j].exponential_(generator=generators[i] or self.generator)
            # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
            tokens[idx] = (probs / noise).argmax(dim=-1)
        token_list = tokens.tolist()
        logprobs: list = [None] * rows
        for i, p in enumerate(params):
            if p.logprobs is None:
                continue
            row = raw_logprobs[i]
            top = {}
            if p.logprobs > 0:
                values, ids = row.topk(p.logprobs)
                top = dict(zip(ids.tolist(), values.tolist()))
            logprobs[i] = (row[token_list[i]].item(), top)
        return SampleResult(token_list, logprobs)

    @staticmethod
    def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                      histories: Optional[list[History]]) -> torch.Tensor:
        """The logits to choose from: each row with its logit bias, then its repetition,
        frequency and presence penalties (vLLM's order). `logits` itself is left unchanged; with
        nothing to adjust it is returned as it is, at no cost."""
        adjusted_rows = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not adjusted_rows:
            return logits
        out = logits.clone()
        for i in adjusted_rows:
            p = params[i]
            if histories is None and (p.presence_penalty or p.frequency_penalty
                                      or p.repetition_penalty != 1.0):
                raise ValueError("repetition penalties need the token histories")
            prompt_ids, output_ids = histories[i] if histories is not None else ((), ())
            _adjust_row(out[i], p, prompt_ids, output_ids)
        return out

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
            ranks = torch.arange(vocab)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before > torch.tensor(top_p, dtype=logits.dtype)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, dtype=probs.dtype)[:, None] * probs.max(dim=-1,
                                                                               keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs


def _adjust_row(row: torch.Tensor, p: SamplingParams, prompt_ids, output_ids) -> None:
    """In place on one row: its result depends on nothing but the row and its own history."""
    vocab = row.shape[0]
    if p.logit_bias:
        # The router refuses ids past the vocabulary; one that slips through (a model whose
        # logits are narrower than its tokenizer) is skipped rather than failing the step.
        biased = [(t, b) for t, b in p.logit_bias.items() if t < vocab]
        if biased:
            ids, values = zip(*biased)
            row[torch.tensor(ids)] += torch.tensor(values, dtype=row.dtype)
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(list(prompt_ids) + list(output_ids), dtype=torch.long)] = True
        penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        row.copy_(torch.where(seen, penalized, row))
    if (p.frequency_penalty or p.presence_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long),
                                minlength=vocab)[:vocab].to(row.dtype)
        row -= counts * p.frequency_penalty + (counts > 0).to(row.dtype) * p.presence_penalty
