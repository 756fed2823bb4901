"""Decides each step's work: which requests run and how many tokens each computes. No torch.

Every step is continuous batching under a token budget: running requests first (a decode is
one token, an unfinished prefill continues with a chunk), then waiting requests by
(effective priority, arrival) while budget, `max_num_seqs` and KV blocks last. When blocks run
out, the running request that is least urgent (lowest priority, then latest arrival) is
preempted: by swap (its blocks are copied to a bounded CPU swap space and back later) when the
mode is swap and the space has room, else by recompute (blocks freed, prefill redone). A waiting
request that holds blocks (a remote prefill's KV arrived) gives them back the same way when a
more urgent one needs them: blocks held by requests that do not run can never block the line.
The most urgent request always progresses and waiting requests age upward, so nothing starves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from pd_runtime.engine.kv_cache.block_manager import BlockManager
from pd_runtime.engine.sequence import Request, RequestStatus
from pd_runtime.engine.kv_cache.swap_space import SwapSpace


@dataclass
class ScheduledRequest:
    request_id: str
    start: int                 # first position computed this step (= num_computed_tokens)
    token_ids: list[int]       # tokens at positions [start, start + len)
    block_ids: list[int]       # the whole block table
    sample: bool               # this chunk reaches the end: sample the next token
    # Speculative: tokens guessed after the last one, computed with it (token_ids ends with
    # them); the step samples at each of their positions too (engine.py verifies them).
    draft_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """The plan for one step: plain data, picklable, all the runner needs."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Block copies the runner does before the forward pass: (device block, swap block) out,
    # (swap block, device block) in. Never both in one step (no admission after a preemption).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    waiting_on_disk: bool = False  # a request passed over while its prefix is read from disk

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int, priority_aging_steps: int = 64,
                 swap_space: SwapSpace | None = None):
        self.bm = block_manager
        self.swap_space = swap_space  # None: preemption by recompute only
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.priority_aging_steps = priority_aging_steps
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_swapped_out = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def detach(self, req: Request) -> None:
        """Take a request out of the queues; its blocks stay allocated to it."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and release its blocks (finish or abort)."""
        self.detach(req)
        self.bm.free(req)
        if req.swap_block_ids:
            self.swap_space.free(req.swap_block_ids)
            req.swap_block_ids = []

    @property
    def num_waiting_tokens(self) -> int:
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    def _urgency(self, req: Request):
        aged = req.priority - req.waited_steps // self.priority_aging_steps
        return (aged, req.arrival_time)

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        swap_ids = self.swap_space.allocate(len(victim.block_ids)) if self.swap_space else None
        if swap_ids is not None:
            out.swap_out.extend(zip(victim.block_ids, swap_ids))
            victim.swap_block_ids = swap_ids
            self.num_swapped_out += 1
        else:  # recompute: the KV is gone; the prompt and generated tokens are prefilled again
            victim.num_computed_tokens = 0
            victim.num_cached_tokens = 0
        self.bm.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim.request_id)

    def _reclaim(self, req: Request, out: SchedulerOutput) -> bool:
        """Free the blocks of the least urgent waiting request behind `req` that holds some
        (its prompt is recomputed when its turn comes); False when there is none."""
        urgency = self._urgency(req)
        holders = [r for r in self.waiting if r.block_ids and self._urgency(r) > urgency]
        if not holders:
            return False
        victim = max(holders, key=self._urgency)
        victim.num_computed_tokens = 0
        victim.num_cached_tokens = 0
        self.bm.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(victim.request_id)
        return True

    def blocks_spoken_for(self) -> int:
        """Free blocks the queued requests will take before any request admitted after them:
        what each waiting request without blocks needs, and one more for each running one."""
        need = sum(self.bm.blocks_needed(r.num_tokens) for r in self.waiting if not r.block_ids)
        return need + len(self.running)

    def _plan(self, req: Request, n: int, drafts: Sequence[int] = ()) -> ScheduledRequest:
        start = req.num_computed_tokens
        if drafts:
            return ScheduledRequest(req.request_id, start, [req.last_token_id, *drafts],
                                    list(req.block_ids), True, list(drafts))
        return ScheduledRequest(req.request_id, start, req.token_slice(start, start + n),
                                list(req.block_ids), start + n == req.num_tokens)

    def schedule(self, prompt_budget: Optional[int] = None,
                 draft: Optional[Callable[[Request, int], list[int]]] = None
                 ) -> SchedulerOutput:
        """prompt_budget: at most this many prompt tokens this step (decodes are not counted;
        None: only the token budget). draft(request, at most): tokens to verify after a
        decoding request's last one (speculative decoding), within the token budget."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        prompt = budget if prompt_budget is None else max(0, prompt_budget)
        self.running.sort(key=self._urgency)
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget) if left == 1 else min(left, budget, prompt)
            if n == 0:
                continue
            drafts = draft(req, budget - 1) if left == 1 and draft is not None else ()
            n += len(drafts)
            if drafts and not self.bm.allocate(req, n):  # guesses never preempt anyone
                n, drafts = n - len(drafts), ()
            while not self.bm.allocate(req, n):
                victim = max(self.running, key=self._urgency)
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                out.scheduled.append(self._plan(req, n, drafts))
                budget -= n
                if left > 1:
                    prompt -= n

        self.waiting.sort(key=self._urgency)
        admitted = []
        for req in self.waiting:
            if out.preempted or min(budget, prompt) == 0 or len(self.running) >= self.max_num_seqs:
                break
            fresh = req.num_computed_tokens == 0 and not req.block_ids
            if fresh and self.bm.loading(req):  # its cached prefix is on its way from disk
                out.waiting_on_disk = True
                continue
            prefix = self.bm.match_prefix(req) if fresh else []
            n = min(req.num_tokens - req.num_computed_tokens - len(prefix) * self.bm.block_size,
                    budget, prompt)
            allocated = self.bm.allocate(req, n, prefix)
            while not allocated and self._reclaim(req, out):
                allocated = self.bm.allocate(req, n, prefix)
            if not allocated:
                break
            if req.swap_block_ids:  # the first blocks of the fresh table receive the swapped KV
                out.swap_in.extend(zip(req.swap_block_ids, req.block_ids))
                self.swap_space.free(req.swap_block_ids)
                req.swap_block_ids = []
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            admitted.append(req)
            out.scheduled.append(self._plan(req, n))
            budget -= n
            prompt -= n
        for req in admitted:
            self.waiting.remove(req)
        for req in self.waiting:
            req.waited_steps += 1
        return out
