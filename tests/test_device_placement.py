"""The engine's step on a device other than the host, without a GPU: weights and KV cache on
PyTorch's `meta` device, where any op that mixes a meta tensor with a host tensor fails (as
CUDA does for the ops that matter: `F.embedding` of a CUDA weight by host ids, a CUDA logit row
divided by host temperatures, a CUDA tensor drawn with a host generator). So an index tensor,
mask or parameter built on the host and never moved is caught here (issue 13)."""

from __future__ import annotations

import pytest
import torch

from pd_runtime.config import EngineConfig
from pd_runtime.engine.model_runner import ModelRunner
from pd_runtime.engine.sampling.sampler import Sampler
from pd_runtime.api import SamplingParams
from pd_runtime.engine.scheduler import ScheduledRequest, SchedulerOutput
from pd_runtime.model.tiny import make_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("placement") / "m", preset="test"))


def _plan() -> SchedulerOutput:
    """Two decodes, a fresh prompt and a chunk over a cached prefix, one mid-prompt chunk
    that samples nothing: every metadata path of a step."""
    return SchedulerOutput(scheduled=[
        ScheduledRequest("d1", start=5, token_ids=[7], block_ids=[3, 1], sample=True),
        ScheduledRequest("fresh", start=0, token_ids=list(range(10, 16)),
                         block_ids=[4, 5], sample=True),
        ScheduledRequest("d2", start=9, token_ids=[8], block_ids=[0, 2, 6], sample=True),
        ScheduledRequest("chunk", start=8, token_ids=list(range(20, 25)),
                         block_ids=[7, 8, 9, 10], sample=True),
        ScheduledRequest("mid", start=0, token_ids=list(range(30, 34)),
                         block_ids=[11, 12], sample=False),
    ])


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_model_runner_step_on_a_non_host_device(model_dir, batch_invariant):
    runner = ModelRunner(EngineConfig(model=model_dir, device="meta", block_size=BLOCK,
                                      num_kv_blocks=16, batch_invariant=batch_invariant,
                                      warmup_tokens=0), max_model_len=64)
    assert runner.kv_cache.device.type == "meta"
    assert runner.model.embed.device.type == "meta"
    assert runner.decode_buffer.max_bytes == 0  # the host-only side buffer: off
    logits = runner.execute(_plan())
    assert logits.device.type == "meta"
    assert tuple(logits.shape) == (4, runner.model.cfg.vocab_size)
    # A decode-only step (the common one) too.
    plan = SchedulerOutput(scheduled=[
        ScheduledRequest("d1", start=6, token_ids=[7], block_ids=[3, 1], sample=True)])
    assert runner.execute(plan).device.type == "meta"


def test_sampler_on_a_non_host_device():
    vocab = 64
    logits = torch.empty(5, vocab, device="meta")
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3),
              SamplingParams(temperature=1.0, min_p=0.1, logprobs=3, logit_bias={4: 2.0}),
              SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.5,
                             presence_penalty=0.1, logprobs=0),
              SamplingParams(temperature=0, logprobs=2)]
    for p in params:
        p.validate()
    sampler = Sampler(seed=0, device="meta")
    generators = [None] * 5  # meta has no generators; a seeded row's must be on the device:
    with pytest.raises(ValueError, match="cannot draw"):
        sampler.sample_on_device(logits, params, [None, Sampler.make_generator(3), None, None,
                                                  None], histories=[([1], [])] * 5)
    histories = [([1, 2], []), ([3], [4]), ([5, 6, 7], [8]), ([9, 9, 10], [11, 11]), ([1], [])]
    packed = sampler.sample_on_device(logits, params, generators, histories)
    # The whole result in one tensor on the device: ids, then chosen logprobs, their ranks and
    # the top-n.
    assert packed.device.type == "meta"
    assert packed.shape[0] == 5 + 3 + 3 + 2 * 3 * 3


def test_packed_result_reads_back_as_the_host_sampler_gives():
    """On the host the same packing runs end to end; unpacked, it is what a row alone gets."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0.9, seed=5),
              SamplingParams(temperature=0, logprobs=0)]
    for p in params:
        p.validate()
    got = Sampler(0)(logits, params, [None, Sampler.make_generator(5), None])
    raw = torch.log_softmax(logits, dim=-1)
    assert got.token_ids[0] == int(logits[0].argmax())
    assert got.logprobs[0][0] == pytest.approx(float(raw[0, got.token_ids[0]]))
    top = raw[0].topk(2)
    assert got.logprobs[0][1] == {int(i): float(v) for i, v in zip(top.indices, top.values)}
    assert got.logprobs[0][2] == 1  # greedy: the likeliest
    assert got.logprobs[1] is None
    assert got.logprobs[2] == (pytest.approx(float(raw[2].max())), {}, 1)
    alone = Sampler(1)(logits[1:2], params[1:2], [Sampler.make_generator(5)])
    assert alone.token_ids == got.token_ids[1:2]


def test_a_sampled_token_reports_its_rank():
    """A token drawn at a high temperature is often not the likeliest: its rank is how many
    tokens the raw logits made at least as likely (vLLM's count), whatever the top-n asked."""
    torch.manual_seed(1)
    logits = torch.randn(8, 40)
    params = [SamplingParams(temperature=5.0, seed=i, logprobs=i % 3) for i in range(8)]
    for p in params:
        p.validate()
    got = Sampler(0)(logits, params, [Sampler.make_generator(i) for i in range(8)])
    raw = torch.log_softmax(logits, dim=-1)
    ranks = [int((raw[i] >= raw[i, t]).sum()) for i, t in enumerate(got.token_ids)]
    assert [lp[2] for lp in got.logprobs] == ranks
    assert max(ranks) > 1  # the draw did leave the argmax, so the ranks were really read


def test_tied_tokens_rank_as_vllm_ranks_them():
    """Two tokens tied at the top: the one taken is ranked 2, as vLLM counts every token at
    least as likely (its own included)."""
    logits = torch.tensor([[3.0, 1.0, 3.0, 0.5]])
    params = [SamplingParams(temperature=0, logprobs=2)]
    params[0].validate()
    got = Sampler(0)(logits, params, [None])
    assert got.token_ids == [0] and got.logprobs[0][2] == 2

