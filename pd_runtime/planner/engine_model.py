"""One worker's engine, as the simulator sees it: continuous batching with chunked prefill on
the step budget (running requests first, then the waiting ones in arrival order, at most
max_num_seqs, prompt chunks cut to step_time_target_s while sequences decode, as
pd_runtime/engine/scheduler.py and LLMEngine._prompt_budget do), KV blocks as the admission
limit, and each step's seconds from the worker's fitted step costs (pd_runtime/planner/costs.py).

Pure decoding between two events runs as one "run" of k steps computed in closed form (the
steps differ only in their context, which grows by the batch each step), so a simulated hour
costs events per request, not per step. A request that arrives during a run cuts it at the
step in progress.

Blocks: a request takes the blocks of its prompt and all of its output when admitted (the
engine allocates as it goes and preempts when short; the simulator never preempts, which is
exact while blocks suffice and conservative when they do not).
"""

from __future__ import annotations

import collections
import heapq
from typing import Callable, Optional

from pd_runtime.planner.costs import RoleCosts

_EWMA = 0.05  # the engine's step-time average (StepCostModel)


class Seq:
    """One request on one engine."""

    __slots__ = ("rid", "prompt_len", "computed", "max_tokens", "generated", "blocks",
                 "entry_step", "entry_context", "on_first", "on_finish", "hold")

    def __init__(self, rid: int, prompt_len: int, max_tokens: int, blocks: int,
                 on_first: Callable[[float], None], on_finish: Callable[[float], None],
                 computed: int = 0, generated: int = 0, hold: bool = False):
        self.rid, self.prompt_len, self.max_tokens = rid, prompt_len, max_tokens
        self.computed, self.generated, self.blocks = computed, generated, blocks
        self.on_first, self.on_finish, self.hold = on_first, on_finish, hold
        self.entry_step = self.entry_context = 0


class SimEngine:
    # At most this many decode steps in one run (None: up to the next finish). 1 makes every
    # step its own event: the reference the closed form is tested against.
    max_run_steps: Optional[int] = None

    def __init__(self, sim, worker_id: str, role: str, costs: RoleCosts):
        self.sim, self.worker_id, self.role, self.costs = sim, worker_id, role, costs
        self.free_blocks = costs.num_kv_blocks
        self.waiting: collections.deque[Seq] = collections.deque()
        self.prefilling: list[Seq] = []            # admitted, prompt not all computed
        self.finishing: list[tuple[int, int, Seq]] = []  # decoding: (last step, rid, seq)
        self.decode_batch = 0
        self.decode_context = 0
        self.remote_waiting = 0                   # reserved for a remote prefill, KV not in
        self.landed: list[Seq] = []               # KV in: they decode from the next step
        self.step_no = 0
        self.step_s_ewma = 0.0
        self.decode_s_ewma = 0.0                  # the decode part of it (as the engine's)
        self._decode_share = 1.0                  # of the step in progress
        self.busy_s = 0.0
        self.busy: Optional[list] = None          # (start, end) of each step or run, if kept
        self.steps = 0
        self._event = None                        # the pending step or run end
        self._run: Optional[tuple] = None         # a pure-decode run in progress
        self._step_plan: Optional[list] = None    # the single step in progress
        self._began = 0.0                         # when the step or run in progress began

    # -- what the router sees --------------------------------------------------------------
    def load_report(self) -> dict:
        queued = sum(s.prompt_len - s.computed for s in self.waiting) + \
            sum(s.prompt_len - s.computed for s in self.prefilling)
        c = self.costs
        return {"num_running": len(self.prefilling) + self.decode_batch,
                "num_waiting": len(self.waiting) + self.remote_waiting,
                "queued_prefill_tokens": queued, "free_blocks": self.free_blocks,
                "total_blocks": c.num_kv_blocks, "max_num_seqs": c.max_num_seqs,
                "max_num_batched_tokens": c.max_num_batched_tokens,
                "block_size": c.block_size,
                "step_costs": {"coefficients": dict(c.coefficients), "steps": self.steps,
                               "step_s_ewma": self.step_s_ewma,
                               "decode_s_ewma": self.decode_s_ewma}}

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.costs.block_size)

    # -- work arriving -----------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self._wake()

    def reserve(self, blocks: int) -> bool:
        if blocks > self.free_blocks - self._spoken_for():
            return False
        self.free_blocks -= blocks
        self.remote_waiting += 1
        return True

    def land(self, seq: Seq) -> None:
        """A remote prefill's KV is in its reserved blocks: it decodes from the next step."""
        self.remote_waiting -= 1
        self.landed.append(seq)
        self._wake()

    def release(self, blocks: int) -> None:
        self.free_blocks += blocks
        self.sim.blocks_freed(self)
        self._wake()

    def _spoken_for(self) -> int:
        """Blocks the head of the queue needs: a reservation does not overtake it."""
        if not self.waiting:
            return 0
        head = self.waiting[0]
        return head.blocks

    # -- stepping ----------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._event is None:
            self._start_step(self.sim.now)
        elif self._run is not None:
            self._interrupt()

    def _interrupt(self) -> None:
        """New work during a pure-decode run: the run ends with the step in progress."""
        if self._run is None:
            return
        start, k, a, ctx_s, c0, batch = self._run
        cores = self.sim.cores
        elapsed = self.sim.now - start if cores is None else cores.done(self)
        done = self._steps_done_by(elapsed, k, a, ctx_s, c0, batch)
        cut = min(k, done + 1)
        if cut < k:
            self._run = (start, cut, a, ctx_s, c0, batch)
            if cores is None:
                self.sim.cancel(self._event)
                end = start + _run_seconds(cut, a, ctx_s, c0, batch)
                self._event = self.sim.at(end, self._end_run)
            else:
                cores.resize(self, _run_seconds(cut, a, ctx_s, c0, batch))

    @staticmethod
    def _steps_done_by(elapsed: float, k: int, a: float, ctx_s: float, c0: int,
                       batch: int) -> int:
        lo, hi = 0, k  # the largest j with run_seconds(j) <= elapsed
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if _run_seconds(mid, a, ctx_s, c0, batch) <= elapsed:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _prompt_budget(self) -> Optional[int]:
        target = self.costs.step_time_target_s
        if not target or not self.decode_batch:
            return None
        c = self.costs.coefficients
        spare = target - (c["step_s"] + c["decode_seq_s"] * self.decode_batch
                          + c["decode_context_s"] * self.decode_context)
        if c["prefill_token_s"] <= 0:
            return None
        floor = self.costs.block_size
        return max(floor, int(spare / c["prefill_token_s"])) if spare > 0 else floor

    def _start_step(self, now: float) -> None:
        c = self.costs
        for seq in self.landed:
            self._start_decoding(seq)
        self.landed.clear()
        budget = c.max_num_batched_tokens - self.decode_batch
        prompt = self._prompt_budget()
        prompt = budget if prompt is None else prompt
        plan, tokens, attention = [], 0, 0
        for seq in self.prefilling:
            n = min(seq.prompt_len - seq.computed, budget, prompt)
            if n <= 0:
                break
            plan.append((seq, n))
            attention += n * seq.computed + n * (n + 1) // 2
            tokens, budget, prompt = tokens + n, budget - n, prompt - n
        running = len(self.prefilling) + self.decode_batch
        while self.waiting and min(budget, prompt) > 0 and running < c.max_num_seqs:
            seq = self.waiting[0]
            if seq.blocks > self.free_blocks:
                break
            self.waiting.popleft()
            self.free_blocks -= seq.blocks
            self.prefilling.append(seq)
            running += 1
            n = min(seq.prompt_len - seq.computed, budget, prompt)
            plan.append((seq, n))
            attention += n * seq.computed + n * (n + 1) // 2
            tokens, budget, prompt = tokens + n, budget - n, prompt - n
        if not plan and not self.decode_batch:
            self._event = None
            if self.sim.cores is not None:
                self.sim.cores.rest(self)
            return
        if not plan:  # pure decode: a run up to the next request that finishes
            k = max(1, self.finishing[0][0] - self.step_no)
            if self.max_run_steps is not None:
                k = min(k, self.max_run_steps)
            a = c.coefficients["step_s"] + c.step_overhead_s \
                + c.coefficients["decode_seq_s"] * self.decode_batch
            ctx_s = c.coefficients["decode_context_s"]
            self._run = (now, k, a, ctx_s, self.decode_context, self.decode_batch)
            self._begin(now, _run_seconds(k, a, ctx_s, self.decode_context, self.decode_batch),
                        self._end_run)
            return
        self._step_plan = plan
        seconds = c.step_s(tokens, attention, self.decode_batch, self.decode_context)
        self._decode_share = c.step_s(0, 0, self.decode_batch, self.decode_context) / seconds \
            if seconds > 0 else 1.0
        self._begin(now, seconds, self._end_step)

    def _begin(self, now: float, seconds: float, fn) -> None:
        """A step (or a run of decode steps) of `seconds` of compute; on a node whose cores
        the workers share (sim.cores), it takes longer while others run."""
        self._began = now
        if self.sim.cores is None:
            self._event = self.sim.at(now + seconds, fn)
        else:
            self.sim.cores.begin(self, seconds, fn)

    def _account(self, steps: int, seconds: float, decode_share: float = 1.0) -> None:
        self.steps += steps
        self.busy_s += seconds
        if self.busy is not None:
            self.busy.append((self.sim.now - seconds, self.sim.now))
        mean = seconds / steps
        keep = (1 - _EWMA) ** steps
        self.step_s_ewma = mean if self.steps == steps else \
            keep * self.step_s_ewma + (1 - keep) * mean
        self.decode_s_ewma = mean * decode_share if self.steps == steps else \
            keep * self.decode_s_ewma + (1 - keep) * mean * decode_share

    def _end_run(self) -> None:
        start, k, a, ctx_s, c0, batch = self._run
        self._run = None
        self._account(k, self.sim.now - start)
        self.step_no += k
        self.decode_context += batch * k
        self._finish_due()
        self._start_step(self.sim.now)

    def _end_step(self) -> None:
        plan, self._step_plan = self._step_plan, None
        self._account(1, self.sim.now - self._began, self._decode_share)
        self.step_no += 1
        self.decode_context += self.decode_batch
        now = self.sim.now
        self._finish_due()
        for seq, n in plan:
            seq.computed += n
            if seq.computed < seq.prompt_len:
                continue
            self.prefilling.remove(seq)
            seq.generated += 1
            seq.on_first(now)
            if seq.generated >= seq.max_tokens:
                self._finish(seq, now)
            else:
                self._start_decoding(seq)
        self._start_step(now)

    def _start_decoding(self, seq: Seq) -> None:
        seq.entry_step = self.step_no
        seq.entry_context = seq.prompt_len + seq.generated
        heapq.heappush(self.finishing, (self.step_no + seq.max_tokens - seq.generated,
                                        seq.rid, seq))
        self.decode_batch += 1
        self.decode_context += seq.entry_context

    def _finish_due(self) -> None:
        now = self.sim.now
        while self.finishing and self.finishing[0][0] <= self.step_no:
            _, _, seq = heapq.heappop(self.finishing)
            self.decode_batch -= 1
            self.decode_context -= seq.entry_context + (self.step_no - seq.entry_step)
            seq.generated = seq.max_tokens
            self._finish(seq, now)

    def _finish(self, seq: Seq, now: float) -> None:
        seq.on_finish(now)
        if not seq.hold:  # a prefill's blocks stay until its KV has left
            self.free_blocks += seq.blocks
            self.sim.blocks_freed(self)


def _run_seconds(k: int, a: float, ctx_s: float, c0: int, batch: int) -> float:
    """k decode steps from context c0, each adding `batch` tokens of context."""
    return k * a + ctx_s * (k * c0 + batch * k * (k - 1) / 2)

