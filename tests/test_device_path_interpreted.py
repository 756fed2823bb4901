"""The engine's GPU step path run on CPU: ModelRunner's device metadata (one flat index
buffer, int32 block tables, varlen prefill segments) and the decode-graph bucket padding
(pd_runtime/engine/cuda_graphs.py), with the Triton kernels under TRITON_INTERPRET=1 (set in
conftest.py), against the host path's logits for the same steps. The graph capture itself
needs CUDA; here each bucket's "graph" is its eager run on the same static buffers, so what is
checked is everything a replay reads and writes."""

from __future__ import annotations

import pytest
import torch

from pd_runtime.kernels import triton_paged
from pd_runtime.config import EngineConfig
from pd_runtime.engine.cuda_graphs import DecodeGraphs
from pd_runtime.engine.model_runner import ModelRunner
from pd_runtime.engine.scheduler import ScheduledRequest, SchedulerOutput

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(model_factory):
    # head_dim 64 (the kernels take 64 and 128), GQA 2, bf16 weights.
    return model_factory(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                         dtype="bfloat16")


class _EagerGraph:
    """Stands in for a captured graph: replay reruns the bucket on the static buffers."""

    def __init__(self, graphs: DecodeGraphs, batch: int, out: torch.Tensor):
        self.graphs, self.batch, self.out = graphs, batch, out

    def replay(self):
        self.out.copy_(self.graphs._run(self.batch))


def _runners(model_dir, graphs: bool):
    config = EngineConfig(model=model_dir, dtype="bfloat16", block_size=BLOCK, num_kv_blocks=40,
                          batch_invariant=False, warmup_tokens=0, max_num_seqs=8)
    host = ModelRunner(config, max_model_len=256)
    device = ModelRunner(config, max_model_len=256)
    device.triton = triton_paged  # the CUDA path's kernels and metadata, on CPU tensors
    if graphs:
        g = device.graphs = DecodeGraphs(device, 5)  # buckets 1, 2, 4, 5
        g.slots.fill_(-1)
        for batch in g.buckets:
            out = g._run(batch).clone()
            g.graphs[batch] = (_EagerGraph(g, batch, out), out)
    return host, device


def _steps():
    """Prompts (one chunked over a cached prefix), then decodes of 3 and of 2 sequences (in a
    bucket of 4 and of 2 with padding), in a plan order other than the runner's."""
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(5, 500, (n,), generator=gen).tolist()  # noqa: E731
    a, b, c = tokens(37), tokens(20), tokens(50)
    blocks = {"a": [3, 7, 1, 9], "b": [12, 4], "c": [20, 21, 5, 30]}
    yield [ScheduledRequest("a", 0, a, blocks["a"], True),
           ScheduledRequest("b", 0, b, blocks["b"], True),
           ScheduledRequest("c", 0, c[:24], blocks["c"], False)]
    yield [ScheduledRequest("c", 24, c[24:], blocks["c"], True),
           ScheduledRequest("a", 37, [11], blocks["a"], True)]
    yield [ScheduledRequest("b", 20, [12], blocks["b"], True),
           ScheduledRequest("a", 38, [13], blocks["a"], True),
           ScheduledRequest("c", 50, [14], blocks["c"], True)]
    yield [ScheduledRequest("c", 51, [15], blocks["c"], True),
           ScheduledRequest("b", 21, [16], blocks["b"], True)]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buckets"])
def test_device_path_gives_the_host_paths_logits(model_dir, graphs):
    host, device = _runners(model_dir, graphs)
    for i, scheduled in enumerate(_steps()):
        plan = SchedulerOutput(scheduled=scheduled)
        want = host.execute(plan)
        got = device.execute(plan)
        assert got.shape == want.shape, f"step {i}"
        # bf16 through two different kernel sets: logits (|x| up to ~16) agree to ~0.13 here;
        # a wrong block, slot or mask moves them by whole units.
        torch.testing.assert_close(got, want, atol=0.25, rtol=0.02, msg=f"step {i}")
        assert torch.equal(got.argmax(-1), want.argmax(-1)), f"step {i}"
    # The device path wrote the same K/V into the same slots (padding rows wrote nothing).
    torch.testing.assert_close(device.kv_cache.float(), host.kv_cache.float(), atol=0.05,
                               rtol=0.05)
    if graphs:
        assert device.graphs.replays == 2
