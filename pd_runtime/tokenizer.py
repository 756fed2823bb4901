"""Tokenizer of an HF model directory via `tokenizers` (torch-free), with its chat template.

Part of the router <-> worker contract: the router tokenizes prompts and detokenizes logprob
tokens exactly as the workers do, from the files a worker hands over in its model card
(`Tokenizer.files`, `api.ModelCard`), so the router needs no model directory of its own.
Token ids the tokenizer does not know (padded embedding rows, as in Qwen) decode to nothing.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional, Union

from tokenizers import Tokenizer as HFTokenizer

from pd_runtime.api import ModelLoadError
from pd_runtime.chat_template import ChatTemplate, reasoning_format, tool_call_format

log = logging.getLogger(__name__)


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


def read_tokenizer_files(model_dir: Union[str, Path]) -> dict:
    """What a tokenizer is made of, as plain data (msgpack/pickle-friendly): the fast
    tokenizer file, tokenizer_config.json's special tokens, the chat template (a
    chat_template.jinja first, as transformers reads it) and generation_config's EOS ids."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a fast tokenizer file is required)")
    tcfg = _json_file(model_dir / "tokenizer_config.json")
    special = _json_file(model_dir / "special_tokens_map.json")
    tokens = {name: _token_text(tcfg.get(name, special.get(name))) for name in _SPECIAL_TOKENS}
    extra = tcfg.get("additional_special_tokens", special.get("additional_special_tokens"))
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [_token_text(t) for t in extra]
    template = None
    tmpl_file = model_dir / "chat_template.jinja"
    if tmpl_file.is_file():
        template = tmpl_file.read_text()
    if template is None:
        template = _default_template(tcfg.get("chat_template"))
    if template is None:  # where processors (and older saves) keep it
        template = _default_template(
            _json_file(model_dir / "chat_template.json").get("chat_template"))
    try:
        value = _json_file(model_dir / "generation_config.json").get("eos_token_id")
    except ModelLoadError as exc:  # sampling_defaults.py warns about it too: serve without
        log.warning("%s; its EOS ids are not used", exc)
        value = None
    eos = value if isinstance(value, list) else [value] if value is not None else []
    return {"tokenizer_json": path.read_text(), "bos_token": tokens["bos_token"],
            "eos_token": tokens["eos_token"], "chat_template": template,
            "special_tokens": {k: v for k, v in tokens.items() if v is not None},
            "generation_eos_token_ids": [int(i) for i in eos]}


# The special tokens a chat template sees by name, as transformers passes them.
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _json_file(path: Path) -> dict:
    """A JSON object from `path` ({} when there is no such file)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON: {exc}") from None
    return value if isinstance(value, dict) else {}


def _default_template(value) -> Optional[str]:
    """A template, or the one named "default" of a list of named ones (as transformers picks)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default")
    return value


class Tokenizer:
    """From a model directory, or from `read_tokenizer_files`' dict (what a worker ships)."""

    def __init__(self, source: Union[str, Path, dict]):
        files = dict(source) if isinstance(source, dict) else read_tokenizer_files(source)
        self.files = files
        self._tok = HFTokenizer.from_str(files["tokenizer_json"])
        self._tok.no_padding()
        self._tok.no_truncation()
        self.chat_template: Optional[str] = files.get("chat_template")
        # How its model writes tool calls (pd_runtime/entrypoints/openai/request_parsing/tools.py;
        # router.tool_call_parser overrides).
        self.tool_call_format = tool_call_format(self.chat_template)
        # Whether its thinking is split out (pd_runtime/parsers/reasoning.py;
        # router.reasoning_parser).
        self.reasoning_format = reasoning_format(self.chat_template)
        self.bos_token = files.get("bos_token")
        self.eos_token = files.get("eos_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = set(files.get("generation_eos_token_ids") or [])
        # The tokenizer's own EOS; generation_config may name more (Llama 3's <|eot_id|>).
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids = frozenset(int(i) for i in ids)
        self._special_ids = {t.id if hasattr(t, "id") else k
                             for k, t in self._tok.get_added_tokens_decoder().items()
                             if getattr(t, "special", False)}
        self._template = None
        self._texts: dict[int, str] = {}  # token_text's, filled as tokens are shown

    def __getstate__(self) -> dict:
        # The compiled chat template does not pickle; a copy in another process compiles its own
        # (and its own token texts).
        return {**self.__dict__, "_template": None, "_texts": {}}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~0.7 s for 310k chars),
        # so a long prompt tokenized on a thread does not stall the router's event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def truncate(self, text: str, ids: list[int], keep: int, from_start: bool = False
                 ) -> list[int]:
        """`ids` (the encoding of `text` with special tokens) cut to `keep` tokens as an HF
        tokenizer truncates: the special tokens it added stay, the text's tokens lose their
        start (their end, `from_start`)."""
        if len(ids) <= keep:
            return ids
        plain = self.encode(text, add_special_tokens=False)
        start = next((k for k in range(len(ids) - len(plain) + 1)
                      if ids[k:k + len(plain)] == plain), 0)
        prefix, suffix = ids[:start], ids[start + len(plain):]
        room = keep - len(prefix) - len(suffix)
        if room < 1:
            return ids[-keep:] if not from_start else ids[:keep]
        body = plain[:room] if from_start else plain[-room:]
        return prefix + body + suffix

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def token_text(self, token: int) -> str:
        """One token's own text, special tokens included: what logprobs show for it."""
        text = self._texts.get(token)
        if text is None:
            text = self._texts[token] = self.decode([token], skip_special_tokens=False)
        return text

    def use_chat_template(self, source: str) -> None:
        """Render chats with `source` instead of the model's template (router.chat_template),
        compiled now so a broken one fails at start, not on the first request; the tool-call
        and reasoning formats become the ones it shows."""
        try:
            compiled = ChatTemplate(source)
        except Exception as exc:  # jinja2's TemplateSyntaxError and kin
            raise ValueError(f"router.chat_template: the template does not compile: "
                             f"{exc}") from None
        self.chat_template, self._template = source, compiled
        self.tool_call_format = tool_call_format(source)
        self.reasoning_format = reasoning_format(source)

    def apply_chat_template(self, messages: list[dict], /, add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text (pd_runtime.chat_template: as transformers renders it, with the
        special tokens by name and no tools or documents); `kwargs`: `continue_final_message`
        and the template's own variables (enable_thinking, ...)."""
        if not self.chat_template:
            raise ModelLoadError("this model directory has no chat template "
                                 "(tokenizer_config.json chat_template)")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        continue_final = bool(kwargs.pop("continue_final_message", False))
        special = self.files.get("special_tokens") or {
            "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        variables = {**special, "tools": None, "documents": None, **kwargs}
        return self._template.render(messages, add_generation_prompt,
                                     continue_final_message=continue_final, variables=variables)

    def encode_chat(self, messages: list[dict], /, add_generation_prompt: bool = True,
                    **kwargs) -> list[int]:
        # The template already carries any BOS; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs),
                           add_special_tokens=False)
