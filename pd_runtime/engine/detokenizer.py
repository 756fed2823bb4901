"""Incremental detokenization: emits text only once its bytes form whole characters.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character; the decoded tail then ends
in U+FFFD, and we wait for the next token instead of emitting half a character.
"""

from __future__ import annotations

from pd_runtime.engine.sequence import Request
from pd_runtime.tokenizer import Tokenizer


def detokenize_step(tok: Tokenizer, req: Request, flush: bool = False,
                    drop_last: bool = False) -> str:
    """Append the text of new output tokens to `req.text`; returns the delta. `drop_last`: the
    last token ended the request as a stop token, whose text is left out (as vLLM does).

    Decodes the window [prefix_offset, end) and subtracts the text of [prefix_offset,
    read_offset), both starting at a token where earlier text ended cleanly.
    """
    ids = req.output_token_ids[:-1] if drop_last else req.output_token_ids
    skip = req.params.skip_special_tokens
    prefix = tok.decode(ids[req.prefix_offset:req.read_offset], skip)
    full = tok.decode(ids[req.prefix_offset:], skip)
    # A UTF-8 character spans at most 4 bytes; a longer unfinished tail is simply invalid bytes.
    if full.endswith("\ufffd") and not flush and len(ids) - req.read_offset < 4:
        return ""
    delta = full[len(prefix):]
    req.prefix_offset = req.read_offset
    req.read_offset = len(ids)
    req.text += delta
    return delta
