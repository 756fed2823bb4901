"""The SLO's step-time target in the scheduler (EngineConfig.step_time_target_s): while
sequences decode, a step takes only the prompt tokens the live step-cost model says fit in the
target, at least one block; the tokens themselves do not change (batch-invariant mode)."""

from __future__ import annotations

import pytest

from pd_runtime import LLM, SamplingParams
from pd_runtime.engine.step_costs import StepCostModel, StepWork

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _run(llm: LLM, prompts: list[list[int]]) -> tuple[dict, list[int]]:
    """One request decoding, then a long prompt arrives: tokens of each, and the prompt tokens
    of every step that ran while the first request was decoding."""
    engine = llm.engine
    engine.add_request("first", prompts[0], PARAMS)
    while engine.requests["first"].num_computed_tokens < len(prompts[0]):
        engine.step()
    engine.add_request("long", prompts[1], PARAMS)
    tokens, chunks = {"first": [], "long": []}, []
    while engine.has_unfinished_requests():
        decoding = "first" in engine.requests and engine.requests["first"].output_token_ids
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if decoding and engine.last_step_prefill_tokens:
            chunks.append(engine.last_step_prefill_tokens)
    return tokens, chunks


def test_prompt_chunks_shrink_to_the_step_target_and_tokens_do_not_change(llama_dir):
    prompts = [[7 + i % 400 for i in range(20)], [11 + (3 * i) % 450 for i in range(200)]]
    free = LLM(llama_dir, dtype="float32", num_kv_blocks=256)
    want, free_chunks = _run(free, prompts)
    assert free_chunks == [200]  # no target: the whole prompt in one step beside the decode

    # A target the decode alone already fills: one block of prompt per step.
    tight = LLM(llama_dir, dtype="float32", num_kv_blocks=256, step_time_target_s=1e-6)
    got, chunks = _run(tight, prompts)
    assert got == want
    block = tight.engine.block_manager.block_size
    assert len(chunks) >= 5 and all(c <= block for c in chunks)

    # A target with room for ~50 prompt tokens: chunks of about that (the model keeps learning
    # from the steps it runs, so the budget moves a little).
    costs = tight.engine.step_costs
    per_token = costs.coefficients()["prefill_token_s"]
    decode = costs.predict(StepWork(decode_seqs=1, decode_context=21))
    target = decode + 50 * per_token
    roomy = LLM(llama_dir, dtype="float32", num_kv_blocks=256, step_time_target_s=target)
    roomy.engine.step_costs = costs  # the same measured costs, so the budget is known
    got, chunks = _run(roomy, prompts)
    assert got == want
    assert len(chunks) >= 3 and max(chunks) < 100


def test_the_warm_up_seeds_the_step_cost_fit_but_not_the_recent_step_time(llama_dir):
    """The warm-up's lone prefills teach the fit what a prompt token costs; the step-time
    average the router reads as "what running requests see" starts with the first real step
    (seeded by a lone 1024-token prefill it read ~0.2 s on an idle worker, and the router's SLO
    check refused requests on it)."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=256, warmup_tokens=0)
    untouched = llm.engine.step_costs.coefficients()["prefill_token_s"]
    assert llm.engine.warm_up(512) > 0
    costs = llm.engine.step_costs
    report = costs.report()
    assert report["steps"] == 0 and report["step_s_ewma"] == 0.0 and report["busy_s"] == 0.0
    assert costs.coefficients()["prefill_token_s"] != untouched  # learned from the warm-up
    llm.generate([[5 + i for i in range(8)]], SamplingParams(max_tokens=3, temperature=0.0,
                                                           ignore_eos=True))
    report = costs.report()
    assert report["steps"] >= 3 and 0 < report["step_s_ewma"] <= report["busy_s"]


def test_a_step_of_prompts_only_is_not_a_step_streams_see(llama_dir):
    """The first request on an idle worker: its prompt's step, with no stream running, does
    not seed the step-time average the router reads as what running requests see; its decode
    steps do."""
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=256, warmup_tokens=0)
    costs = llm.engine.step_costs
    llm.generate([[5 + i for i in range(64)]], SamplingParams(max_tokens=1, temperature=0.0))
    report = costs.report()
    assert report["steps"] == 1 and report["prefill_tokens"] == 64
    assert report["step_s_ewma"] == 0.0  # a prefill alone
    llm.generate([[7 + i for i in range(64)]], SamplingParams(max_tokens=4, temperature=0.0,
                                                            ignore_eos=True))
    assert 0 < costs.report()["step_s_ewma"]


def test_the_decode_part_of_the_step_time_leaves_out_the_prompt_chunks_in_it():
    """Steps that carry a prompt chunk besides the decodes: the step-time average includes the
    chunk; its decode part (what a stream admitted after the chunk sees) is split off by the
    fit's proportions, here the time a decode-only step takes."""
    costs = StepCostModel()
    decode_only = StepWork(decode_seqs=8, decode_context=8 * 700)
    with_chunk = StepWork(prefill_tokens=512, prefill_attention=512 * 600, decode_seqs=8,
                          decode_context=8 * 700)
    for i in range(400):  # 2 ms per 100 prompt tokens, 20 ms of decodes: the fit learns both
        costs.observe(decode_only, 0.020)
        costs.observe(with_chunk, 0.020 + 512 * 2e-4)
    for _ in range(100):  # then a worker recomputing migrated prompts: every step a chunk
        costs.observe(with_chunk, 0.020 + 512 * 2e-4)
    report = costs.report()
    assert report["step_s_ewma"] == pytest.approx(0.020 + 512 * 2e-4, rel=0.02)
    assert report["decode_s_ewma"] == pytest.approx(0.020, rel=0.15)
