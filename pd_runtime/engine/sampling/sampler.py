"""Turns logits into next tokens: logit bias, allowed and banned tokens and repetition penalties,
then greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

A seeded request draws its noise from its own generator, one draw per sampled token, and every
adjustment is computed row by row, so its tokens do not depend on what else shares the batch
(or on preemption and recompute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from pd_runtime.api import SamplingParams

# Per row: (prompt token ids, generated token ids so far).
History = tuple[list[int], list[int]]


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: (logprob of the sampled token, {token: logprob} of the top-n, the sampled
    # token's rank: how many tokens were at least as likely, as vLLM counts it), or None.
    logprobs: list[Optional[tuple[float, dict[int, float], int]]]
    # Row -> its generator's state right after that row's draw, for the rows asked for
    # (speculative decoding puts a seeded request's generator back to its last kept token).
    generator_states: Optional[dict] = None


class Sampler:
    """Works on the logits' device; the one device-to-host copy of a step is the packed result
    (token ids, and the logprobs when a row asks for them): see `sample_on_device`."""

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu",
                 eos_token_ids: frozenset[int] = frozenset()):
        self.device = torch.device(device)
        self.eos_token_ids = eos_token_ids  # what min_tokens holds back, with stop_token_ids
        # None on a device without generators (`meta`, where the tests place a step): its
        # draws then use the device's default one.
        self.generator = torch.Generator(self.device).manual_seed(seed) \
            if self.device.type != "meta" else None
        # The distinct ids of each prompt under a repetition penalty, kept while its request
        # keeps being sampled: converting a long prompt every step costs milliseconds.
        self._prompt_ids: dict[int, tuple[list[int], torch.Tensor]] = {}
        # Likewise each allowed_token_ids' set and vocabulary mask: (params, set, mask).
        self._allowed: dict[int, tuple] = {}

    @staticmethod
    def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
        return torch.Generator(device).manual_seed(seed)

    @staticmethod
    def skip_draw(generator: torch.Generator, vocab_size: int) -> None:
        """Advance a seeded generator past one sample drawn elsewhere (a remote prefill's first
        token), so the rest of the stream matches a colocated run."""
        torch.empty(vocab_size, device=generator.device).exponential_(generator=generator)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[Optional[torch.Generator]],
                 histories: Optional[list[History]] = None,
                 keep_states: Optional[set[int]] = None) -> SampleResult:
        """keep_states: rows whose generator's state after their draw to return."""
        states = {} if keep_states else None
        packed = self.sample_on_device(logits, params, generators, histories, keep_states,
                                       states)
        result = self.unpack(packed.cpu() if packed.device.type != "cpu" else packed, params)
        result.generator_states = states
        return result

    def sample_on_device(self, logits: torch.Tensor, params: list[SamplingParams],
                         generators: list[Optional[torch.Generator]],
                         histories: Optional[list[History]] = None,
                         keep_states: Optional[set[int]] = None,
                         states: Optional[dict] = None) -> torch.Tensor:
        """Everything on the logits' device, into one float64 tensor (`unpack` reads it): the
        sampled ids, then for the rows asking for logprobs the sampled token's logprob and rank
        and the top-n (values, ids), n the largest asked. float64 holds ids and float32 logprobs
        exactly, so one copy brings the whole result to the host."""
        rows, vocab = logits.shape
        device = logits.device
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        # Logprobs are those of the model's raw logits, before bias, penalties and temperature:
        # what vLLM reports by default (logprobs_mode "raw_logprobs").
        raw_logprobs = torch.log_softmax(logits[_long(want, device)], dim=-1) if want else None
        if raw_logprobs is not None:
            # A token a grammar rules out has -inf; -9999 (as vLLM reports it) stays valid JSON.
            raw_logprobs = raw_logprobs.clamp(min=-9999.0)
        logits = self.adjust_logits(logits, params, histories)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            idx = _long(random_rows, device)
            probs = self._filtered_probs(logits[idx], [params[i] for i in random_rows])
            noise = torch.empty_like(probs)
            for j, i in enumerate(random_rows):
                generator = generators[i] or self.generator
                if generator is not None and generator.device.type != device.type:
                    raise ValueError(f"a generator on {generator.device} cannot draw the "
                                     f"noise of logits on {device}")
                noise[j].exponential_(generator=generator)
                if keep_states and i in keep_states and generator is not None:
                    states[i] = generator.get_state()
            # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
            tokens[idx] = (probs / noise).argmax(dim=-1)
        parts = [tokens.double()]
        if want:
            chosen = raw_logprobs.gather(1, tokens[_long(want, device)][:, None])
            ranks = (raw_logprobs >= chosen).sum(dim=-1)  # as vLLM ranks ties: last
            parts += [chosen.double().view(-1), ranks.double()]
            top_n = min(max(params[i].logprobs for i in want), vocab)
            if top_n:
                values, ids = raw_logprobs.topk(top_n, dim=-1)
                parts += [values.double().reshape(-1), ids.double().reshape(-1)]
        return torch.cat(parts)

    @staticmethod
    def unpack(packed: torch.Tensor, params: list[SamplingParams]) -> SampleResult:
        """The host side of `sample_on_device`'s result."""
        rows = len(params)
        flat = packed.tolist()
        token_list = [int(t) for t in flat[:rows]]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs: list = [None] * rows
        if want:
            w = len(want)
            chosen, ranks = flat[rows:rows + w], flat[rows + w:rows + 2 * w]
            top_n = (len(flat) - rows - 2 * w) // (2 * w)
            values = flat[rows + 2 * w:rows + w * (2 + top_n)]
            ids = flat[rows + w * (2 + top_n):]
            for j, i in enumerate(want):
                n = min(params[i].logprobs, top_n)
                row_ids = ids[j * top_n:j * top_n + n]
                row_values = values[j * top_n:j * top_n + n]
                logprobs[i] = (chosen[j], {int(t): v for t, v in zip(row_ids, row_values)},
                               int(ranks[j]))
        return SampleResult(token_list, logprobs)

    def adjust_logits(self, logits: torch.Tensor, params: list[SamplingParams],
                      histories: Optional[list[History]]) -> torch.Tensor:
        """The logits to choose from: each row with its logit bias, its EOS and stop token ids
        ruled out while it has fewer than min_tokens, a bad word's last token wherever the
        output ends with the rest of it, every token but its allowed_token_ids, then its
        repetition, frequency and presence penalties (vLLM's order). `logits` itself is left unchanged; with nothing to
        adjust it is returned as it is, at no cost.

        Every operation is elementwise on gathered entries and scattered back to them, so an
        entry's value depends on its own row alone: batched or not, a row gets the same bits."""
        rows = [i for i, p in enumerate(params) if p.adjusts_logits]
        if not rows:
            return logits
        chosen = [params[i] for i in rows]
        if histories is None and any(p.presence_penalty or p.frequency_penalty or p.min_tokens
                                     or p.repetition_penalty != 1.0 or p.bad_words_token_ids
                                     for p in chosen):
            raise ValueError("repetition penalties and min_tokens need the token histories")
        out = logits.clone()
        index = _long(rows, out.device)
        sub = out[index]
        vocab = sub.shape[1]
        bias_rows, bias_ids, bias_values = [], [], []
        for j, p in enumerate(chosen):
            # The router refuses ids past the vocabulary; one that slips through (a model whose
            # logits are narrower than its tokenizer) is skipped rather than failing the step.
            for token, bias in (p.logit_bias or {}).items():
                if token < vocab:
                    bias_rows.append(j)
                    bias_ids.append(token)
                    bias_values.append(bias)
        if bias_rows:
            where = (_long(bias_rows, sub.device), _long(bias_ids, sub.device))
            sub[where] += torch.tensor(bias_values, dtype=sub.dtype, device=sub.device)
        banned_rows, banned_ids = [], []
        masks: dict[int, tuple] = {}
        allowed_rows, keep = [], []
        for j, p in enumerate(chosen):
            ids = set()
            if p.min_tokens and len(histories[rows[j]][1]) < p.min_tokens:
                # EOS even under ignore_eos, as vLLM holds it back (its all_stop_token_ids).
                ids = set(p.stop_token_ids) | self.eos_token_ids
            if p.bad_words_token_ids:
                ids |= _bad_word_ends(p.bad_words_token_ids, histories[rows[j]][1])
            if p.allowed_token_ids is not None:  # everything else ruled out
                allowed, mask = self._allowed_mask(p, vocab, sub.device, masks)
                allowed_rows.append(j)
                keep.append(mask)
                if ids and allowed <= ids:
                    # The bans would leave no token at all (a bad word's end the only allowed
                    # one left); they give way this step rather than sampling from nothing.
                    # The engine refuses a request where that holds from the first step.
                    ids = set()
            ids = [t for t in ids if t < vocab]
            banned_rows += [j] * len(ids)
            banned_ids += ids
        self._allowed = masks  # only the requests still being sampled stay
        if allowed_rows:
            where = _long(allowed_rows, sub.device)
            sub[where] = sub[where].masked_fill(~torch.stack(keep), -math.inf)
        if banned_rows:
            sub[_long(banned_rows, sub.device), _long(banned_ids, sub.device)] = -math.inf
        if histories is not None:
            self._penalize(sub, chosen, [histories[i] for i in rows])
        out[index] = sub
        return out

    def _penalize(self, sub: torch.Tensor, params: list[SamplingParams],
                  histories: list[History]) -> None:
        """Repetition penalty over prompt and output tokens, then frequency and presence over
        output tokens, in place on the rows of `sub`; the work is per history entry, not per
        vocabulary entry."""
        device = sub.device
        seen_rows, seen_ids, out_rows, out_ids = [], [], [], []
        prompts: dict[int, tuple[list[int], torch.Tensor]] = {}
        for j, (p, (prompt_ids, output_ids)) in enumerate(zip(params, histories)):
            if p.repetition_penalty != 1.0:
                ids = torch.cat([self._distinct_prompt_ids(prompt_ids, prompts),
                                 _long(output_ids)])
                seen_rows.append(torch.full((len(ids),), j, dtype=torch.long))
                seen_ids.append(ids)
            if p.frequency_penalty or p.presence_penalty:
                out_rows.extend([j] * len(output_ids))
                out_ids.extend(output_ids)
        self._prompt_ids = prompts  # only the prompts still being sampled stay
        if seen_rows:
            where = (torch.cat(seen_rows).to(device), torch.cat(seen_ids).to(device))
            penalty = torch.tensor([p.repetition_penalty for p in params],
                                   dtype=sub.dtype, device=device)[where[0]]
            values = sub[where]  # a token seen twice is written twice with the same value
            sub[where] = torch.where(values > 0, values / penalty, values * penalty)
        if out_rows:
            vocab = sub.shape[1]
            # On the host, where the histories are: a unique on the device would wait for it.
            places, counts = np.unique(np.array(out_rows, dtype=np.int64) * vocab
                                       + np.array(out_ids, dtype=np.int64), return_counts=True)
            places, counts = _long(places, device), _long(counts, device)
            rows = places // vocab
            frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype,
                                     device=device)
            presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype,
                                    device=device)
            where = (rows, places % vocab)
            sub[where] -= counts.to(sub.dtype) * frequency[rows] + presence[rows]

    def _allowed_mask(self, p: SamplingParams, vocab: int, device: torch.device,
                      into: dict) -> tuple[frozenset, torch.Tensor]:
        """A request's allowed_token_ids as a set and a vocabulary mask on the device, made
        once while it keeps being sampled (not every step)."""
        known = self._allowed.get(id(p))
        if known is None or known[0] is not p or known[2].shape[0] != vocab:
            ids = [t for t in p.allowed_token_ids if t < vocab]
            mask = torch.zeros(vocab, dtype=torch.bool)
            mask[_long(ids)] = True
            known = (p, frozenset(ids), mask.to(device))
        into[id(p)] = known
        return known[1], known[2]

    def _distinct_prompt_ids(self, prompt_ids: list[int], into: dict) -> torch.Tensor:
        key = id(prompt_ids)
        known = self._prompt_ids.get(key)
        # The same list object (a request's own prompt, never changed) is the same prompt.
        if known is None or known[0] is not prompt_ids:
            known = (prompt_ids, torch.unique(_long(prompt_ids)))
        into[key] = known
        return known[1]


    @staticmethod
    def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temps[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            vocab = logits.shape[-1]
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
            ranks = torch.arange(vocab, device=device)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= ks[:, None], float("-inf"))
            sorted_probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
            drop = mass_before > torch.tensor(top_p, dtype=logits.dtype, device=device)[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, dtype=probs.dtype, device=device)[:, None] \
                * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
        return probs


def _bad_word_ends(spellings: list[list[int]], output_ids: list[int]) -> set[int]:
    """The last token of each bad word's spelling whose other tokens end the output so far
    (a one-token word: always)."""
    ends = set()
    for ids in spellings:
        before = len(ids) - 1
        if before == 0 or (len(output_ids) >= before and output_ids[-before:] == ids[:-1]):
            ends.add(ids[-1])
    return ends


def _long(values: list[int], device: torch.device | None = None) -> torch.Tensor:
    # numpy converts a list of ints ~30x faster than torch.tensor does; then one copy to the
    # device when it is not the host.
    out = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return out if device is None or device.type == "cpu" else out.to(device)
