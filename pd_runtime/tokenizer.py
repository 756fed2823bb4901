"""Tokenizer of an HF model directory via `tokenizers` (torch-free), with its chat template.

Part of the router <-> worker contract: the router tokenizes prompts and detokenizes logprob
tokens exactly as the workers do, from the files a worker hands over in its model card
(`Tokenizer.files`, `api.ModelCard`), so the router needs no model directory of its own.
Token ids the tokenizer does not know (padded embedding rows, as in Qwen) decode to nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Union

from tokenizers import Tokenizer as HFTokenizer

from pd_runtime.api import ModelLoadError
from pd_runtime.chat_template import ChatTemplate


def _token_text(value) -> Optional[str]:
    if isinstance(value, dict):  # AddedToken serialised as a dict
        return value.get("content")
    return value


def read_tokenizer_files(model_dir: Union[str, Path]) -> dict:
    """What a tokenizer is made of, as plain data (msgpack/pickle-friendly): the fast
    tokenizer file, tokenizer_config.json, the chat template and generation_config's EOS ids."""
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing (a fast tokenizer file is required)")
    cfg_path = model_dir / "tokenizer_config.json"
    tcfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    template = _default_template(tcfg.get("chat_template"))
    tmpl_file = model_dir / "chat_template.jinja"
    if template is None and tmpl_file.is_file():
        template = tmpl_file.read_text()
    json_file = model_dir / "chat_template.json"  # where processors (and older saves) keep it
    if template is None and json_file.is_file():
        template = _default_template(json.loads(json_file.read_text()).get("chat_template"))
    eos = []
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        value = json.loads(gen.read_text()).get("eos_token_id")
        eos = value if isinstance(value, list) else [value] if value is not None else []
    return {"tokenizer_json": path.read_text(), "bos_token": _token_text(tcfg.get("bos_token")),
            "eos_token": _token_text(tcfg.get("eos_token")), "chat_template": template,
            "generation_eos_token_ids": [int(i) for i in eos]}


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
        self.bos_token = files.get("bos_token")
        self.eos_token = files.get("eos_token")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        ids = set(files.get("generation_eos_token_ids") or [])
        if self.eos_token and self._tok.token_to_id(self.eos_token) is not None:
            ids.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids = frozenset(int(i) for i in ids)
        self._special_ids = {t.id if hasattr(t, "id") else k
                             for k, t in self._tok.get_added_tokens_decoder().items()
                             if getattr(t, "special", False)}
        self._template = None

    def __getstate__(self) -> dict:
        # The compiled chat template does not pickle; a copy in another process compiles its own.
        return {**self.__dict__, "_template": None}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~0.7 s for 310k chars),
        # so a long prompt tokenized on a thread does not stall the router's event loop.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        known = [t for t in token_ids if 0 <= t < self.vocab_size]
        return self._tok.decode(known, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text (pd_runtime.chat_template: as transformers renders it); `kwargs`:
        `continue_final_message` and the template's own variables (enable_thinking, ...)."""
        if not self.chat_template:
            raise ModelLoadError("this model directory has no chat template "
                                 "(tokenizer_config.json chat_template)")
        if self._template is None:
            self._template = ChatTemplate(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                     **kwargs}
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     **variables)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        # The template already carries any BOS; adding special tokens again would double it.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)
