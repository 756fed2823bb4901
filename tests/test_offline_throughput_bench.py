"""bench/offline_throughput.py's bounds are measured in the dtype our engine runs: the matmul
rate helper times the dtype it is given, and the bound line names the run's dtype (`auto`
resolved as the engine resolves it). Shape only: no speed is checked."""

from __future__ import annotations

import sys
from argparse import Namespace

import pytest
import torch

import pd_runtime.model.llama as llama
from bench import common, offline_throughput
from pd_runtime.kernels import native
from pd_runtime.model.loader import resolve_dtype
from pd_runtime.model.model_config import load_model_config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matmul_rate_runs_the_dtype_it_is_given(monkeypatch, dtype):
    seen = []
    real = llama.linear

    def recording(x, weight, packed, *rest, **kwargs):
        seen.append((x.dtype, weight.dtype, tuple(x.shape)))
        return real(x, weight, packed, *rest, **kwargs)

    monkeypatch.setattr(llama, "linear", recording)
    assert common.matmul_gflops(dtype, 8, 64, 32, threads=1, budget_s=0.01) > 0
    assert seen and set(seen) == {(dtype, dtype, (8, 64))}


def test_weight_bytes_are_those_the_linear_reads():
    assert common.linear_weight_value_bytes(torch.bfloat16) == 2
    assert common.linear_weight_value_bytes(torch.float32) == 4
    # A bf16 checkpoint run in float32: the native kernel keeps its values in bf16 panels.
    expected = 2 if native.pack_linear(torch.zeros(16, 8)) is not None else 4
    assert common.linear_weight_value_bytes(torch.float32, torch.bfloat16) == expected


def test_step_linears_count_the_model_flops(llama_dir):
    cfg = load_model_config(llama_dir)
    h, layers = cfg.hidden_size, cfg.num_layers
    q_kv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    attention = h * q_kv + cfg.num_heads * cfg.head_dim * h
    mlp = 3 * h * cfg.intermediate_size
    decode = offline_throughput.step_linears(cfg, prefill=False)
    assert sum(c * k * n * s for c, k, n, s in decode) == \
        layers * (attention + mlp) + cfg.vocab_size * h
    prefill = offline_throughput.step_linears(cfg, prefill=True)
    assert sum(c * k * n * s for c, k, n, s in prefill) == \
        (layers - 1) * (attention + mlp) + h * q_kv


def test_bound_line_names_the_run_dtype(llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [
        "offline_throughput.py", "--model", llama_dir, "--no-hf", "--no-vllm",
        "--num-prompts", "4", "--input-len", "16", "--output-len", "4", "--dtype", "float32",
        "--threads", str(torch.get_num_threads()), "--bound-timing-s", "0.01"])
    offline_throughput.main()
    out = capsys.readouterr().out
    assert "bounds in float32" in out and "float32 matmul bound" in out
    assert "of the float32 matmul rate" in out and "bf16" not in out


def test_auto_is_resolved_as_the_engine_resolves_it(model_factory, capsys):
    model = model_factory("llama", dtype="bfloat16")
    args = Namespace(dtype="auto", input_len=16, output_len=4, num_prompts=4,
                     max_num_batched_tokens=64, bound_timing_s=0.01)
    offline_throughput.print_bounds(model, {"decode_step_ms": None,
                                            "prefill_tokens_per_s": None}, args)
    runs = resolve_dtype("auto", load_model_config(model), "cpu")
    assert f"bounds in {str(runs).removeprefix('torch.')} " in capsys.readouterr().out
