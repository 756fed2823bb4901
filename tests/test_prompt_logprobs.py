"""Logprobs of a prompt's own tokens (completions with echo and logprobs): transformers' values,
the same with chunked prefill, never served from the prefix cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pd_runtime import LLM, SamplingParams
from pd_runtime.api import InvalidRequestError
from pd_runtime.engine.sampling import prompt_logprobs

PROMPT = [5 + (13 * i) % 400 for i in range(70)]


@pytest.fixture(scope="module")
def reference(llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("chunk, slice_rows", [(2048, 256), (2048, 7), (16, 7)])
def test_prompt_logprobs_are_transformers(llama_dir, reference, chunk, slice_rows, monkeypatch):
    monkeypatch.setattr(prompt_logprobs, "_SLICE_ROWS", slice_rows)
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64, max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    out = llm.generate([PROMPT], params)[0]
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    for p in range(1, len(PROMPT)):
        entry = entries[p]  # vLLM's shape: the prompt token first, then the top-n by rank
        assert list(entry)[0] == PROMPT[p]
        logprob, rank = entry[PROMPT[p]].logprob, entry[PROMPT[p]].rank
        top = {t: v.logprob for t, v in sorted(entry.items(), key=lambda tv: tv[1].rank)[:2]}
        assert abs(logprob - reference[p - 1, PROMPT[p]].item()) < 1e-4
        row, mine = reference[p - 1], reference[p - 1, PROMPT[p]]  # ties within rounding
        assert 1 + int((row > mine + 1e-4).sum()) <= rank <= 1 + int((row > mine - 1e-4).sum())
        assert rank > 1 or PROMPT[p] == next(iter(top))
        values, ids = reference[p - 1].topk(2)
        assert list(top) == ids.tolist()
        assert max(abs(a - b) for a, b in zip(top.values(), values.tolist())) < 1e-4
    # The generated tokens are those of the same request without prompt logprobs.
    plain = llm.generate([PROMPT], SamplingParams(max_tokens=3, temperature=0,
                                                  ignore_eos=True))[0]
    assert out.token_ids == plain.token_ids
    # The plain request cached the prompt's blocks; scoring it again computes every position.
    again = llm.generate([PROMPT], params)[0]
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == entries
    assert llm.engine.block_manager.num_free_blocks == 64


def test_a_one_token_prompt_has_its_one_entry(llama_dir):
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    out = llm.generate([[5]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None] and len(out.token_ids) == 2


def test_prompt_logprobs_validated():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.param == "prompt_logprobs"
