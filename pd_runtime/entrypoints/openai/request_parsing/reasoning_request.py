"""A reasoning model's chat request, before it runs: how its output will be split into thinking
and answer (PreparedRequest.reasoning, which pd_runtime/parsers/registry.py turns into the
splitter of each choice), and what that format needs of the sampling parameters (a grammar
that leaves the thinking free, special tokens kept for harmony's markers).
"""

from __future__ import annotations

from typing import Union

from pd_runtime import structured
from pd_runtime.entrypoints.openai.request_parsing.schema import InvalidRequest
from pd_runtime.entrypoints.openai.request_parsing.structured_fields import structured_spec
from pd_runtime.parsers.reasoning import CLOSE, opens_in_prompt


def prepare(prompt: str, params: dict, tokenizer, extra: dict) -> Union[bool, str, None]:
    """How a chat request's output is split (PreparedRequest.reasoning) for the model's
    reasoning format: None (not split), whether the prompt left a think block open, or
    "harmony" (gpt-oss's channels, pd_runtime/parsers/harmony.py). Sets what the format needs
    in the request's sampling `params`; `extra`: the body's fields beyond the schema's."""
    fmt = getattr(tokenizer, "reasoning_format", None)
    if fmt == "harmony":
        if "structured_outputs" in params:
            if structured_spec(extra)[1] is None:  # a required or named tool choice's
                raise InvalidRequest("tool_choice: a required or named tool choice is not "
                                     "supported for a model that answers in harmony's "
                                     "channels (gpt-oss) yet; its calls come with auto",
                                     param="tool_choice", code="unsupported_parameter")
            # The grammar holds the final channel's message (the answer), from the token after
            # its header on; the thinking before it is free.
            params["structured_outputs"] = {**params["structured_outputs"],
                                            structured.THINK: "harmony"}
        params["skip_special_tokens"] = False  # its markers are special tokens
        return "harmony"
    if not fmt:
        return None
    thinking = opens_in_prompt(prompt)
    if "structured_outputs" in params and not prompt.rstrip().endswith(CLOSE):
        if structured.think_tag_ids(tokenizer) is None:
            return None  # tags spelled in several tokens: the grammar holds all of it, unsplit
        # A grammar holds the answer after the thinking (from the first token where the
        # prompt closed an empty block: Qwen3 without thinking answers at once).
        params["structured_outputs"] = {**params["structured_outputs"],
                                        structured.THINK: "open" if thinking else "optional"}
    return thinking
