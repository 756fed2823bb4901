"""Speculative decoding with a small draft model (`speculative_method: draft`): any Llama-family
directory with the target's tokenizer guesses the next tokens greedily, and the target checks
them in one forward (pd_runtime/engine/spec_decode/speculative.py: a guess that is the draft's argmax is a
proposal with certainty, so the same acceptance rule keeps the target's distribution exactly).

The draft runs on its own model runner and paged KV cache (a block manager of its own, no
prefix cache), with a mirror per speculating request: the tokens whose draft KV is cached. Before
each engine step, every decoding request that is worth guessing for is brought up to date (its
new tokens in one chunk, whose last row gives the first guess), then the draft decodes k - 1
more guesses, all requests batched in each forward. After the target's verification the mirror
keeps what it computed for the tokens that stayed (a rejected guess's KV is recomputed over).
Mirrors of requests that stopped decoding are dropped at the next step.
"""

from __future__ import annotations

import logging
import time
from pd_runtime.api import SamplingParams
from pd_runtime.engine.kv_cache.block_manager import BlockManager
from pd_runtime.engine.scheduler import ScheduledRequest, SchedulerOutput
from pd_runtime.engine.sequence import Request

log = logging.getLogger(__name__)

_GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class DraftModel:
    def __init__(self, config, target_tokenizer, target_vocab: int, max_model_len: int,
                 num_blocks: int):
        from pd_runtime.engine.model_runner import ModelRunner
        from pd_runtime.model.model_config import load_model_config
        from pd_runtime.tokenizer import Tokenizer

        path = config.speculative_model
        draft_config = load_model_config(path)
        probe = "Speculative drafts must tokenize like the target: 123 héllo\n\tworld"
        if draft_config.vocab_size != target_vocab or \
                Tokenizer(path).encode(probe) != target_tokenizer.encode(probe):
            raise ValueError(f"speculative_model {path!r}: its tokenizer differs from the "
                             f"target's (vocab {draft_config.vocab_size} vs {target_vocab}); a "
                             "draft model must share the target's tokenizer")
        engine = config.model_copy(update={
            "model": path, "num_kv_blocks": num_blocks, "enable_prefix_caching": False,
            "speculative_method": None, "speculative_model": None, "cuda_graphs": False,
            "tensor_parallel_size": 1,
            "kv_cache_dtype": "auto", "gpu_memory_utilization": None})
        self.runner = ModelRunner(engine, max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, f"draft:{path}",
                                   enable_prefix_caching=False)
        self.mirrors: dict[str, Request] = {}
        self.forwards = 0
        # Seconds of draft compute per guess per request (recent average): a guess's price
        # besides its place in the target's verification (speculative.py: worth).
        self.guess_s = 0.0

    def propose(self, requests: list[Request], k: int) -> dict[str, list[int]]:
        """Up to k greedy guesses for each request (fewer where the draft cache is full)."""
        live = {r.request_id for r in requests}
        for rid in [rid for rid in self.mirrors if rid not in live]:
            self.release(rid)
        if not requests or k <= 0:
            return {}
        plan, mirrors = [], []
        for req in requests:
            mirror = self._sync(req)
            n = len(mirror.prompt_token_ids) - mirror.num_computed_tokens
            if not self.blocks.allocate(mirror, n + k - 1):
                continue
            start = mirror.num_computed_tokens
            plan.append(ScheduledRequest(req.request_id, start,
                                         mirror.prompt_token_ids[start:], list(mirror.block_ids),
                                         True))
            mirrors.append(mirror)
        drafts: dict[str, list[int]] = {m.request_id: [] for m in mirrors}
        started, forwards = time.perf_counter(), 0
        for step in range(k):
            if not plan:
                break
            logits = self.runner.execute(SchedulerOutput(scheduled=plan))
            self.forwards += 1
            forwards += 1
            guesses = logits.argmax(dim=-1).tolist()
            next_plan = []
            for s, mirror, guess in zip(plan, mirrors, guesses):
                mirror.num_computed_tokens = s.start + len(s.token_ids)
                drafts[mirror.request_id].append(guess)
                mirror.prompt_token_ids.append(guess)  # the mirror's tokens: context + guesses
                next_plan.append(ScheduledRequest(s.request_id, mirror.num_computed_tokens,
                                                  [guess], list(mirror.block_ids), True))
            plan = next_plan if step < k - 1 else []
        for mirror in mirrors:  # the last guess was never fed: it is not in the draft's KV
            mirror.prompt_token_ids.pop()
        if forwards:
            per_guess = (time.perf_counter() - started) / (forwards * len(mirrors))
            self.guess_s = per_guess if not self.guess_s else 0.8 * self.guess_s + 0.2 * per_guess
        return drafts

    def _sync(self, req: Request) -> Request:
        """The request's mirror, its tokens the request's own and its KV kept for the longest
        common prefix of what it had cached (the context and earlier guesses)."""
        tokens = req.all_token_ids
        mirror = self.mirrors.get(req.request_id)
        if mirror is None:
            mirror = self.mirrors[req.request_id] = Request(req.request_id, [], _GREEDY)
            mirror.num_cached_tokens = 0  # here: leading tokens known to equal the request's
        cached = mirror.prompt_token_ids
        limit = min(mirror.num_computed_tokens, len(tokens) - 1)  # the last token is fed again
        same = min(mirror.num_cached_tokens, limit)  # a request's tokens only ever grow
        while same < limit and cached[same] == tokens[same]:
            same += 1
        mirror.num_computed_tokens = same
        mirror.num_cached_tokens = len(tokens)
        mirror.prompt_token_ids = list(tokens)
        return mirror

    def release(self, request_id: str) -> None:
        mirror = self.mirrors.pop(request_id, None)
        if mirror is not None:
            self.blocks.free(mirror)
