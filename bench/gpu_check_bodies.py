"""The bodies of the GPU check's own stages (environment, bench model, our engine, HF generate),
each run in its own process by `bench/gpu_check.py --stage NAME`; each returns one JSON dict."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.gpu_check_plan import REPO, SIZES


def body_env(args) -> dict:
    import importlib
    import platform

    out = {"python": platform.python_version()}
    for name in ("torch", "triton", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as exc:  # reported in the table, not fatal here
            out[name] = f"none ({type(exc).__name__})"
    import torch

    out["cuda"] = torch.cuda.is_available()
    out["device"] = torch.cuda.get_device_name(0) if out["cuda"] else "cpu"
    if out["cuda"]:
        free, total = torch.cuda.mem_get_info()
        out["gpu_memory_gib"] = {"free": free / 2**30, "total": total / 2**30}
    imports = {}
    for name in ("pydantic", "xxhash", "msgpack", "safetensors", "tokenizers", "yaml",
                 "ucxx", "pd_runtime.kernels.triton_paged", "pd_runtime.engine.llm"):
        try:
            importlib.import_module(name)
            imports[name] = True
        except Exception as exc:
            imports[name] = False
            print(f"import {name}: {type(exc).__name__}: {exc}")
    out["imports"] = imports
    out["gpu_transfer_script"] = (REPO / "bench" / "gpu_transfer.py").exists()
    return out


def _model_fields(sizes: dict) -> dict:
    return dict(sizes["model"], dtype="bfloat16", tokenizer_vocab_size=sizes["tokenizer_vocab"])


def body_model(args) -> dict:
    """The bench model at this mode's size, written once per directory (a rerun reuses it)."""
    from pd_runtime.model.tiny import make_tiny_model

    sizes = SIZES[args.mode]
    fields = _model_fields(sizes)
    path = Path(args.model_dir)
    stamp = path / "gpu_check_fields.json"
    start = time.perf_counter()
    reused = stamp.exists() and json.loads(stamp.read_text()) == fields \
        and (path / "model.safetensors").exists()
    if not reused:
        make_tiny_model(path, preset="bench", **fields)
        stamp.write_text(json.dumps(fields))
    m = sizes["model"]
    head_dim = m["hidden_size"] // m["num_attention_heads"]
    kv_dim = m["num_key_value_heads"] * head_dim
    per_layer = 2 * m["hidden_size"] ** 2 + 2 * m["hidden_size"] * kv_dim \
        + 3 * m["hidden_size"] * m["intermediate_size"] + 2 * m["hidden_size"]
    params = m["num_hidden_layers"] * per_layer + 2 * m["vocab_size"] * m["hidden_size"] \
        + m["hidden_size"]
    return {"params": params, "head_dim": head_dim, "seconds": time.perf_counter() - start,
            "reused": reused, "path": str(path)}


def bench_prompts(sizes: dict, seed: int) -> list[list[int]]:
    """Token-id prompts both engines get (ids below 5 are the special tokens)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(5, sizes["tokenizer_vocab"]) for _ in range(sizes["prompt_len"])]
            for _ in range(sizes["num_prompts"])]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def engine_kwargs(sizes: dict, **overrides) -> dict:
    """Our engine as the bench runs it at this mode's sizes (the engine and tensor_parallel
    stages)."""
    return {"device": sizes["device"], "dtype": "bfloat16", "batch_invariant": False,
            "max_num_seqs": sizes["num_prompts"],
            "max_num_batched_tokens": sizes["max_num_batched_tokens"],
            "kv_cache_memory_bytes": int(sizes["kv_cache_gib"] * 2**30),
            "enable_prefix_caching": False, **overrides}


def body_engine(args) -> dict:
    """Our engine over the batch: one warm-up pass of the same shape (kernel builds, the batch
    sizes a ramp-up goes through), then the timed generate, prefill included."""
    import torch

    from pd_runtime.config import EngineConfig
    from pd_runtime.engine.llm import LLM
    from pd_runtime.api import SamplingParams

    sizes = SIZES[args.mode]
    device = sizes["device"]
    graphs = args.graphs == "on"
    kwargs = engine_kwargs(sizes)
    if "cuda_graphs" in EngineConfig.model_fields:
        kwargs["cuda_graphs"] = graphs
    elif graphs and device == "cuda":
        return {"missing": "EngineConfig has no cuda_graphs field"}
    start = time.perf_counter()
    llm = LLM(args.model_dir, **kwargs)
    init_s = time.perf_counter() - start
    capture_s = getattr(llm.engine.runner, "graph_capture_s", None)
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate(bench_prompts(sizes, seed=1), warm)
    _sync(device)
    prompts = bench_prompts(sizes, seed=0)
    params = SamplingParams(max_tokens=sizes["output_len"], temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync(device)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.token_ids) for o in outs)
    if produced != len(prompts) * sizes["output_len"]:
        return {"error": f"{produced} tokens produced, {len(prompts) * sizes['output_len']} "
                         f"expected"}
    memory = {}
    plan = getattr(llm.engine.runner, "memory_plan", None)
    if plan is not None and device.startswith("cuda"):  # the plan's estimate against torch's
        memory = {"plan_gib": (plan.total - plan.runtime) / 2**30,  # the context is not counted
                  "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                  "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                  "plan": {k: v / 2**30 for k, v in vars(plan).items()}}
    return {**memory, "engine": f"pd-runtime (cuda_graphs {args.graphs})", "tokens_per_s": produced / elapsed,
            "output_tokens": produced, "elapsed_s": elapsed, "init_s": init_s,
            "graph_capture_s": capture_s, "cuda_graphs_field": "cuda_graphs" in kwargs,
            "first_tokens": outs[0].token_ids[:8]}


def left_padded(prompts: list[list[int]], pad_id: int):
    """input_ids and attention_mask of a batch, padded on the left (decoder-only generate)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        mask[row, width - len(p):] = 1
    return ids, mask


def body_hf(args) -> dict:
    """transformers' generate on the same model, batch and device: static batch, bf16, greedy,
    exactly output_len new tokens (min_new_tokens = max_new_tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    sizes = SIZES[args.mode]
    device = sizes["device"]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16)
    model = model.to(device).eval()
    pad = model.generation_config.pad_token_id
    n = sizes["output_len"]

    def generate(prompts, new_tokens):
        ids, mask = left_padded(prompts, pad)
        ids, mask = ids.to(device), mask.to(device)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        return out.shape[1] - ids.shape[1], out

    with torch.inference_mode():
        generate(bench_prompts(sizes, seed=1), 4)
        _sync(device)
        start = time.perf_counter()
        new, out = generate(bench_prompts(sizes, seed=0), n)
        _sync(device)
        elapsed = time.perf_counter() - start
    if new != n:
        return {"error": f"generate made {new} new tokens per row, {n} expected"}
    produced = new * out.shape[0]
    return {"engine": "transformers generate", "tokens_per_s": produced / elapsed,
            "output_tokens": produced, "elapsed_s": elapsed,
            "attn_implementation": getattr(model.config, "_attn_implementation", None),
            "first_tokens": out[0, -n:][:8].tolist()}
