"""What crosses the router <-> worker boundary, torch-free (the router imports this, never the
engine): the typed errors a request can end with, the sampling parameters (validated here,
before anything is allocated), and the StreamChunk a worker streams per engine step (one
typed, versioned shape from the worker to the OpenAI layer), errors travelling as data so the
router can map them to HTTP statuses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional, Union

from pd_runtime import structured
from pd_runtime.errors import DeadlineExceededError, EngineOverloadedError, InvalidRequestError
# The rest of the contract's errors, imported from here: they live in errors.py so that
# structured.py, which SamplingParams validates with, raises them without importing this module.
from pd_runtime.errors import ModelLoadError, RequestTooLargeError  # noqa: F401


# ---------------------------------------------------------------------------------- sampling
# A bias names a handful of tokens, not a vocabulary; this bounds the sampler's work per step.
MAX_LOGIT_BIAS_ENTRIES = 300
# Bad words: each is matched against the output's end every step, so their count is bounded.
MAX_BAD_WORDS = 100
MAX_BAD_WORD_CHARS = 200


@dataclass
class SamplingParams:
    # vLLM's: sequences per prompt. The offline LLM runs each as a request of its own (choice i
    # seeded seed + i, as the server's n); one engine request is one sequence (n 1).
    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0          # 0 or -1: disabled
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # vLLM's: the matched stop string ends the text
    ignore_eos: bool = False
    # vLLM's: neither EOS (ignore_eos or not) nor a stop token id before this many tokens, and
    # stop strings only in the text after them.
    min_tokens: int = 0
    logprobs: Optional[int] = None  # top-n logprobs per generated token (0: only the sampled one)
    # top-n logprobs of each prompt token (completions with echo); such a request runs where its
    # prompt is computed (colocated) and takes no prefix-cache hit.
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # OpenAI: subtracted once per earlier occurrence (frequency) or once if present (presence),
    # counting generated tokens only.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM: over prompt and generated tokens, positive logits divided by it, negative multiplied.
    repetition_penalty: float = 1.0
    # token id -> added to its logit; keys may arrive as strings (JSON object keys).
    logit_bias: Optional[dict[int, float]] = None
    # The output held to a JSON schema, regex, choice list or grammar (structured.py): a dict
    # with one of json, regex, choice, grammar, json_object, as vLLM's structured_outputs.
    structured_outputs: Optional[dict] = None
    # vLLM's: only these token ids may be chosen.
    allowed_token_ids: Optional[list[int]] = None
    # vLLM's: words never written. A word's last token is ruled out wherever the output so far
    # ends with the rest of its tokens; `bad_words_token_ids` holds those spellings (each word
    # alone and after a space, `bad_word_spellings`), filled in by whoever has the tokenizer.
    bad_words: Optional[list[str]] = None
    bad_words_token_ids: Optional[list[list[int]]] = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.logit_bias = _token_keys(self.logit_bias) or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words) if self.bad_words else None
        self.validate()
        if self.allowed_token_ids is not None:  # each once, in order (valid ints by now)
            self.allowed_token_ids = sorted(set(self.allowed_token_ids))

    @classmethod
    def of(cls, value: "SamplingParams | dict") -> "SamplingParams":
        """The parameters as given: a SamplingParams is already valid (it was checked when it
        was made, by the router for a served request) and passes as it is, so a request's
        parameters are judged once; a dict (a caller that built none) is checked now."""
        return value if isinstance(value, cls) else cls(**value)

    def first_token_only(self) -> "SamplingParams":
        """These parameters for the first token alone (a prefill worker's part of a
        disaggregated request): that token is chosen exactly as under the whole request."""
        return replace(self, max_tokens=1, min_tokens=min(self.min_tokens, 1))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the sampler must change this row's logits before choosing (penalties, bias)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens
                    or self.allowed_token_ids is not None or self.bad_words_token_ids)

    def validate(self) -> None:
        def bad(param: str, msg: str):
            raise InvalidRequestError(f"{param} {msg}", param=param)

        def number_in(value, low: float, high: float) -> bool:  # NaN fails every comparison
            return isinstance(value, (int, float)) and not isinstance(value, bool) \
                and low <= value <= high

        if not isinstance(self.n, int) or isinstance(self.n, bool) or not 1 <= self.n <= 128:
            bad("n", f"must be an integer in [1, 128], got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], got "
                f"{self.min_tokens!r}")
        if not number_in(self.temperature, 0.0, 100.0):
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not (number_in(self.top_p, 0.0, 1.0) and self.top_p > 0.0):
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not number_in(self.min_p, 0.0, 1.0):
            bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int)
                                              and 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (isinstance(self.prompt_logprobs, int)
                                                     and 0 <= self.prompt_logprobs <= 20):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got "
                f"{self.prompt_logprobs!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            if not number_in(getattr(self, name), -2.0, 2.0):
                bad(name, f"must be in [-2, 2], got {getattr(self, name)!r}")
        if not (number_in(self.repetition_penalty, 0.0, math.inf)
                and 0.0 < self.repetition_penalty < math.inf):
            bad("repetition_penalty", f"must be a finite number > 0, got "
                f"{self.repetition_penalty!r}")
        if self.structured_outputs is not None:
            structured.check(self.structured_outputs)  # compiled once per spec (cached)
            if self.min_tokens:
                # The grammar decides where the output ends; a floor on its length would
                # leave no token to choose once the grammar is complete.
                bad("min_tokens", "cannot be combined with structured outputs (the grammar "
                    "decides where the output ends)")
            if self.allowed_token_ids is not None:
                bad("allowed_token_ids", "cannot be combined with structured outputs or a "
                    "required tool call (the grammar decides which tokens may follow)")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or any(
                    not isinstance(t, int) or isinstance(t, bool) or t < 0
                    for t in self.allowed_token_ids):
                bad("allowed_token_ids", "must be a non-empty list of token ids (non-negative "
                    "integers)")
        if self.bad_words is not None:
            check_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None and any(
                not isinstance(w, (list, tuple)) or not w
                or any(not isinstance(t, int) or t < 0 for t in w)
                for w in self.bad_words_token_ids):
            bad("bad_words_token_ids", "must be non-empty lists of token ids (one per "
                "spelling of a bad word)")
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                bad("logit_bias", f"may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got "
                    f"{len(self.logit_bias)}")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    bad("logit_bias", f"keys must be token ids (non-negative integers), got "
                        f"{token!r}")
                if not number_in(bias, -100.0, 100.0):
                    bad("logit_bias", f"values must be in [-100, 100], got {bias!r} for token "
                        f"{token}")


@dataclass(frozen=True)
class GenerationRequest:
    """One request as a worker receives it (pool client -> PDWorker): the prompt (token ids;
    text from offline callers), its sampling parameters (a SamplingParams, judged once where it
    was made: by the router for a served request), its priority, its tenant's prefix-cache
    salt, and its deadline: the wall-clock time (`time.time()`) after which nobody waits for
    it any more (the router's `request_timeout_s`), so a worker ends it there even if the
    router's abort never arrives."""

    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams
    priority: int = 0
    cache_salt: Optional[str] = None
    deadline: Optional[float] = None

    @classmethod
    def make(cls, request_id: str, prompt: Union[str, list[int]],
             params: "SamplingParams | dict", priority: int = 0,
             cache_salt: Optional[str] = None,
             deadline: Optional[float] = None) -> "GenerationRequest":
        if deadline is not None and not math.isfinite(deadline):
            raise InvalidRequestError(f"deadline must be a finite time, got {deadline}",
                                      param="deadline")
        return cls(request_id, prompt, SamplingParams.of(params), priority, cache_salt,
                   deadline)


def _token_keys(bias) -> Optional[dict]:
    """logit_bias with integer keys: JSON gives "123"; anything that is not a plain decimal
    token id is left as it is for validate() to name."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be an object of token id -> bias, got "
                                  f"{type(bias).__name__}", param="logit_bias")
    out = {}
    for key, value in bias.items():
        if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 20:
            key = int(key)
        if key in out:  # "7" and "007" both name token 7
            raise InvalidRequestError(f"logit_bias names token {key} twice", param="logit_bias")
        out[key] = value
    return out


# ---------------------------------------------------------------------------------- stream chunks
# The chunk's shape: raised when a field is added, renamed or changes meaning, so a router and
# a worker of different versions (a rolling restart) notice instead of misreading each other.
STREAM_CHUNK_VERSION = 1


@dataclass(slots=True)
class ChunkError:
    """Why a stream ended without finishing its request: `type` names the kind (overloaded,
    timeout, invalid_request_error, unavailable, or the router's refusal kinds), `status` the
    HTTP status it is answered with."""

    type: str
    message: str
    status: int
    retry_after_s: Optional[float] = None
    param: Optional[str] = None


@dataclass(slots=True)
class StreamChunk:
    """What a request's stream carries, one per engine step or several steps merged: the
    worker makes it (`from_output`, `from_error`), and each layer it passes through fills only
    its own fields, named below: worker -> pool client (workers/client.py) -> router
    (router/core.py) -> the OpenAI layer, which reads it and adds nothing. Slotted: a field
    no layer declared cannot be added on the way."""

    # -- the worker's, from the engine's RequestOutput ----------------------------------------
    request_id: Optional[str] = None  # the engine's id; the pool client's own after it
    token_ids: list[int] = field(default_factory=list)  # new since the last chunk
    text: str = ""  # new since the last chunk
    finished: bool = False
    finish_reason: Optional[str] = None  # "error" on an error chunk
    stop_reason: Union[int, str, None] = None
    # Per new token: (logprob, {token_id: logprob} of the top-n, rank); None when not asked.
    logprobs: Optional[list] = None
    prompt_logprobs: Optional[list] = None  # on the first chunk of a request that asked
    num_prompt_tokens: Optional[int] = None
    num_cached_tokens: Optional[int] = None
    path: Optional[str] = None  # "colocated" or "disaggregated": where the prompt was computed
    queue_s: Optional[float] = None  # arrival to first scheduled; on the finishing chunk
    error: Optional[ChunkError] = None  # set: the stream's last chunk, and no tokens
    # -- the decode worker's, on a disaggregated request's finishing chunk --------------------
    kv_transfer_s: Optional[float] = None  # first token to the KV landed
    kv_arrived: Optional[bool] = None  # False: the transfer failed, the prompt recomputed
    remote_prefill_s: Optional[float] = None
    prefill_fallback: bool = False  # its first token is the decode worker's own, not P's
    # -- the pool client's ---------------------------------------------------------------------
    worker_id: Optional[str] = None  # the decode worker that produced it
    migrations: int = 0  # decode workers lost so far during the request
    # -- the router's --------------------------------------------------------------------------
    route_reason: Optional[str] = None  # the policy's reason label
    workers: Optional[list[str]] = None  # the workers chosen: decode, then prefill
    version: int = STREAM_CHUNK_VERSION

    @classmethod
    def from_output(cls, out, path: str) -> "StreamChunk":
        """A chunk from an engine RequestOutput (duck-typed: this module stays torch-free)."""
        return cls(request_id=out.request_id, token_ids=list(out.new_token_ids),
                   text=out.new_text, finished=out.finished, finish_reason=out.finish_reason,
                   stop_reason=out.stop_reason, logprobs=out.new_logprobs,
                   prompt_logprobs=out.prompt_logprobs, num_prompt_tokens=out.num_prompt_tokens,
                   num_cached_tokens=out.num_cached_tokens, path=path, queue_s=out.queue_s)

    @classmethod
    def from_error(cls, exc: Exception, status: Optional[int] = None,
                   retry_after_s: Optional[float] = None) -> "StreamChunk":
        """The chunk that ends a stream with `exc`: its kind and status from its type (an
        explicit `status` wins), as the router maps them to HTTP."""
        param = None
        if isinstance(exc, EngineOverloadedError):
            kind, code, retry_after_s = "overloaded", status or 429, exc.retry_after_s
        elif isinstance(exc, DeadlineExceededError):
            kind, code, retry_after_s = "timeout", status or 504, None
        elif isinstance(exc, InvalidRequestError):
            kind, code, retry_after_s, param = "invalid_request_error", status or 400, None, \
                exc.param
        else:
            kind, code = "unavailable", status or 503
        return cls(finished=True, finish_reason="error",
                   error=ChunkError(kind, str(exc), code, retry_after_s, param))

    def absorb(self, later: "StreamChunk") -> "StreamChunk":
        """This chunk followed by `later` of the same request, as one (outputs that queued up
        while the caller read the last chunk)."""
        self.token_ids = self.token_ids + later.token_ids
        self.text = (self.text or "") + (later.text or "")
        if self.logprobs is not None or later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + (later.logprobs or [])
        if self.prompt_logprobs is None:
            self.prompt_logprobs = later.prompt_logprobs
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.stop_reason, self.queue_s = later.stop_reason, later.queue_s
        return self


# ---------------------------------------------------------------------------------- model card
@dataclass(frozen=True)
class ModelCard:
    """What the router must know of the served model, from the workers (ready() reports it):
    the identity its block hashes start from, the block size, the context limit
    (max_model_len, as the workers enforce it), the tokenizer's files
    (`pd_runtime.tokenizer.read_tokenizer_files`) and the model's sampling defaults
    (`pd_runtime.sampling_defaults`). With it the router needs no model files."""

    identity: str
    block_size: int
    max_model_len: int
    tokenizer_files: dict
    sampling_defaults: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"identity": self.identity, "block_size": self.block_size,
                "max_model_len": self.max_model_len, "tokenizer_files": self.tokenizer_files,
                "sampling_defaults": self.sampling_defaults}

    @classmethod
    def from_dict(cls, d: dict) -> "ModelCard":
        return cls(str(d["identity"]), int(d["block_size"]), int(d["max_model_len"]),
                   dict(d["tokenizer_files"]), dict(d.get("sampling_defaults") or {}))

    def differs_from(self, other: "ModelCard") -> Optional[str]:
        """Which field two workers disagree on (None when they serve the same model alike)."""
        for name in ("identity", "block_size", "max_model_len", "sampling_defaults"):
            if getattr(self, name) != getattr(other, name):
                return f"{name}: {getattr(self, name)!r} vs {getattr(other, name)!r}"
        return None


def bad_word_spellings(words: list[str], encode) -> list[list[int]]:
    """The token spellings of `words` that sampling rules out (`encode`: text -> token ids,
    without special tokens): each word as written at the start of a text, and after a space
    where that is a spelling of its own (a byte-level BPE's " word" begins with a different
    token, as long), which is how a word usually comes in the middle of a text. A tokenizer
    that marks word starts itself (SentencePiece's "▁") already gives that spelling alone."""
    out: dict[tuple, list[int]] = {}  # in order, each once
    for word in words:
        alone = list(encode(word.lstrip()))
        spaced = list(encode(" " + word.lstrip()))
        for ids in (alone, spaced):
            if ids is spaced and (not alone or len(spaced) != len(alone)
                                  or spaced[0] == alone[0]):
                continue
            if ids:
                out.setdefault(tuple(ids), ids)
    return list(out.values())


def check_bad_words(words) -> None:
    """bad_words as SamplingParams takes them: judged before anything tokenizes them (a
    request's count and lengths bound the tokenizer's work as well as the sampler's)."""
    if not isinstance(words, (list, tuple)) or len(words) > MAX_BAD_WORDS or any(
            not isinstance(w, str) or not w.strip() or len(w) > MAX_BAD_WORD_CHARS
            for w in words):
        raise InvalidRequestError(f"bad_words must be at most {MAX_BAD_WORDS} non-blank "
                                  f"strings of at most {MAX_BAD_WORD_CHARS} characters",
                                  param="bad_words")
