"""What the chaos load sends: request specs (token-id prompts, short or long, greedy or seeded)
and their fault-free reference from the offline engine with the same model and dtype.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class RequestSpec:
    label: str            # unique in a run, e.g. "decode-kill-mid_stream/long-3"
    prompt: tuple[int, ...]
    kind: str             # short (colocated) | long (disaggregated)
    params: tuple         # sorted (name, value) pairs of the sampling fields

    def body(self, model: str) -> dict:
        """The streamed /v1/completions body; logprobs=0 gives one token string per token."""
        return {"model": model, "prompt": list(self.prompt), "stream": True, "logprobs": 0,
                **dict(self.params)}


@dataclass(frozen=True)
class Expected:
    """The reference output: token ids, their strings as the API shows them, their logprobs."""
    token_ids: tuple[int, ...]
    tokens: tuple[str, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str


@dataclass
class Shapes:
    """Prompt and output sizes; long prompts must exceed the router's
    max_local_prefill_tokens so that they are disaggregated."""
    short_tokens: tuple[int, int] = (8, 40)
    long_tokens: tuple[int, int] = (96, 200)
    max_tokens: tuple[int, int] = (16, 32)
    seeded_fraction: float = 0.5


@dataclass
class SpecFactory:
    """Deterministic specs from one seed; every prompt is fresh (a cached prefix would route
    a long prompt colocated, and the point of a long prompt is the disaggregated path)."""
    vocab_size: int
    seed: int
    shapes: Shapes = field(default_factory=Shapes)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def make(self, label: str, kind: str, max_tokens: Optional[int] = None) -> RequestSpec:
        rng = self.rng
        lo, hi = self.shapes.short_tokens if kind == "short" else self.shapes.long_tokens
        prompt = tuple(rng.randrange(5, self.vocab_size) for _ in range(rng.randint(lo, hi)))
        out = max_tokens or rng.randint(*self.shapes.max_tokens)
        params = {"max_tokens": out, "ignore_eos": True}
        if rng.random() < self.shapes.seeded_fraction:
            params.update(temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
        else:
            params.update(temperature=0.0)
        return RequestSpec(label, prompt, kind, tuple(sorted(params.items())))


def vocab_size(model_dir: str) -> int:
    return json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]


def references(model_dir: str, dtype: str, specs: list[RequestSpec], alone: bool = False,
               **engine_args) -> dict[str, Expected]:
    """Fault-free outputs of the offline engine. `alone`: one request at a time, for dtypes
    whose outputs still depend on the batch; otherwise one batch for all."""
    from pd_runtime import LLM, SamplingParams

    llm = LLM(model_dir, dtype=dtype, **engine_args)
    text_of = token_texts(llm.tokenizer)
    params = [SamplingParams(**dict(s.params), logprobs=0) for s in specs]
    prompts = [list(s.prompt) for s in specs]
    if alone:
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    return {s.label: Expected(tuple(o.token_ids), tuple(text_of(t) for t in o.token_ids),
                              tuple(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)),
                              o.text, o.finish_reason)
            for s, o in zip(specs, outs)}


def token_texts(tokenizer):
    """token id -> the string the API reports for it (special tokens included)."""
    cache: dict[int, str] = {}

    def text(token: int) -> str:
        if token not in cache:
            cache[token] = tokenizer.decode([token], skip_special_tokens=False)
        return cache[token]

    return text


def ambiguous_token_strings(model_dir: str) -> set[str]:
    """Strings that more than one token id decodes to (e.g. partial UTF-8 bytes as U+FFFD):
    at those positions the string alone does not pin the id, so the logprob is compared too."""
    from pd_runtime.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    seen: dict[str, int] = {}
    for token in range(tok.vocab_size):
        s = tok.decode([token], skip_special_tokens=False)
        seen[s] = seen.get(s, 0) + 1
    return {s for s, n in seen.items() if n > 1}
