"""The engine's part in disaggregation (`RemoteKV`, owned by the engine as `engine.remote`):
reserve blocks for KV computed elsewhere, mark it arrived (or fall back to a local prefill),
hold a finished prefill's blocks while they are shipped.

The engine knows no transfer backend: the worker moves the bytes and calls these methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from pd_runtime.api import SamplingParams
from pd_runtime.engine.sampling.sampler import Sampler
from pd_runtime.engine.sequence import Request, RequestStatus


@dataclass
class RemoteKVReservation:
    """Blocks a decode engine reserved for a prompt. Blocks covering the first
    `num_cached_tokens` already hold valid KV (prefix cache); the rest must be filled."""

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int
    num_prompt_tokens: int
    block_size: int

    @property
    def missing_block_ids(self) -> list[int]:
        return self.block_ids[self.num_cached_tokens // self.block_size:]


class RemoteKV:
    """The engine's part in disaggregation, owned by the engine (`LLMEngine.remote`), called
    on the engine thread. Decode side: `reserve` -> `accept_first_token` -> `complete` (or
    `fail` before any token). Prefill side: a finished request with `hold_blocks` waits in
    `held` until `release_held`. It uses the engine's requests, scheduler, block manager and
    output path; it knows no transfer backend."""

    def __init__(self, engine):
        self.engine = engine
        self.held: dict[str, Request] = {}     # prefill side: finished, blocks kept for a transfer
        self.waiting: dict[str, Request] = {}  # decode side: blocks reserved, KV expected

    def reserve(self, request_id: str, prompt: Union[str, list[int]],
                params: Optional[SamplingParams] = None, priority: int = 0,
                cache_salt: Optional[str] = None) -> Optional[RemoteKVReservation]:
        """Decode side: admit a request and reserve blocks for its whole prompt now.

        Returns None, holding nothing, when the blocks are not free (or its cached prefix is
        still being read from the disk tier): the reservation is the backpressure, so the
        caller waits or routes elsewhere; it never over-commits. Nor does
        it overtake: the blocks the queued requests will need first (`blocks_spoken_for`) are
        not free for it, or a stream of reservations would starve the requests already here.
        Ownership: the request holds the blocks until it finishes or is aborted.
        """
        e = self.engine
        req = e._new_request(request_id, prompt, params, priority, cache_salt)
        bm = e.block_manager
        if bm.loading(req):  # its cached prefix is being read from disk: asked again next tick
            return None
        prefix = bm.match_prefix(req)
        missing = req.num_prompt_tokens - len(prefix) * bm.block_size
        if not bm.allocate(req, missing, prefix, keep_free=e.scheduler.blocks_spoken_for()):
            return None
        req.status = RequestStatus.WAITING
        e.requests[request_id] = req
        self.waiting[request_id] = req
        return RemoteKVReservation(request_id, list(req.block_ids), req.num_cached_tokens,
                                   req.num_prompt_tokens, bm.block_size)

    def accept_first_token(self, request_id: str, first_token_id: int, first_logprob=None):
        """The prefill worker sampled `first_token_id`: record it here as if sampled here.

        Its text comes from this request's own detokenizer, with the real stop strings and
        max_tokens, so text stays a function of the token ids on every path (the prefill
        worker's own text is never used). Returns the token's RequestOutput. If the token ends
        the request, its blocks stay held until `complete` (the transfer may still be writing
        them).
        """
        req = self.waiting[request_id]
        if req.generator is not None and not req.params.greedy:
            Sampler.skip_draw(req.generator, self.engine.model_config.vocab_size)
        req.output_token_ids.append(first_token_id)
        if first_logprob is not None:
            req.logprobs.append(first_logprob)
        req.hold_blocks = True
        output = self.engine._finish_token(req, first_token_id, first_logprob)
        req.hold_blocks = False
        return output

    def complete(self, request_id: str, kv_arrived: bool = True) -> None:
        """The transfer ended (no more writes into the reserved blocks): decode on from here.

        kv_arrived: the prompt's KV is in the reserved blocks. If not (the transfer failed after
        the first token was sent on), the prompt is prefilled here again but the token stands,
        so the client's stream stays one stream. A request its first token finished is freed.
        """
        req = self.waiting.pop(request_id)
        if req.is_finished:
            self.release_held(request_id)
            return
        req.num_computed_tokens = req.num_prompt_tokens if kv_arrived else req.num_cached_tokens
        self.engine.block_manager.cache_full_blocks(req)
        self.engine.scheduler.add(req)

    def fail(self, request_id: str) -> None:
        """No first token and no KV will come (prefill worker lost before sampling): prefill
        locally into the blocks already reserved, after the cached prefix."""
        req = self.waiting.pop(request_id)
        req.num_computed_tokens = req.num_cached_tokens
        self.engine.scheduler.add(req)

    def held_block_ids(self, request_id: str) -> list[int]:
        return list(self.held[request_id].block_ids)

    def release_held(self, request_id: str) -> bool:
        """Prefill side: the transfer of a finished request's blocks ended; free them."""
        req = self.held.pop(request_id, None)
        if req is None:
            return False
        self.engine.block_manager.free(req)
        return True
