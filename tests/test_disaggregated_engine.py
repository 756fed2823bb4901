"""Engine hooks for disaggregation, two engines in one process: a prefill engine computes the
prompt's KV, the blocks are copied into the decode engine's reservation, decoding continues.
The tokens must equal a colocated run; every block comes back on both sides.
"""

from __future__ import annotations

import random

import pytest

from pd_runtime import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def seeded(i):
    return SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95, seed=77 + i,
                          ignore_eos=True)


def prompts(n=6, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(5, 500) for _ in range(rng.choice([3, 16, 17, 40, 64]))]
            for _ in range(n)]


@pytest.fixture(params=["float32", "bfloat16"])
def dtype(request):
    return request.param


@pytest.fixture()
def pair(llama_dir, dtype):
    prefill = LLM(llama_dir, dtype=dtype, num_kv_blocks=128).engine
    decode = LLM(llama_dir, dtype=dtype, num_kv_blocks=128).engine
    yield prefill, decode
    assert prefill.block_manager.num_free_blocks == 128
    assert decode.block_manager.num_free_blocks == 128
    assert not prefill.remote.held and not decode.remote.waiting


def run_to_end(engine, outputs, texts=None):
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if texts is not None:
                texts[out.request_id] = texts.get(out.request_id, "") + out.new_text


def disaggregated(prefill, decode, items, params, texts=None):
    """items: (request_id, prompt); returns {request_id: tokens} decoded on `decode`, and
    fills `texts` with the text streamed for each."""
    outputs = {}
    texts = {} if texts is None else texts
    for (rid, prompt), p in zip(items, params):
        res = decode.remote.reserve(rid, prompt, p)
        assert res is not None
        first_params = p.first_token_only()
        prefill.add_request(rid, prompt, first_params, hold_blocks=True)
        first = {}
        run_to_end(prefill, first)
        src = prefill.remote.held_block_ids(rid)
        skip = res.num_cached_tokens // res.block_size
        # Ship only what the decode side misses: its own prefix cache counts.
        src_ids, dst_ids = src[skip:len(res.block_ids)], res.missing_block_ids
        decode.runner.kv_cache[:, :, dst_ids] = prefill.runner.kv_cache[:, :, src_ids]
        prefill.remote.release_held(rid)
        out = decode.remote.accept_first_token(rid, first[rid][0])
        decode.remote.complete(rid, kv_arrived=True)
        outputs[rid] = list(out.new_token_ids)
        texts[rid] = out.new_text
    run_to_end(decode, outputs, texts)
    return outputs


def test_disaggregated_equals_colocated(pair, llama_dir, dtype):
    """Token ids and text, greedy and seeded, in both dtypes (bf16 by batch invariance)."""
    prefill, decode = pair
    ps = prompts() + [[5 + (i * 7) % 400 for i in range(300)]]  # and one of many blocks
    colocated = LLM(llama_dir, dtype=dtype, num_kv_blocks=128)
    # And EOS pushed up but held back by min_tokens, the first token's ban on the prefill side.
    eos = min(colocated.engine.eos_token_ids)
    held = [SamplingParams(max_tokens=20, temperature=0.8, seed=500 + i, min_tokens=4,
                           logit_bias={eos: 12.0}) for i in range(len(ps))]
    for params in ([GREEDY] * len(ps), [seeded(i) for i in range(len(ps))], held):
        outs = colocated.generate(ps, params)
        items = [(f"r{i}-{params[0].seed}", p) for i, p in enumerate(ps)]
        texts = {}
        got = disaggregated(prefill, decode, items, params, texts)
        assert [got[rid] for rid, _ in items] == [o.token_ids for o in outs]
        assert [texts[rid] for rid, _ in items] == [o.text for o in outs]
    assert any(len(o.token_ids) == 5 and o.token_ids[-1] == eos for o in outs)
    assert all(eos not in o.token_ids[:4] for o in outs)


def test_decode_prefix_cache_reduces_shipped_blocks(pair):
    prefill, decode = pair
    system = list(range(20, 84))  # 4 full blocks
    disaggregated(prefill, decode, [("a", system + [5, 6, 7])], [GREEDY])
    res = decode.remote.reserve("b", system + [8, 9, 10], GREEDY)
    assert res.num_cached_tokens == 64
    assert len(res.missing_block_ids) == 1
    decode.abort("b")


def test_failed_transfer_falls_back_to_local_prefill(pair, llama_dir, dtype):
    prefill, decode = pair
    ps = prompts(4, seed=9)
    want = [o.token_ids for o in LLM(llama_dir, dtype=dtype, num_kv_blocks=128)
            .generate(ps, GREEDY)]
    outputs = {}
    for i, p in enumerate(ps):
        assert decode.remote.reserve(f"f{i}", p, GREEDY) is not None
        decode.remote.fail(f"f{i}")
    run_to_end(decode, outputs)
    assert [outputs[f"f{i}"] for i in range(4)] == want


def test_reservation_is_backpressure_and_abort_releases(pair):
    prefill, decode = pair
    big = [5 + i % 400 for i in range(16 * 100)]  # 100 blocks
    assert decode.remote.reserve("big1", big, GREEDY) is not None
    free = decode.block_manager.num_free_blocks
    assert decode.remote.reserve("big2", big, GREEDY) is None  # no room: refused
    assert decode.block_manager.num_free_blocks == free and "big2" not in decode.requests
    assert decode.abort("big1")
    prefill.add_request("held", big[:40], GREEDY.__class__(max_tokens=1), hold_blocks=True)
    run_to_end(prefill, {})
    assert prefill.remote.held_block_ids("held")
    assert prefill.abort("held")  # cancelling mid-transfer frees the leased blocks
    assert decode.load_report()["free_blocks"] == 128


def test_transfer_failure_after_first_token_keeps_one_stream(pair, llama_dir, dtype):
    prefill, decode = pair
    ps = prompts(3, seed=4)
    params = [seeded(i) for i in range(3)]
    want = [o.token_ids for o in LLM(llama_dir, dtype=dtype, num_kv_blocks=128)
            .generate(ps, params)]
    outputs = {}
    for i, (p, sp) in enumerate(zip(ps, params)):
        rid = f"t{i}"
        decode.remote.reserve(rid, p, sp)
        prefill.add_request(rid, p, sp.first_token_only())
        first = {}
        run_to_end(prefill, first)
        out = decode.remote.accept_first_token(rid, first[rid][0])
        decode.remote.complete(rid, kv_arrived=False)
        outputs[rid] = list(out.new_token_ids)
    run_to_end(decode, outputs)
    assert [outputs[f"t{i}"] for i in range(3)] == want


def test_resume_after_lost_worker_continues_the_stream(llama_dir):
    ps = prompts(3, seed=5)
    params = [seeded(i) for i in range(3)]
    llm = LLM(llama_dir, dtype="float32", num_kv_blocks=128)
    full = llm.generate(ps, params)
    engine = llm.engine
    outputs, texts = {}, {}
    for i, (p, sp, f) in enumerate(zip(ps, params, full)):
        engine.add_request(f"m{i}", p, sp, resume_output_ids=f.token_ids[:7])
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
    for i, f in enumerate(full):
        assert f.token_ids[:7] + outputs[f"m{i}"] == f.token_ids
        assert f.text.endswith(texts[f"m{i}"])
    assert engine.block_manager.num_free_blocks == 128


def _stream(engine, rid, prompt, params, **kw):
    """(token ids, text deltas) of one request run alone to its end."""
    engine.add_request(rid, prompt, params, **kw)
    tokens, deltas = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
            deltas.append(out.new_text)
    return tokens, deltas


def _seam_cases(llama_dir, dtype):
    """Seeded hot sampling over a vocabulary with multi-byte characters and stop strings: many
    streams end tokens inside a UTF-8 character or hold text back for a possible stop."""
    llm = LLM(llama_dir, dtype=dtype, num_kv_blocks=128)
    ps = prompts(8, seed=21)
    cases = []
    for i, p in enumerate(ps):
        sp = SamplingParams(max_tokens=24, temperature=1.5, seed=300 + i, ignore_eos=True,
                            stop=["ab", "\u4e16\u754c"] if i % 2 else [])
        tokens, deltas = _stream(llm.engine, f"ref{i}", p, sp)
        cases.append((p, sp, tokens, deltas))
    return llm, cases


def test_text_is_exact_across_prefill_handoff_and_migration(pair, llama_dir, dtype):
    """Text is a function of the token ids: the decode worker detokenizes a remote prefill's
    first token itself, and a resumed stream sends exactly what the lost worker held back."""
    prefill, decode = pair
    llm, cases = _seam_cases(llama_dir, dtype)
    partial_seams = 0
    for i, (p, sp, tokens, deltas) in enumerate(cases):
        full = "".join(deltas)
        texts = {}
        got = disaggregated(prefill, decode, [(f"h{i}", p)], [sp], texts)
        assert got[f"h{i}"] == tokens and texts[f"h{i}"] == full
        for cut in range(1, len(tokens)):
            sent = "".join(deltas[:cut])
            held = llm.engine.tokenizer.decode(tokens[:cut]) != sent
            partial_seams += held
            rest, rest_deltas = _stream(llm.engine, f"m{i}-{cut}", p, sp,
                                        resume_output_ids=tokens[:cut],
                                        resume_text_len=len(sent))
            assert tokens[:cut] + rest == tokens
            assert sent + "".join(rest_deltas) == full, (i, cut)
    # The seams must really include text held back (partial characters or stop prefixes).
    assert partial_seams > 0
    assert llm.engine.block_manager.num_free_blocks == 128


def test_layers_ship_as_the_last_prompt_step_computes_them(llama_dir):
    """The layer sink (what a prefill worker streams from): called once per layer, in order,
    only in the step that completes the prompt (here the third of three chunks), each time
    with that layer's K/V already in the cache; copying layer by layer at those moments into
    the decode engine's reservation gives the colocated tokens. Layers the hook has not reached
    are not final yet: the copy of each layer is taken inside the call."""
    prefill = LLM(llama_dir, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32).engine
    decode = LLM(llama_dir, dtype="float32", num_kv_blocks=128).engine
    prompt = [5 + (i * 11) % 400 for i in range(80)]  # 3 steps of <= 32 prompt tokens
    want = LLM(llama_dir, dtype="float32", num_kv_blocks=128).generate([prompt], GREEDY)[0]
    res = decode.remote.reserve("s", prompt, GREEDY)
    calls, steps = [], []

    def sink(layer, block_ids):
        calls.append((prefill.num_steps, layer))
        src = block_ids[:len(res.missing_block_ids)]
        decode.runner.kv_cache[layer, :, res.missing_block_ids] = \
            prefill.runner.kv_cache[layer, :, src]

    prefill.add_request("s", prompt, GREEDY.first_token_only(),
                        hold_blocks=True, layer_sink=sink)
    first = {}
    while prefill.has_unfinished_requests():
        for out in prefill.step():
            first.setdefault(out.request_id, []).extend(out.new_token_ids)
        steps.append(prefill.num_steps)
    layers = prefill.model_config.num_layers
    assert len(steps) == 3
    assert calls == [(3, layer) for layer in range(layers)]
    prefill.remote.release_held("s")
    out = decode.remote.accept_first_token("s", first["s"][0])
    decode.remote.complete("s", kv_arrived=True)
    got = {"s": list(out.new_token_ids)}
    run_to_end(decode, got)
    assert got["s"] == want.token_ids


def test_blocks_held_by_arrived_kv_never_deadlock_the_decode_engine(llama_dir):
    """Arrived remote prefills wait in line holding their prompts' blocks while a more urgent
    request needs those blocks to run at all. The scheduler takes them back from the least
    urgent instead of waiting forever; every request ends, the urgent one's tokens exact, and
    every block comes back. (The served product hung this way under a burst: nothing ran
    until the clients gave up.)"""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    first = [7 + i for i in range(30)]
    want = LLM(llama_dir, dtype="float32", num_kv_blocks=64).generate([first], params)[0]
    decode = LLM(llama_dir, dtype="float32", num_kv_blocks=12).engine
    reserved = []
    while (res := decode.remote.reserve(f"r{len(reserved)}",
                                                [9 + len(reserved)] * 32, params)) is not None:
        reserved.append(res.request_id)
    assert len(reserved) == 6 and decode.block_manager.num_free_blocks == 0
    decode.abort(reserved.pop())  # room for the urgent request's prompt, not for its output
    for rid in reserved:  # first tokens back, the KV never came: prefill here, in the blocks
        decode.remote.accept_first_token(rid, 11)
        decode.remote.complete(rid, kv_arrived=False)
    decode.add_request("a", first, params, priority=-5)  # first in line; no aging past it
    outputs: dict = {}
    for _ in range(2000):
        if not decode.has_unfinished_requests():
            break
        for out in decode.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert not decode.has_unfinished_requests(), "stuck: " + str(
        [(r.request_id, r.status.value, len(r.block_ids)) for r in decode.requests.values()])
    assert outputs["a"] == want.token_ids
    assert all(len(outputs[rid]) == params.max_tokens - 1 for rid in reserved)
    assert decode.scheduler.num_preemptions > 0  # blocks were taken back, not waited for
    assert decode.block_manager.num_free_blocks == 12


def test_a_reservation_never_overtakes_a_request_waiting_for_blocks(llama_dir):
    """The decode engine admits in order: while a queued request waits for blocks, a remote
    prefill's reservation waits too, even when its own (smaller) need would fit."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    decode = LLM(llama_dir, dtype="float32", num_kv_blocks=12).engine
    for i in range(5):
        assert decode.remote.reserve(f"r{i}", [9 + i] * 32, params) is not None
    decode.add_request("b", [5] * 40, params)  # 3 blocks; 2 free
    decode.step()
    assert decode.block_manager.num_free_blocks == 2
    assert decode.remote.reserve("late", [3] * 16, params) is None
    assert "late" not in decode.requests and decode.block_manager.num_free_blocks == 2
    for i in range(5):
        assert decode.abort(f"r{i}")
    run_to_end(decode, {})
    assert decode.remote.reserve("late", [3] * 16, params) is not None
    assert decode.abort("late") and decode.block_manager.num_free_blocks == 12
