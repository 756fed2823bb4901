"""The engine step loop: admit requests, schedule, run the model, sample, detokenize, finish.

Requests are added, stepped and aborted individually; each `step()` returns the new tokens
and text of every request that progressed, which the offline API and the workers stream out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Optional, Union

import torch

from pd_runtime.api import (EngineOverloadedError, InvalidRequestError, RequestTooLargeError,
                            SamplingParams, bad_word_spellings)
from pd_runtime.config import EngineConfig
from pd_runtime.engine import tp_ranks
from pd_runtime.engine.sampling import prompt_logprobs
from pd_runtime.engine.kv_cache.block_manager import BlockManager
from pd_runtime.engine.kv_cache.tiers import KVTiers
from pd_runtime.engine.detokenizer import detokenize_step
from pd_runtime.engine.sampling.grammar import GrammarMasks
from pd_runtime.engine.model_runner import ModelRunner
from pd_runtime.engine.outputs import RequestOutput, apply_stop_strings, merged  # noqa: F401
from pd_runtime.engine.remote_kv import RemoteKV
from pd_runtime.engine.sampling.sampler import SampleResult, Sampler
from pd_runtime.engine.scheduler import Scheduler
from pd_runtime.engine.step_costs import StepCostModel, StepWork
from pd_runtime.engine.sequence import FinishReason, Request, RequestStatus
from pd_runtime.engine.spec_decode.speculative import Speculator
from pd_runtime.engine.kv_cache.swap_space import SwapSpace
from pd_runtime.sampling_defaults import read_sampling_defaults
from pd_runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, tp=None, launch_ranks=None):
        """`tp`: this engine's tensor-parallel group (driver rank), whose followers run
        elsewhere; None with tensor_parallel_size > 1 starts them with `launch_ranks`
        (engine/tp_ranks.py; default: local processes)."""
        self.config = config
        threads = tp_ranks.threads_per_rank(config)
        if threads:
            torch.set_num_threads(threads)
        from pd_runtime.model.model_config import context_limit, load_model_config, served

        model_config = load_model_config(config.model)
        self.max_model_len = context_limit(model_config, config.max_model_len, config.model)
        self.model_config = served(model_config, self.max_model_len)
        self.tokenizer = Tokenizer(config.model)
        # What a request that leaves a sampling field out gets (the router applies them).
        self.sampling_defaults = read_sampling_defaults(config.model)
        self._local_ranks = tp_ranks.start(config, self.model_config, self.max_model_len,
                                           launch_ranks) if tp is None else None
        if self._local_ranks is not None:
            tp = self._local_ranks.group
        try:
            self.runner = ModelRunner(config, self.max_model_len, tp)
        except BaseException:
            if self._local_ranks is not None:
                self._local_ranks.close()
            raise
        self.kv_tiers = KVTiers.for_engine(
            self.runner.kv_cache, config.kv_offloading_size, config.kv_offloading_disk_size,
            config.kv_offloading_disk_dir)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size,
                                          self.model_config.identity,
                                          config.enable_prefix_caching, self.kv_tiers)
        swap = SwapSpace(self.runner.num_swap_blocks) \
            if config.preemption_mode == "swap" else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_batched_tokens,
                                   config.max_num_seqs, self.max_model_len,
                                   config.priority_aging_steps, swap)
        self.requests: dict[str, Request] = {}
        self.remote = RemoteKV(self)  # disaggregation: reserved blocks, held blocks
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.sampler = Sampler(config.seed, config.device, self.eos_token_ids)
        self.grammars = GrammarMasks(self.tokenizer, self.model_config.vocab_size)
        self.num_steps = 0
        self.speculator = None
        if config.speculative_method == "ngram":
            self.speculator = Speculator(config)
        elif config.speculative_method == "draft":
            from pd_runtime.engine.spec_decode.draft_model import DraftModel

            self.speculator = Speculator(config, DraftModel(
                config, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                self.runner.num_blocks))
        self.step_costs = StepCostModel()  # what a step costs here, for routing and /metrics
        # Tokens of the last step by kind, for load reports and benchmarks.
        self.last_step_prefill_tokens = 0
        self.last_step_decode_tokens = 0

    # -- intake ------------------------------------------------------------------------------
    def tokenize_prompt(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
            vocab = self.model_config.vocab_size
            if any(t < 0 or t >= vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})",
                                          param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids",
                                      param="prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return ids

    def add_request(self, request_id: str, prompt: Union[str, list[int]],
                    params: Optional[SamplingParams] = None, priority: int = 0,
                    cache_salt: Optional[str] = None, hold_blocks: bool = False,
                    resume_output_ids: Optional[list[int]] = None,
                    resume_text_len: Optional[int] = None, layer_sink=None) -> Request:
        """Queue a request. `hold_blocks`: keep its KV blocks when it finishes (a prefill worker
        ships them), until `remote.release_held(request_id)`. `resume_output_ids`: tokens a
        lost worker already streamed; generation continues after them as if it had never stopped (they
        count toward max_tokens, seeded sampling skips their draws). `resume_text_len`: how
        many characters of their text the client already has (None: all of it); text held
        back there (a partial UTF-8 character, a possible stop string) is sent from here.
        `layer_sink(layer, block_ids)`: called in the step that completes the prompt, as each
        layer's K/V land in the cache (a prefill worker ships them while later layers compute).
        """
        req = self._new_request(request_id, prompt, params, priority, cache_salt)
        if resume_output_ids:
            if len(resume_output_ids) >= req.params.max_tokens:
                raise InvalidRequestError("nothing left to generate after the resumed tokens",
                                          param="max_tokens")
            # Token by token, as the lost worker did: the same ids give the same text.
            for token in resume_output_ids:
                req.output_token_ids.append(token)
                detokenize_step(self.tokenizer, req)
            req.emitted_len = len(req.text) if resume_text_len is None else \
                min(resume_text_len, len(req.text))
            if req.generator is not None and not req.params.greedy:
                for _ in resume_output_ids:
                    Sampler.skip_draw(req.generator, self.model_config.vocab_size)
        sched = self.scheduler
        if len(sched.waiting) >= self.config.max_waiting_requests or \
                sched.num_waiting_tokens + req.num_prompt_tokens > self.config.max_waiting_tokens:
            raise EngineOverloadedError(
                f"engine queue is full ({len(sched.waiting)} requests waiting)",
                retry_after_s=1.0)
        req.hold_blocks = hold_blocks
        req.layer_sink = layer_sink
        self.requests[request_id] = req
        sched.add(req)
        return req

    def _new_request(self, request_id: str, prompt: Union[str, list[int]],
                     params: Optional[SamplingParams], priority: int,
                     cache_salt: Optional[str]) -> Request:
        """Validate everything before anything is allocated; returns an unqueued request.
        The sampling parameters themselves were judged when they were made (SamplingParams);
        what is checked here is what only this engine knows (its vocabulary, its context)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise InvalidRequestError("n: an engine request is one sequence; LLM.generate and "
                                      "the server run n requests", param="n")
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      param="request_id")
        vocab = self.model_config.vocab_size
        if params.logit_bias and any(t >= vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})",
                                      param="logit_bias")
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise InvalidRequestError(f"allowed_token_ids must be in [0, {vocab})",
                                      param="allowed_token_ids")
        if params.bad_words and params.bad_words_token_ids is None:  # an offline caller's
            params = replace(params, bad_words_token_ids=bad_word_spellings(
                params.bad_words, lambda text: self.tokenizer.encode(text, False)))
        if params.allowed_token_ids is not None:
            # What rules a token out from the first step on: a one-token bad word, and EOS
            # and the stop ids while min_tokens holds them back. Nothing left is a request
            # that cannot choose its first token.
            out = {ids[0] for ids in params.bad_words_token_ids or () if len(ids) == 1}
            if params.min_tokens:
                out |= set(params.stop_token_ids) | self.eos_token_ids
            if out.issuperset(params.allowed_token_ids):
                raise InvalidRequestError(
                    "allowed_token_ids: every one is ruled out by bad_words" + (
                        " or, until min_tokens, as EOS or a stop token" if params.min_tokens
                        else ""), param="allowed_token_ids")
        ids = self.tokenize_prompt(prompt)
        if len(ids) >= self.max_model_len:
            raise RequestTooLargeError(
                f"prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                f"(max_model_len) including at least one generated token", param="prompt")
        # Blocks the request needs at its longest; beyond the whole cache it could never run.
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_needed(longest) > self.block_manager.num_blocks:
            raise RequestTooLargeError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs "
                f"{self.block_manager.blocks_needed(longest)} KV blocks; this worker has "
                f"{self.block_manager.num_blocks}", param="max_tokens")
        if params.prompt_logprobs is not None:
            cache_salt = prompt_logprobs.isolating_salt(cache_salt, request_id)
        req = Request(request_id, ids, params, self.eos_token_ids, priority, cache_salt,
                      prompt=prompt if isinstance(prompt, str) else None)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        if params.seed is not None:
            req.generator = Sampler.make_generator(params.seed, self.config.device)
        req.grammar = self.grammars.start(params)
        return req

    def abort(self, request_id: str) -> bool:
        """Drop a request and release all its blocks now (queued, running, swapped, waiting for
        remote KV or held for a transfer); False if it is unknown or already released."""
        req = self.requests.pop(request_id, None) or self.remote.held.pop(request_id, None)
        self.remote.waiting.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = FinishReason.ABORT
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something a step would compute (requests waiting for remote KV are not work)."""
        return bool(self.scheduler.running or self.scheduler.waiting)

    def warm_up(self, prompt_tokens: int) -> float:
        """Throwaway requests before serving: a short one pays the first-use costs (native
        kernel build or load, allocations) and is forgotten, then one of `prompt_tokens` and
        one of a quarter of that, whose steps seed the cost model. Their blocks are salted (no
        request can hit them) and stay only as evictable cache. Returns the seconds it took."""
        import random

        started = time.perf_counter()
        block_size = self.block_manager.block_size
        n = min(prompt_tokens, self.max_model_len - 8,
                (self.block_manager.num_blocks - 2) * block_size)
        if n < 2 or self.has_work():
            return 0.0
        rng = random.Random(0)
        vocab = self.model_config.vocab_size
        # A long and a short prompt: the cost model tells the quadratic attention term from
        # the linear one only with both.
        for i, length in enumerate((min(n, 2 * block_size), n, max(2, n // 4))):
            prompt = [rng.randrange(vocab) for _ in range(length)]
            self.add_request(f"warm-up-{i}", prompt,
                             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                             cache_salt="pd-runtime-warm-up")
            while self.has_work():
                self.step()
            if i == 0:
                self.step_costs = StepCostModel()
        self.step_costs.forget_recent()  # the fit stays; the step-time average starts anew
        self.block_manager.stats = type(self.block_manager.stats)()
        self.num_steps = 0
        return time.perf_counter() - started

    # -- the step ----------------------------------------------------------------------------
    def _layer_hook(self, plan):
        """The per-layer callback of a step that completes prompts with a layer sink, or None."""
        sinks = [(req.layer_sink, req.block_ids) for req in
                 (self.requests[s.request_id] for s in plan.scheduled if s.sample)
                 if req.layer_sink is not None and not req.output_token_ids]
        if not sinks:
            return None

        def on_layer(layer: int) -> None:
            for sink, block_ids in sinks:
                sink(layer, block_ids)
        return on_layer

    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.speculator is not None:
            self.speculator.plan_step(self.step_costs.coefficients(), self.scheduler.running)
        plan = self.scheduler.schedule(self._prompt_budget(),
                                       self._draft if self.speculator else None)
        if self._local_ranks is not None and (plan.scheduled or plan.swap_out):
            self._local_ranks.check_alive()  # a lost rank fails the step before it starts
        if not plan.scheduled:
            if plan.swap_out:
                self.runner.execute(plan)
            if plan.waiting_on_disk:
                time.sleep(2e-4)  # nothing else to do: no spinning while the reads run
            return []
        self.num_steps += 1
        work = StepWork()
        for s in plan.scheduled:
            n = len(s.token_ids)
            if n == 1:
                work.decode_seqs += 1
                work.decode_context += s.start + 1
            else:
                work.prefill_tokens += n
                work.prefill_attention += n * s.start + n * (n + 1) // 2
        self.last_step_decode_tokens = work.decode_seqs
        self.last_step_prefill_tokens = work.prefill_tokens
        whole = prompt_logprobs.chunks_wanting_rows(plan.scheduled, self.requests)
        logits = self.runner.execute(plan, self._layer_hook(plan), tuple(whole))
        sampled = [(self.requests[s.request_id], s) for s in plan.scheduled if s.sample]
        if whole:
            prompt_logprobs.record(whole, self.requests, self.runner.whole_hidden,
                                   self.runner.model.compute_logits)
            self.runner.whole_hidden = None
        result = self._sample(logits, sampled) if sampled else None
        now = time.monotonic()
        for s in plan.scheduled:
            req = self.requests[s.request_id]
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            if not s.draft_ids:  # a verification's computed tokens are the ones it keeps
                req.num_computed_tokens += len(s.token_ids)
                self.block_manager.cache_full_blocks(req)
        outputs, row = [], 0
        for req, s in sampled:
            k = len(s.draft_ids)
            tokens = result.token_ids[row:row + k + 1]
            if k:
                tokens = self.speculator.verify(req, s.draft_ids, tokens)
                # The last token's KV now; the kept drafts' once they are in the context
                # (below), so the prefix cache never sees a rejected guess.
                req.num_computed_tokens += 1
                self.block_manager.cache_full_blocks(req)
                kept = row + len(tokens) - 1
                if len(tokens) <= k and kept in (result.generator_states or {}):
                    req.generator.set_state(result.generator_states[kept])
            out = None
            for j, token in enumerate(tokens):
                req.output_token_ids.append(token)
                if req.first_token_time is None:
                    req.first_token_time = now
                lp = result.logprobs[row + j]
                if lp is not None:
                    req.logprobs.append(lp)
                out = merged(out, self._finish_token(req, token, lp))
                if out.finished:
                    break
            if k and not out.finished:
                req.num_computed_tokens += len(tokens) - 1
            outputs.append(out)
            row += k + 1
        self.step_costs.observe(work, time.perf_counter() - started)
        return outputs

    def _sample(self, logits: torch.Tensor, sampled: list) -> SampleResult:
        """One row per sampled request, and with drafts one more per draft: each row with the
        history up to its position, a seeded request's rows drawing from its generator in
        order (whose state after each draft row is kept, to put back what a rejection
        discards)."""
        params, generators, histories, constrained, keep = [], [], [], [], set()
        for req, s in sampled:
            if req.grammar is not None:  # one row: such a request is given no drafts
                constrained.append((len(params), req))
            for j in range(len(s.draft_ids) + 1):
                if j and req.generator is not None and not req.params.greedy:
                    keep.add(len(params) - 1)
                params.append(req.params)
                generators.append(req.generator)
                histories.append((req.prompt_token_ids, req.output_token_ids + s.draft_ids[:j]
                                  if j and req.params.adjusts_logits else req.output_token_ids))
        self.grammars.mask(logits, constrained)
        if keep:
            return self.sampler(logits, params, generators, histories, keep_states=keep)
        return self.sampler(logits, params, generators, histories)

    def _draft(self, req: Request, budget: int) -> list[int]:
        if req.grammar is not None:
            return []
        return self.speculator.draft(req, budget, self.max_model_len)

    def _prompt_budget(self) -> Optional[int]:
        """Prompt tokens this step may take so that, with the sequences decoding, it stays
        within config.step_time_target_s as the step-cost model predicts (None: no limit).
        At least one block, so prompts always progress."""
        target = self.config.step_time_target_s
        if not target:
            return None
        decoding = [r for r in self.scheduler.running
                    if r.num_tokens - r.num_computed_tokens == 1]
        if not decoding:
            return None
        costs = self.step_costs
        spare = target - costs.predict(StepWork(decode_seqs=len(decoding), decode_context=sum(
            r.num_tokens for r in decoding)))
        per_token = costs.coefficients()["prefill_token_s"]
        floor = self.block_manager.block_size
        if per_token <= 0:
            return None
        return max(floor, int(spare / per_token)) if spare > 0 else floor

    def _finish_token(self, req: Request, token: int, logprob) -> RequestOutput:
        params = req.params
        reason, stop_reason = None, None
        # Under a grammar, EOS is only ever allowed where the grammar is complete: it ends the
        # request even under ignore_eos (not while a reasoning model's thinking is left free).
        if token in req.eos_token_ids and (not params.ignore_eos or (
                req.grammar is not None and not req.grammar.end_ids)):
            # vLLM reports a generation_config EOS other than the tokenizer's own as the stop
            # token it is (it adds them to stop_token_ids).
            reason = FinishReason.STOP
            stop_reason = None if token == self.tokenizer.eos_token_id else token
        elif token in params.stop_token_ids:
            reason, stop_reason = FinishReason.STOP, token
        elif len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.max_model_len:
            reason = FinishReason.LENGTH
        text_before = len(req.text)
        # A stop token's own text is left out (as vLLM leaves it out), and so are the bytes of
        # a character it would have completed: no U+FFFD at the end for it.
        drop = reason is FinishReason.STOP and not params.include_stop_str_in_output
        detokenize_step(self.tokenizer, req, flush=reason is not None and not drop,
                        drop_last=drop)
        # As vLLM: stop strings only in the text after the first min_tokens tokens.
        if params.stop and len(req.output_token_ids) > params.min_tokens:
            matched = apply_stop_strings(req, text_before)
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
        # Streamed text holds back a tail that could still grow into a stop string, so no
        # delta ever carries text the final answer cuts off.
        safe = len(req.text)
        if reason is None and params.stop:
            safe = max(req.emitted_len, safe - max(len(s) for s in params.stop) + 1)
        new_text, req.emitted_len = req.text[req.emitted_len:safe], safe
        if reason is not None:
            req.status = RequestStatus.FINISHED
            req.finish_reason = reason
            self.requests.pop(req.request_id, None)
            if req.hold_blocks:
                self.scheduler.detach(req)
                self.remote.held[req.request_id] = req
            else:
                self.scheduler.remove(req)
        return RequestOutput(
            request_id=req.request_id, new_token_ids=[token], new_text=new_text,
            token_ids=list(req.output_token_ids), text=req.text, finished=reason is not None,
            finish_reason=reason.value if reason else None, stop_reason=stop_reason,
            new_logprobs=[logprob] if logprob is not None else None,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
            prompt_token_ids=req.prompt_token_ids,
            prompt_logprobs=req.prompt_logprobs if len(req.output_token_ids) == 1 else None,
            queue_s=(req.first_scheduled_time - req.arrival_time)
            if reason is not None and req.first_scheduled_time is not None else None)

    def rank_pids(self) -> list[int]:
        """The processes of this engine's follower ranks started here (none at one rank)."""
        return self._local_ranks.pids if self._local_ranks else []

    def close(self) -> None:
        """Stop the tensor-parallel followers (nothing to do at one rank); the engine takes no
        steps after."""
        self.runner.stop_followers()
        if self._local_ranks is not None:
            self._local_ranks.close()
        if self.kv_tiers is not None:
            self.kv_tiers.close()

    def reset_prefix_cache(self) -> int:
        """Empty the prefix cache (block_manager.reset_prefix_cache); the blocks it forgot."""
        forgotten = self.block_manager.reset_prefix_cache()
        log.info("prefix cache reset: %d cached blocks forgotten", forgotten)
        return forgotten

    def load_report(self) -> dict:
        """Cheap numbers for routing: queues, queued prefill tokens, KV blocks, cache hits."""
        sched, bm = self.scheduler, self.block_manager
        queued_prefill = sum(r.num_tokens - r.num_computed_tokens for r in sched.waiting) + \
            sum(r.num_tokens - r.num_computed_tokens - 1 for r in sched.running
                if r.num_tokens - r.num_computed_tokens > 1)
        return {
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting) + len(self.remote.waiting),
            "queued_prefill_tokens": queued_prefill,
            "free_blocks": bm.num_free_blocks,
            "total_blocks": bm.num_blocks,
            "held_blocks": sum(len(r.block_ids) for r in self.remote.held.values()),
            "prefix_queried_tokens": bm.stats.queried_tokens,
            "prefix_hit_tokens": bm.stats.hit_tokens,
            "num_preemptions": sched.num_preemptions,
            "num_steps": self.num_steps,
            "running_context_tokens": sum(r.num_tokens for r in sched.running),
            "step_costs": self.step_costs.report(),
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "kv_bytes_per_token": self.runner.kv_bytes_per_token,
            "block_size": bm.block_size,
            "speculation": self.speculator.stats.report() if self.speculator else None,
            "kv_tiers": self.kv_tiers.report() if self.kv_tiers else None,
        }

