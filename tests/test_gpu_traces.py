"""tests/gpu_traces.py, the helpers that compare generated sequences across runs whose bits
differ (tests/test_gpu.py on a GPU), checked on the CPU: equal runs and near ties pass, far
divergence, drift and early parting fail, router ties excused only where asked."""

from __future__ import annotations

import pytest
import torch

from tests.gpu_traces import Trace, compare_traces, logits_traces, router_margins
from tests.test_gpu import MODELS, _prompts


def _trace(tokens, top_gap=0.5, lp=-1.0):
    return Trace(list(tokens), [lp] * len(tokens),
                 [{tok: lp, 10_000 + tok: lp - top_gap} for tok in tokens])


def test_compare_traces_accepts_equal_runs_and_near_ties():
    a = [_trace([5, 6, 7, 8]), _trace([1, 2, 3])]
    assert compare_traces(a, a, tol=0.1, min_shared=0.9) == []
    tied = [_trace([5, 6, 7, 8], top_gap=0.05), _trace([1, 2, 3])]
    parted = [_trace([5, 6, 10_007, 9]), _trace([1, 2, 3])]
    assert compare_traces(tied, parted, tol=0.1, min_shared=0.5) == []


def test_compare_traces_catches_far_divergence_drift_and_early_parting():
    a = [_trace([5, 6, 7, 8], top_gap=2.0)]
    far = [_trace([5, 6, 10_007, 9])]
    assert "parts at step 2" in compare_traces(a, far, tol=0.1, min_shared=0.0)[0]
    drift = [Trace([5, 6, 7, 8], [-1.0, -1.5, -1.0, -1.0], a[0].top)]
    assert "step 1" in compare_traces(a, drift, tol=0.1, min_shared=0.0)[0]
    early = [_trace([9, 6, 7, 8])]
    assert any("before the runs part" in p for p in compare_traces(
        a, early, tol=0.1, min_shared=0.5, tie_at_divergence=False))
    assert compare_traces(a, [_trace([5, 6])], tol=0.1, min_shared=0.0) \
        == ["sequence 0: 4 tokens vs 2"]


def test_compare_traces_excuses_only_where_asked_then_stops_that_sequence():
    a = [_trace([5, 6, 7, 8]), _trace([1, 2, 3, 4])]
    # sequence 0: a tie at step 1, after which its KV differs (step 3 drifts, not a fault);
    # sequence 1 is compared in full
    one_off = [Trace([5, 6, 7, 8], [-1.0, -1.3, -1.0, -1.5], a[0].top), a[1]]
    excused = []
    assert compare_traces(a, one_off, 0.1, 0.0, excuse=lambda i, t: (i, t) == (0, 1),
                          excused=excused, detail=lambda i, t: f" <{i},{t}>") == []
    assert excused == ["sequence 0 step 1: token 6 has logprob -1.000 in one run, -1.300 in "
                       "the other <0,1>"]
    # ... and it counts as shared up to the tie: 1 + 4 of 8 tokens
    assert "only 5 of 8" in compare_traces(a, one_off, 0.1, 0.7,
                                           excuse=lambda i, t: (i, t) == (0, 1))[0]
    # a tie asked about elsewhere excuses nothing
    problems = compare_traces(a, one_off, 0.1, 0.0, excuse=lambda i, t: t == 2)
    assert len(problems) == 1 and "sequence 0 step 1" in problems[0]
    far_off = [Trace([5, 6, 7, 8], [-1.0, -3.0, -1.0, -1.0], a[0].top), a[1]]  # beyond any tie
    problems = compare_traces(a, far_off, 0.1, 0.0, excuse=lambda i, t: t == 1)
    assert len(problems) == 1 and "step 1" in problems[0]
    # a parting at a router tie: excused when the other token is within EXCUSED_MOST
    wide = [_trace([5, 6, 7, 8], top_gap=0.5)]
    parted = [_trace([5, 6, 10_007, 9], top_gap=0.5)]
    excused = []
    assert compare_traces(wide, parted, 0.1, 0.0, excuse=lambda i, t: t == 2,
                          excused=excused) == []
    assert len(excused) == 1 and "parts at step 2" in excused[0]
    assert "parts at step 2" in compare_traces(wide, parted, 0.1, 0.0,
                                               excuse=lambda i, t: t == 1)[0]
    far = [_trace([5, 6, 7, 8], top_gap=2.0)]
    assert "parts at step 2" in compare_traces(far, [_trace([5, 6, 10_007, 9], top_gap=2.0)],
                                               0.1, 0.0, excuse=lambda i, t: t == 2)[0]


def test_router_margins_are_the_top_k_gap_of_transformers_router(tmp_path):
    """On the CPU: one margin per generated step, each the smallest over layers of the gap
    between the k-th and (k+1)-th router logit at the position that chose the step's token
    (checked for the first step against a forward pass over the prompt alone)."""
    from transformers import AutoModelForCausalLM

    from pd_runtime.model.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", preset="test", dtype="bfloat16", **MODELS["mixtral"])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = _prompts(4, lens=[9, 3])
    tokens = [[11, 12, 13], [14, 15]]
    margins = router_margins(hf, prompts, tokens)
    assert [len(m) for m in margins] == [3, 2] and min(min(m) for m in margins) >= 0
    k = hf.config.num_experts_per_tok
    with torch.inference_mode():
        out = hf(torch.tensor([prompts[0]]), output_router_logits=True)
    gaps = [logits.reshape(-1, logits.shape[-1])[-1].topk(k + 1).values for logits in
            out.router_logits]
    assert margins[0][0] == pytest.approx(min((g[k - 1] - g[k]).item() for g in gaps), abs=1e-5)


def test_logits_traces_reads_greedy_scores():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    (trace,) = logits_traces([[1, 0]], [logits], top_n=2)
    assert trace.tokens == [1, 0]
    assert trace.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert set(trace.top[0]) == {1, 2}
