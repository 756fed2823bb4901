"""Tensor-parallel engines on the CPU (gloo): the offline LLM at t = 2 and 4 gives t = 1's
greedy tokens for a GQA model with fewer KV heads than ranks, a sliding-window model and a
mixture of experts; how the weights split; what is refused; a lost rank is an error, not a
hang. (Two cores are not a tensor-parallel target: these check exactness, not speed.)"""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch

from pd_runtime.api import SamplingParams
from pd_runtime.engine.llm import LLM
from pd_runtime.model import tensor_parallel
from pd_runtime.model.model_config import ModelLoadError, load_model_config
from pd_runtime.model.parallel_comm import TensorParallelError, TensorParallelGroup

PROMPTS = [[5 + i, 17, 33, 99, 120 + i, 7 * i + 3] * 7 for i in range(4)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)


def _run(model_dir: str, size: int, **engine) -> list:
    llm = LLM(model_dir, tensor_parallel_size=size, num_threads=1, **engine)
    try:
        return [(r.token_ids, [e[t].logprob for t, e in zip(r.token_ids, r.logprobs)])
                for r in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("family, overrides, sizes, engine", [
    ("llama", {}, (2, 4), {}),                           # 2 KV heads: replicated at t = 4
    ("mistral", {"sliding_window": 24}, (2,), {}),       # prompts of 42 tokens pass the window
    ("mixtral", {"num_local_experts": 4}, (2, 4), {}),   # experts split 2 and 1 per rank
    ("llama", {}, (2,), {"kv_cache_dtype": "int8"}),     # each rank quantizes its own heads
])
def test_greedy_tokens_match_one_rank(model_factory, family, overrides, sizes, engine):
    model_dir = model_factory(family, **overrides)
    reference = _run(model_dir, 1, **engine)
    for size in sizes:
        got = _run(model_dir, size, **engine)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in reference], size
        # The row-parallel sums add partials in another order than one matmul: logprobs
        # agree to float32 rounding, not bit for bit (docs/architecture.md).
        worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, reference)
                    for a, b in zip(la, lb))
        assert worst < 1e-4, (size, worst)


def _groups(size: int, work) -> list:
    """`work(group)` on `size` real gloo ranks (threads of this process), results by rank."""
    store = TensorParallelGroup.create_store("127.0.0.1", size, timeout_s=30)
    results: list = [None] * size

    def rank_main(rank: int) -> None:
        group = TensorParallelGroup(rank, size, "127.0.0.1", store.port, torch.device("cpu"),
                                    30, store=store if rank == 0 else None)
        try:
            results[rank] = work(group)
        finally:
            group.close()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert all(r is not None for r in results), "a rank failed"
    return results


def test_the_experts_sum_is_one_ranks_bit_for_bit(model_factory):
    """Experts whole on one rank each (expert parallel): the all-reduce of their weighted
    outputs adds zeros only, so a sparse MLP over 2 ranks equals t = 1's bit for bit."""
    from pd_runtime.model.loader import load_model

    model_dir = model_factory("mixtral", num_local_experts=4)
    x = torch.randn(9, load_model_config(model_dir).hidden_size,
                    generator=torch.Generator().manual_seed(0))
    whole = load_model(model_dir, "float32", batch_invariant=True)
    expected = whole._experts(whole.layers[0], whole.packed[0], x)

    def sparse_mlp(group):
        model = load_model(model_dir, "float32", batch_invariant=True, tp=group)
        return model._experts(model.layers[0], model.packed[0], x.clone())

    for got in _groups(2, sparse_mlp):
        assert torch.equal(got, expected)


def test_four_ranks_add_in_rank_order_whatever_the_size():
    """Past two ranks the CPU all-reduce adds the partials in rank order, so a row's sum does
    not depend on how many rows share the call (gloo's ring would chunk by size)."""
    gen = torch.Generator().manual_seed(1)
    partials = [torch.randn(37, 96, generator=gen) * 10 ** r for r in range(4)]
    expected = ((partials[0] + partials[1]) + partials[2]) + partials[3]

    def reduce(group):
        whole = group.all_reduce(partials[group.rank].clone())
        one_row = group.all_reduce(partials[group.rank][5:6].clone())
        return whole, one_row

    for whole, one_row in _groups(4, reduce):
        assert torch.equal(whole, expected) and torch.equal(one_row, expected[5:6])


def test_how_a_layer_splits(model_factory):
    model_dir = model_factory("llama")  # 4 heads, 2 KV heads, head_dim 16, MLP 128
    cfg = load_model_config(model_dir)
    assert [list(tensor_parallel.kv_heads_of_rank(2, 4, r)) for r in range(4)] == \
        [[0], [0], [1], [1]]
    assert [list(tensor_parallel.kv_heads_of_rank(8, 2, r)) for r in range(2)] == \
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    d, h = cfg.head_dim, cfg.hidden_size
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    rows = torch.arange(q + 2 * kv, dtype=torch.float32)[:, None].expand(-1, h)
    layer = {"qkv": rows, "o": torch.arange(q, dtype=torch.float32)[None].expand(h, -1),
             "down": torch.arange(cfg.intermediate_size, dtype=torch.float32)[None].expand(h, -1),
             "in_norm": torch.ones(h)}
    shard = tensor_parallel.shard_layer(layer, cfg, 3, 4)
    # rank 3 of 4: query head 3, KV head 1 (k rows after q, v rows after k)
    assert shard["qkv"][:, 0].tolist() == [*range(3 * d, 4 * d), *range(q + d, q + 2 * d),
                                           *range(q + kv + d, q + kv + 2 * d)]
    assert shard["o"][0].tolist() == list(range(3 * d, 4 * d))
    assert shard["down"][0].tolist() == list(range(96, 128))
    assert shard["in_norm"] is layer["in_norm"]  # replicated
    local = tensor_parallel.local_config(cfg, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (1, 1, 32)


@pytest.mark.parametrize("family, overrides, size, words", [
    ("llama", {}, 3, "4 attention heads do not divide by 3"),
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 4}, 8, None),
    ("llama", {"num_attention_heads": 12, "num_key_value_heads": 6, "hidden_size": 96}, 4,
     "6 KV heads and 4"),
    ("olmo2", {}, 2, "span all heads"),
])
def test_what_cannot_split_is_refused_naming_why(model_factory, family, overrides, size, words):
    cfg = load_model_config(model_factory(family, **overrides))
    reason = tensor_parallel.unsupported_reason(cfg, size)
    if words is None:
        assert reason is None
    else:
        assert words in reason


def test_an_unsplittable_model_is_refused_before_any_rank_starts_work(model_factory):
    with pytest.raises(ModelLoadError, match="tensor_parallel_size 3: its 4 attention heads"):
        LLM(model_factory("llama"), tensor_parallel_size=3, num_threads=1)


def test_a_lost_rank_fails_the_step_promptly(model_factory):
    """A follower killed mid-life: the driver's next step raises (the worker is lost and its
    requests take the recovery paths), it does not wait for a collective timeout."""
    llm = LLM(model_factory("llama"), tensor_parallel_size=2, num_threads=1)
    try:
        llm.generate(PROMPTS[:1], GREEDY)
        follower = llm.engine._local_ranks.followers.processes[0]
        follower.kill()
        follower.wait()
        started = time.monotonic()
        with pytest.raises(TensorParallelError):
            llm.generate(PROMPTS[:1], GREEDY)
        assert time.monotonic() - started < 30
    finally:
        llm.engine.close()


def test_followers_stop_with_the_engine(model_factory):
    llm = LLM(model_factory("llama"), tensor_parallel_size=2, num_threads=1)
    processes = list(llm.engine._local_ranks.followers.processes)
    llm.engine.close()
    assert all(p.poll() is not None for p in processes)


def test_threads_are_shared_out_among_the_ranks():
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.tp_ranks import threads_per_rank
    import os

    cores = len(os.sched_getaffinity(0))
    assert threads_per_rank(EngineConfig(model="m", tensor_parallel_size=2)) == \
        max(1, cores // 2)
    assert threads_per_rank(EngineConfig(model="m", tensor_parallel_size=2, num_threads=3)) == 3
    assert threads_per_rank(EngineConfig(model="m")) is None
    assert math.isfinite(cores)


def test_a_model_over_one_ranks_budget_is_refused_at_one_rank_and_serves_at_two(model_factory):
    """engine.memory_budget_bytes between what one rank of two and a whole engine plan: the
    whole model is refused before it loads, naming the field; split over two ranks it loads
    and gives the single-rank engine's tokens."""
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.kv_cache.memory_plan import plan_memory
    from pd_runtime.model.model_config import served

    model_dir = model_factory("llama", intermediate_size=2048)  # weights dominate the plan
    settings = dict(dtype="float32", num_kv_blocks=16, max_num_batched_tokens=64,
                    max_num_seqs=8)
    cfg = served(load_model_config(model_dir), 2048)
    whole, half = (plan_memory(EngineConfig(model=model_dir, tensor_parallel_size=t,
                                            **settings), cfg, 2048).total for t in (1, 2))
    assert half < 0.8 * whole
    budget = (whole + half) // 2
    with pytest.raises(ValueError, match="engine.memory_budget_bytes: this engine needs"):
        LLM(model_dir, num_threads=1, memory_budget_bytes=budget, **settings)
    reference = LLM(model_dir, num_threads=1, **settings).generate(PROMPTS[:2], GREEDY)
    llm = LLM(model_dir, tensor_parallel_size=2, num_threads=1, memory_budget_bytes=budget,
              **settings)
    try:
        got = llm.generate(PROMPTS[:2], GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in reference]
    finally:
        llm.engine.close()


def test_each_local_rank_takes_its_own_gpu_from_the_configured_one():
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.tp_ranks import rank_device

    def devices(device):
        config = EngineConfig(model="m", device=device, tensor_parallel_size=2)
        return [rank_device(config, rank) for rank in range(2)]

    assert devices("cuda") == ["cuda:0", "cuda:1"]
    assert devices("cuda:2") == ["cuda:2", "cuda:3"]
    assert devices("cpu") == ["cpu", "cpu"]


def test_a_follower_that_ends_before_the_group_forms_fails_the_start_at_once(model_factory):
    """Followers that cannot start (here: their entry module does not exist, so each process
    exits at once): the driver says so within seconds, not at the rendezvous timeout."""
    from pd_runtime.config import EngineConfig
    from pd_runtime.engine import tp_ranks
    from pd_runtime.engine.engine import LLMEngine

    config = EngineConfig(model=model_factory("llama"), tensor_parallel_size=2, num_threads=1)
    started = time.monotonic()
    with pytest.raises(TensorParallelError, match="before the group formed: tensor-parallel "
                                                  "rank 1 .* ended with code 1"):
        LLMEngine(config, launch_ranks=tp_ranks.local_processes("pd_runtime.no_such_entry"))
    assert time.monotonic() - started < 20
