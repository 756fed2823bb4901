"""A request's lifecycle as counters: tokens so far, tokens whose KV is computed, blocks held.

Chunked prefill, a prefix-cache hit and KV arriving from a prefill worker all just move
`num_computed_tokens`; a sample is due when it reaches `num_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from pd_runtime.api import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"   # waiting again, KV freed (recompute) or swapped out
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"        # eos, stop token or stop string
    LENGTH = "length"    # max_tokens or max_model_len
    ABORT = "abort"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    cache_salt: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: Optional[str] = None

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    swap_block_ids: list[int] = field(default_factory=list)  # KV parked in CPU swap space
    hold_blocks: bool = False          # keep blocks after finishing (prefill side of a transfer)
    # Prefill side of a transfer: called as layer_sink(layer, block_ids) once each layer's K/V
    # of the prompt's last step are in the cache (the worker ships them as they come).
    layer_sink: Any = None
    block_hashes: list[int] = field(default_factory=list)
    num_published_blocks: int = 0  # leading full blocks already offered to the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    num_preemptions: int = 0
    waited_steps: int = 0              # steps passed over while waiting (priority aging)
    generator: Any = None              # torch.Generator for seeded sampling, owned by the sampler
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # Per prompt position, when asked (prompt_logprobs.py); sent with the first output.
    prompt_logprobs: Optional[list] = None
    # Detokenizer state (see detokenizer.py).
    text: str = ""
    emitted_len: int = 0               # characters of `text` already sent out as deltas
    prefix_offset: int = 0
    read_offset: int = 0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    lookup: Any = None                 # speculative decoding's per-request state (speculative.py)
    grammar: Any = None                # structured outputs' matcher state (grammar.py)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]
