"""Offline API: `LLM(model=PATH).generate(prompts, sampling_params)` over the engine loop."""

from __future__ import annotations

import copy
import itertools
import os
import sys
import time
from dataclasses import replace
from typing import Optional, Sequence, Union

from pd_runtime.api import SamplingParams
from pd_runtime.beam_search import MAX_WIDTH, BeamSpec, Search
from pd_runtime.config import EngineConfig
from pd_runtime.engine.engine import LLMEngine
# The offline result is the engine's RequestOutput gathered (outputs.py): one shape for both.
from pd_runtime.engine.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: F401

Prompt = Union[str, list[int]]


class LLM:
    def __init__(self, model: str, **engine_args):
        """`engine_args`: EngineConfig's fields, and vLLM's names for what they share
        (enforce_eager, swap_space in GiB, tensor_parallel_size, trust_remote_code;
        pd_runtime/serve_flags.py)."""
        from pd_runtime.serve_flags import engine_fields

        model = os.fspath(model)  # a pathlib.Path too
        self.engine = LLMEngine(EngineConfig(model=model, **engine_fields(model, engine_args)))
        self.tokenizer = self.engine.tokenizer
        self._hf_tokenizer = None
        self._ids = itertools.count()

    def get_tokenizer(self):
        """The model's tokenizer as transformers loads it from the model directory (what vLLM's
        LLM.get_tokenizer returns: scripts call its apply_chat_template, encode, decode); the
        engine's own is `llm.tokenizer`."""
        if self._hf_tokenizer is None:
            from transformers import AutoTokenizer

            self._hf_tokenizer = AutoTokenizer.from_pretrained(self.engine.config.model)
        return self._hf_tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache, as vLLM's LLM.reset_prefix_cache (True: it is empty now,
        whatever is running)."""
        self.engine.reset_prefix_cache()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (its generation_config.json), which
        `generate` uses when given none; an explicit SamplingParams() uses the plain ones."""
        return SamplingParams(**self.engine.sampling_defaults)

    def chat(self, messages: Union[list[dict], Sequence[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False, *, add_generation_prompt: bool = True,
             continue_final_message: bool = False,
             chat_template_kwargs: Optional[dict] = None,
             chat_template: Optional[str] = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} messages) or several, through the
        model's chat template (as the chat API renders it), or `chat_template` (Jinja text),
        then `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.tokenizer
        if chat_template is not None:
            tokenizer = copy.copy(self.tokenizer)  # shares the vocabulary, not the template
            tokenizer.use_chat_template(chat_template)
        texts = [tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                               continue_final_message=continue_final_message,
                                               **(chat_template_kwargs or {}))
                 for c in conversations]
        # As encode_chat: the template already carries any BOS.
        results = self.generate([tokenizer.encode(t, add_special_tokens=False) for t in texts],
                                sampling_params, use_tqdm)
        for result, text in zip(results, texts):
            result.prompt = text  # the rendered conversation, as vLLM reports it
        return results

    def beam_search(self, prompts: Union[Prompt, Sequence[Prompt]], beam_width: int,
                    max_tokens: int, *, length_penalty: float = 1.0, ignore_eos: bool = False,
                    include_stop_str_in_output: bool = False) -> list[list[CompletionOutput]]:
        """Per prompt, its `beam_width` best beams, best first (pd_runtime/beam_search.py, the
        search the server's `use_beam_search` runs; vLLM's LLM.beam_search): every prompt's
        live beams are one engine batch a step. `finish_reason` "stop" for a beam that ended
        in EOS (its EOS in `token_ids` only with include_stop_str_in_output), else "length"."""
        if not 1 <= beam_width <= MAX_WIDTH:
            raise ValueError(f"beam_width must be in [1, {MAX_WIDTH}], got {beam_width}")
        ids = [self.engine.tokenize_prompt(p) for p in _prompt_list(prompts)]
        spec = BeamSpec(beam_width, float(length_penalty), include_stop_str_in_output)
        runs = [Search(p, spec, max_tokens, self.tokenizer.eos_token_ids, ignore_eos)
                for p in ids]
        step = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * beam_width,
                              ignore_eos=True)
        while any(asks := [run.prompts() for run in runs]):
            flat = [p for ask in asks for p in ask]
            tops = iter([{t: lp.logprob for t, lp in out.logprobs[0].items()}
                         for out in self.generate(flat, step)])
            for run, ask in zip(runs, asks):
                if ask:
                    run.advance([next(tops) for _ in ask])
        results = []
        for prompt, run in zip(ids, runs):
            beams = []
            for beam in run.best():
                tokens = beam.tokens + ([beam.eos] if beam.eos is not None
                                        and include_stop_str_in_output else [])
                beams.append(CompletionOutput(len(beams), self.tokenizer.decode(tokens), tokens,
                                              "stop" if beam.eos is not None else "length"))
            results.append(beams)
        return results

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        engine = self.engine
        results: list[RequestOutput] = []
        running: dict[str, tuple[RequestOutput, CompletionOutput]] = {}  # engine request id
        try:
            for prompt, params in zip(prompts, sampling_params):
                result = None
                for index, own in enumerate(_choices(params)):
                    rid = f"offline-{next(self._ids)}"
                    req = engine.add_request(rid, prompt, own)
                    if result is None:
                        result = RequestOutput(
                            rid, prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=req.prompt_token_ids,
                            num_prompt_tokens=len(req.prompt_token_ids))
                        results.append(result)
                    completion = CompletionOutput(
                        index, logprobs=[] if params.logprobs is not None else None)
                    if not result.outputs:  # the result's own fields are its first output's
                        result.token_ids = completion.token_ids
                    result.outputs.append(completion)
                    running[rid] = (result, completion)
        except Exception:
            for rid in running:
                engine.abort(rid)
            raise
        total, done, start = len(running), 0, time.monotonic()
        while done < total:
            for out in engine.step():
                done += self._collect(*running[out.request_id], out)
            if use_tqdm:
                print(f"\r{done}/{total} done, {time.monotonic() - start:.1f}s",
                      end="", file=sys.stderr)
        if use_tqdm:
            print(file=sys.stderr)
        return results

    def _collect(self, result: RequestOutput, completion: CompletionOutput,
                 out: RequestOutput) -> int:
        """A step's output `out` of one sequence, added to the prompt's result."""
        text = self.tokenizer.token_text
        if out.prompt_logprobs is not None and completion.index == 0:
            result.prompt_logprobs = [
                None if entry is None else _ranked(entry, token, text)
                for token, entry in zip(result.prompt_token_ids, out.prompt_logprobs)]
        completion.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            completion.logprobs.extend(_ranked(entry, token, text) for token, entry
                                       in zip(out.new_token_ids, out.new_logprobs))
        completion.text = out.text
        if completion.index == 0:
            result.num_cached_tokens, result.text = out.num_cached_tokens, out.text
        if out.finished:
            completion.finish_reason = out.finish_reason
            completion.stop_reason = out.stop_reason
            if completion.index == 0:
                result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
            result.finished = all(c.finish_reason is not None for c in result.outputs)
            return 1
        return 0


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """One prompt's n sequences as n requests: choice i seeded seed + i (the server's n)."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i)
            for i in range(params.n)]


def _prompt_list(prompts: Union[Prompt, Sequence[Prompt]]) -> list:
    """One prompt or several, as a list of prompts (text or token ids). vLLM's prompt dicts
    are taken: {"prompt": text} and {"prompt_token_ids": ids}; other keys are refused."""
    if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                            and isinstance(prompts[0], int)):
        prompts = [prompts]
    return [_prompt_of(p) for p in prompts]


def _prompt_of(prompt) -> Prompt:
    if not isinstance(prompt, dict):
        return prompt
    if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
        return prompt["prompt"]
    if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], list):
        return prompt["prompt_token_ids"]
    raise ValueError(f"a prompt dict holds one of 'prompt' (text) or 'prompt_token_ids', got "
                     f"the keys {sorted(prompt)}")


def _ranked(entry: tuple, token: int, text) -> dict[int, Logprob]:
    """An engine entry (the token's logprob, the top-n's {token: logprob}, the token's rank) as
    vLLM shows it: the token first, then the top-n ranked 1, 2, ... (the token keeps its own)."""
    logprob, top, rank = entry
    ranked = {token: Logprob(logprob, rank, text(token))}
    for place, (other, value) in enumerate(top.items(), start=1):
        ranked.setdefault(other, Logprob(value, place, text(other)))
    return ranked
