"""Structured outputs in the engine: one llguidance matcher per constrained request, and before
each sample the tokens its grammar does not allow next masked out of that request's logits row.

A matcher's state is a function of the request's output tokens alone: it consumes whatever
tokens the request has that it has not seen yet, just before the next mask is computed (a
prefill worker's first token, a lost worker's resumed tokens and this engine's own samples
alike), so every path computes the same masks and so samples the same tokens. Once the grammar
is complete only EOS is allowed, and that EOS ends the request (under ignore_eos too). A
reasoning model's row (the spec's `think`) is left free until its think block's end tag, found
by token id in its output (gpt-oss's: the final channel's header); the matcher takes what
follows.
Speculative decoding proposes no drafts for such a request (engine.py).
"""

from __future__ import annotations

import functools
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
    # A reasoning model's (the spec's `think`): the row is left free until the output holds the
    # think block's end tag (these token ids), and the matcher takes what follows it.
    end_ids: tuple = ()
    open_id: Optional[int] = None  # "optional": the first token may open the block instead
    searched: int = 0  # output tokens looked through for the end tag
    # gpt-oss's (think "harmony"): (`<|channel|>final`'s ids, `<|message|>`'s id, the ids no
    # header passes); the end is the first <|message|> after the former (within a bound).
    harmony: Optional[tuple] = None


class GrammarMasks:
    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width
        self._ll_tokenizer = None      # built at the first constrained request (~ms to ~1 s)
        self._executor = None          # llguidance's thread pool for a batch's masks

    def start(self, params: SamplingParams) -> Optional[GrammarState]:
        """The state of a new request (None when its output is unconstrained)."""
        if params.structured_outputs is None:
            return None
        import llguidance

        spec = params.structured_outputs
        grammar = structured.compile_grammar(spec)
        matcher = structured.on_big_stack(functools.partial(
            llguidance.LLMatcher, self._tokenizer_for_grammars(), grammar, log_level=0))
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs cannot be enforced with this model's "
                                      f"tokenizer: {matcher.get_error()}",
                                      param="structured_outputs")
        think = spec.get(structured.THINK)
        if think is None:
            return GrammarState(matcher)
        if think == "harmony":
            header = structured.harmony_answer_ids(self._tokenizer)
            if header is None:
                raise InvalidRequestError("a structured output for a harmony-format model needs "
                                          "<|channel|>, <|message|>, <|start|> and <|end|> to be "
                                          "tokens of its tokenizer's own",
                                          param="response_format")
            return GrammarState(matcher, end_ids=header[0], harmony=header)
        tags = structured.think_tag_ids(self._tokenizer)
        if tags is None:
            raise InvalidRequestError("structured_outputs.think needs <think> and </think> to "
                                      "be tokens of this model's own", param="structured_outputs")
        return GrammarState(matcher, end_ids=(tags[1],),
                            open_id=tags[0] if think == "optional" else None)

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
        its row, for each (row, req) in `rows` (requests with a GrammarState). The masks are
        computed on the host in parallel (llguidance's executor); on a device, the packed
        bits (1/32 of the logits' size) are what is copied there and unpacked."""
        if not rows:
            return
        import llguidance
        import llguidance.numpy as llnp

        opening: set[int] = set()  # requests (ids) whose first token may open a think block
        rows = [(row, req) for row, req in rows if not _thinking(req, opening)]
        if not rows:
            return
        width = self._tokenizer_for_grammars().vocab_size
        bits = llnp.allocate_token_bitmask(len(rows), width)
        matchers = []
        for j, (_, req) in enumerate(rows):
            state: GrammarState = req.grammar
            new = req.output_token_ids[state.consumed:]
            if new and not state.matcher.consume_tokens(new):
                log.warning("request %s: its output left its grammar (%s); only EOS is allowed "
                            "from here", req.request_id,
                            state.matcher.get_error().splitlines()[0])
            state.consumed = len(req.output_token_ids)
            matchers.append((state.matcher, j))  # one in an error state allows EOS alone
        if len(matchers) == 1:
            llnp.fill_next_token_bitmask(matchers[0][0], bits, 0)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            llnp.fill_next_token_bitmask_par(self._executor, matchers, bits)
        words = bits.view(np.uint32)
        for j, (_, req) in enumerate(rows):
            if id(req) in opening:
                token = req.grammar.open_id
                words[j, token // 32] |= np.uint32(1 << (token % 32))
        vocab = logits.shape[1]
        ruled_out = ruled_out_of(bits, logits.device, logits.device.type == "cpu")[:, :vocab]
        if ruled_out.shape[1] < vocab:  # logits wider than the tokenizer: those ids never fit
            ruled_out = torch.nn.functional.pad(ruled_out, (0, vocab - ruled_out.shape[1]),
                                                value=True)
        if len(rows) < logits.shape[0]:  # other rows stay as they are
            index = torch.tensor([row for row, _ in rows], dtype=torch.long,
                                 device=logits.device)
            full = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            full[index] = ruled_out
            ruled_out = full
        with torch.inference_mode():  # the runner's logits are inference tensors
            logits.masked_fill_(ruled_out, float("-inf"))


def _thinking(req, opening: set) -> bool:
    """Whether request `req`'s row is left free this step: a reasoning model still in its
    think block. Decided from its output tokens alone (any worker decides the same): the
    block ends with its end tag's ids, and the matcher takes the tokens after it; under
    "optional", a first token other than the block's start is the answer's (and the first
    token's mask is the grammar's plus that start, noted in `opening`)."""
    state: GrammarState = req.grammar
    if not state.end_ids:
        return False
    out = req.output_token_ids
    if state.open_id is not None:  # the block is optional: is there one?
        if not out:
            opening.add(id(req))
            return False
        if out[0] != state.open_id:  # the answer started at once
            state.end_ids = ()
            return False
    n = len(state.end_ids)
    if state.harmony is not None:  # gpt-oss: `<|channel|>final`, its header's end
        return _harmony_header_open(state, out)
    for at in range(max(0, state.searched - n + 1), len(out) - n + 1):
        if tuple(out[at:at + n]) == state.end_ids:
            state.end_ids = ()
            state.consumed = state.searched = at + n
            return False
    state.searched = len(out)
    return True


def _harmony_header_open(state: GrammarState, out: list) -> bool:
    """Whether a harmony output has yet to finish its final channel's header: its
    `<|channel|>final` tokens, then (` <|constrain|>json` or nothing between) the first
    `<|message|>` within HARMONY_HEADER_TOKENS, before any <|end|> or <|start|>."""
    final, message, stops = state.harmony
    n = len(final)
    for at in range(max(0, state.searched - structured.HARMONY_HEADER_TOKENS - n),
                    len(out) - n + 1):
        if tuple(out[at:at + n]) != final:
            continue
        for end in range(at + n, min(len(out), at + n + structured.HARMONY_HEADER_TOKENS)):
            if out[end] in stops:
                break
            if out[end] == message:
                state.end_ids = ()
                state.consumed = state.searched = end + 1
                return False
    state.searched = len(out)
    return True


def ruled_out_of(bits: np.ndarray, device: torch.device, on_host: bool) -> torch.Tensor:
    """llguidance's packed masks (int32 words, bit i of word w for token 32w + i; set:
    allowed) -> a bool tensor on `device`, true for the tokens ruled out. Unpacked on the host
    (numpy) or, for a device, copied packed and unpacked there (1/32 of the bytes moved)."""
    if on_host:
        out = torch.from_numpy(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little") == 0)
        return out if torch.device(device).type == "cpu" else out.to(device)
    packed = torch.from_numpy(bits).to(device)
    shifts = torch.arange(32, dtype=torch.int32, device=device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1) == 0

