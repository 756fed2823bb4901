"""The offline `LLM` as a vLLM script uses it: its engine arguments by vLLM's names, and
`generate` returning vLLM's RequestOutput shape (`outputs[0].text`), the same tokens either
way."""

from __future__ import annotations

import pytest
import torch

from pd_runtime import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams


def test_a_vllm_script_runs_unchanged(llama_dir):
    llm = LLM(model=llama_dir, tensor_parallel_size=1, trust_remote_code=True,
              enforce_eager=True, gpu_memory_utilization=0.9, swap_space=1, dtype=torch.float32,
              max_model_len=512, seed=0, disable_log_stats=True, tokenizer=llama_dir,
              num_kv_blocks=64)
    config = llm.engine.config
    assert (config.cuda_graphs, config.gpu_memory_utilization, config.swap_space_bytes,
            config.dtype, config.max_model_len) == (False, 0.9, 1 << 30, "float32", 512)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    prompts = ["Hello, my name is", llm.tokenizer.encode("The capital of France is")]
    outputs = llm.generate(prompts, params)
    assert [type(o) for o in outputs] == [RequestOutput, RequestOutput]
    for prompt, output in zip(prompts, outputs):
        (completion,) = output.outputs
        assert isinstance(completion, CompletionOutput) and completion.index == 0
        assert output.finished and completion.finish_reason == "length"
        assert len(completion.token_ids) == 8 and len(completion.logprobs) == 8
        assert completion.text == llm.tokenizer.decode(completion.token_ids)
        # the first output's fields, read off the request as this API returned them before
        assert (output.text, output.token_ids, output.finish_reason, output.logprobs) == \
            (completion.text, completion.token_ids, completion.finish_reason,
             completion.logprobs)
        if isinstance(prompt, str):
            assert output.prompt == prompt
            assert output.prompt_token_ids == llm.tokenizer.encode(prompt)
        else:
            assert output.prompt is None and output.prompt_token_ids == prompt
    assert outputs[0].request_id != outputs[1].request_id
    # The same greedy tokens as an engine built by our own names.
    ours = LLM(llama_dir, cuda_graphs=False, dtype="float32", max_model_len=512,
               num_kv_blocks=64).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in outputs]


def test_vllm_prompt_dicts_chat_prompts_and_cumulative_logprobs(llama_dir, tmp_path):
    from pathlib import Path

    llm = LLM(Path(llama_dir), tokenizer=Path(llama_dir + "/"), enable_chunked_prefill=True,
              dtype="float32", num_kv_blocks=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    text, ids = "Hello there", llm.tokenizer.encode("Hello there")
    plain = llm.generate([text, ids], greedy)
    dicts = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}], greedy)
    one = llm.generate({"prompt": text}, greedy)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain] == \
        [one[0].token_ids, plain[1].token_ids]
    assert dicts[0].prompt == text and dicts[1].prompt is None
    with pytest.raises(ValueError, match="a prompt dict holds one of"):
        llm.generate({"text": text}, greedy)
    completion = plain[0].outputs[0]
    assert completion.cumulative_logprob == pytest.approx(sum(
        entry[token].logprob for token, entry in zip(completion.token_ids, completion.logprobs)))
    assert completion.cumulative_logprob < 0
    assert llm.generate(text, SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob \
        is None
    messages = [{"role": "user", "content": "Hi"}]
    chat = llm.chat(messages, greedy)[0]
    assert chat.prompt == llm.tokenizer.apply_chat_template(messages)
    assert chat.prompt_token_ids == llm.tokenizer.encode_chat(messages)


def test_logprobs_are_vllm_logprob_objects(llama_dir):
    """Per position {token id: Logprob(logprob, rank, decoded_token)}: the position's token
    first, with its rank among the raw logits (also when it was drawn far down), then the
    top-n ranked 1..n; prompt_logprobs alike, None for the first prompt token."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    text = llm.tokenizer.token_text
    hot = SamplingParams(temperature=3.0, seed=7, max_tokens=24, logprobs=2, prompt_logprobs=1)
    out = llm.generate("Once upon a time", hot)[0]
    completion = out.outputs[0]
    ranks = []
    for token, entry in zip(completion.token_ids, completion.logprobs):
        assert list(entry)[0] == token and all(isinstance(v, Logprob) for v in entry.values())
        assert entry[token].decoded_token == text(token)
        ranked = sorted(entry.values(), key=lambda v: v.rank)
        assert [v.rank for v in ranked][:2] == [1, 2]
        assert len(entry) == (2 if entry[token].rank <= 2 else 3)
        assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        ranks.append(entry[token].rank)
    assert max(ranks) > 2  # a hot draw left the top two: the rank was read, not assumed
    assert out.prompt_logprobs[0] is None
    for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert list(entry)[0] == token and entry[token].decoded_token == text(token)
        assert (entry[token].rank == 1) == (len(entry) == 1)


def test_stop_reason_names_the_stop_string_or_token(llama_dir):
    """As vLLM's: the stop string matched, the stop token id sampled, None for EOS or length."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    free = llm.generate("The weather today", SamplingParams(temperature=0, max_tokens=12,
                                                           ignore_eos=True))[0].outputs[0]
    assert (free.finish_reason, free.stop_reason) == ("length", None)
    word = free.text[len(free.text) // 2:len(free.text) // 2 + 3]
    by_string = llm.generate("The weather today", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=["\x00never", word]))[0].outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", word)
    assert by_string.text == free.text[:free.text.index(word)]
    token = free.token_ids[5]
    by_token = llm.generate("The weather today", SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[token]))[0].outputs[0]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    assert by_token.token_ids == free.token_ids[:free.token_ids.index(token) + 1]
    # EOS: the tokenizer's own is no stop token (null); another generation_config names (the
    # chat end, <|im_end|> here) is reported as the token it is, as vLLM reports it.
    own = llm.tokenizer.eos_token_id
    other = min(llm.tokenizer.eos_token_ids - {own})
    for eos, want in ((own, None), (other, other)):
        ended = llm.generate("The weather today", SamplingParams(
            temperature=0, max_tokens=12, logit_bias={eos: 100}))[0].outputs[0]
        assert (ended.token_ids, ended.finish_reason, ended.stop_reason) == ([eos], "stop", want)


def test_get_tokenizer_is_transformers_tokenizer_as_vllm_returns_it(llama_dir):
    """A vLLM script renders its chat prompt with llm.get_tokenizer(): the ids it gets are the
    ones llm.chat renders, so both give the same tokens."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=64)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.get_tokenizer() and type(tokenizer).__module__.startswith("transformers")
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(ids, list):  # (transformers 5 returns a BatchEncoding)
        ids = ids["input_ids"]
    assert ids == llm.tokenizer.encode_chat(messages)
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    assert llm.generate({"prompt_token_ids": ids}, greedy)[0].outputs[0].token_ids == \
        llm.chat(messages, greedy)[0].outputs[0].token_ids
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == llm.tokenizer.apply_chat_template(messages)


@pytest.mark.parametrize("args, says", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tokenizer": "/some/other/tokenizer"}, "tokenizer: '/some/other/tokenizer'"),
    ({"swap_space": -1}, "swap_space: -1 GiB is not a size"),
    ({"quantization": "awq"}, "quantization"),  # vLLM has it, we do not: named, not ignored
    ({"enable_chunked_prefill": False}, "enable_chunked_prefill: prompts are always chunked"),
])
def test_vllm_arguments_that_ask_for_more_are_refused_by_name(llama_dir, args, says):
    with pytest.raises(ValueError, match=says):
        LLM(llama_dir, **args)


def test_n_sequences_per_prompt_as_the_server_draws_them(llama_dir):
    """SamplingParams(n=3, seed=s): three outputs per prompt, choice i drawn with seed s + i,
    as the server's n draws them (pd_runtime/entrypoints/openai/request_parsing/protocol.py); unseeded, three
    draws."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=128)
    prompts = ["Once upon a time", "The weather today"]
    many = llm.generate(prompts, SamplingParams(n=3, seed=5, temperature=1.0, max_tokens=12,
                                                logprobs=1))
    assert [len(o.outputs) for o in many] == [3, 3]
    for prompt, output in zip(prompts, many):
        assert [c.index for c in output.outputs] == [0, 1, 2] and output.finished
        alone = [llm.generate(prompt, SamplingParams(seed=5 + i, temperature=1.0,
                                                     max_tokens=12))[0].outputs[0].token_ids
                 for i in range(3)]
        assert [c.token_ids for c in output.outputs] == alone
        assert all(len(c.logprobs) == len(c.token_ids) for c in output.outputs)
    assert len({tuple(c.token_ids) for c in many[0].outputs}) > 1  # the seeds differ
    unseeded = llm.generate(prompts[0], SamplingParams(n=2, temperature=1.0, max_tokens=4))
    assert len(unseeded[0].outputs) == 2
    with pytest.raises(ValueError, match="n must be an integer in"):
        SamplingParams(n=0)
    from pd_runtime.api import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="an engine request is one sequence"):
        llm.engine.add_request("direct", "x", SamplingParams(n=2))
