"""Structured outputs in the engine: one llguidance matcher per constrained request, and before
each sample the tokens its grammar does not allow next masked out of that request's logits row.

A matcher's state is a function of the request's output tokens alone: it consumes whatever
tokens the request has that it has not seen yet, just before the next mask is computed (a
prefill worker's first token, a lost worker's resumed tokens and this engine's own samples
alike), so every path computes the same masks and so samples the same tokens. Once the grammar
is complete only EOS is allowed, and that EOS ends the request (under ignore_eos too).
Speculative decoding proposes no drafts for such a request (engine.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pd_runtime import structured
from pd_runtime.api import InvalidRequestError, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class GrammarState:
    matcher: Any       # llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has seen


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width
        self._ll_tokenizer = None      # built at the first constrained request (~ms to ~1 s)

    def start(self, params: SamplingParams) -> Optional[GrammarState]:
        """The state of a new request (None when its output is unconstrained)."""
        if params.structured_outputs is None:
            return None
        import llguidance

        grammar = structured.compile_grammar(params.structured_outputs)
        matcher = llguidance.LLMatcher(self._tokenizer_for_grammars(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs cannot be enforced with this model's "
                                      f"tokenizer: {matcher.get_error()}",
                                      param="structured_outputs")
        return GrammarState(matcher)

    def _tokenizer_for_grammars(self):
        if self._ll_tokenizer is None:
            import llguidance

            tok = self._tokenizer
            eos = sorted(tok.eos_token_ids)
            if not eos:
                raise InvalidRequestError("structured outputs need an end-of-sequence token, and "
                                          "this model's tokenizer names none",
                                          param="structured_outputs")
            self._ll_tokenizer = llguidance.LLTokenizer(
                tok.files["tokenizer_json"], n_vocab=max(self._vocab_size, tok.vocab_size),
                eos_token=eos)
        return self._ll_tokenizer

    def mask(self, logits: torch.Tensor, rows: list[tuple[int, Any]]) -> None:
        """Rules out, in place, every token the grammar of request `req` does not allow next in
        its row, for each (row, req) in `rows` (requests with a GrammarState). One host-to-
        device copy of the packed masks per step."""
        if not rows:
            return
        import llguidance.numpy as llnp

        width = self._tokenizer_for_grammars().vocab_size
        bits = llnp.allocate_token_bitmask(len(rows), width)
        for j, (_, req) in enumerate(rows):
            state: GrammarState = req.grammar
            new = req.output_token_ids[state.consumed:]
            if new and not state.matcher.consume_tokens(new):
                log.warning("request %s: its output left its grammar (%s); only EOS is allowed "
                            "from here", req.request_id,
                            state.matcher.get_error().splitlines()[0])
            state.consumed = len(req.output_token_ids)
            # A matcher in an error state allows EOS alone: the request ends.
            llnp.fill_next_token_bitmask(state.matcher, bits, j)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")
        vocab = logits.shape[1]
        allowed = torch.from_numpy(allowed[:, :vocab].astype(bool))
        if allowed.shape[1] < vocab:  # logits wider than the tokenizer: those ids never fit
            allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
        index = torch.tensor([row for row, _ in rows], dtype=torch.long)
        if logits.device.type != "cpu":
            allowed, index = allowed.to(logits.device), index.to(logits.device)
        with torch.inference_mode():  # the runner's logits are inference tensors
            logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
