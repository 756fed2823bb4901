"""The 8-bit KV cache against the 16-bit one, in the same run: (1) logits and greedy agreement
over 64 tokens on the four architectures' test models; (2) KV bytes a prefill worker ships
per request (its transfer metrics, a prefill + decode pair in one process); (3) offline decode
throughput of the bench model with a KV budget that holds half the batch in bf16.

    .venv/bin/python bench/kv_int8.py [--batch 32] [--prompt 512] [--output 128]
        [--kv-sequences 16] [--json FILE]

The engine's defaults (`LLM(model)`) but for `kv_cache_dtype` and, in (3), the KV budget
(`kv_cache_memory_bytes`: --kv-sequences whole requests in bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model, machine_line  # noqa: E402
from pd_runtime import LLM, SamplingParams  # noqa: E402


def logits_agreement(architecture: str) -> dict:
    from pd_runtime.model.tiny import make_tiny_model

    model = str(make_tiny_model(Path(tempfile.mkdtemp()) / architecture, preset="test",
                                architecture=architecture))
    prompt = [random.Random(1).randrange(5, 400) for _ in range(100)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    runs = {}
    for kv in ("auto", "int8"):
        llm = LLM(model, dtype="bfloat16", warmup_tokens=0, kv_cache_dtype=kv)
        logits, sample = [], llm.engine._sample

        def recording(rows, sampled, logits=logits, sample=sample):
            logits.append(rows[-1].float().clone())
            return sample(rows, sampled)

        llm.engine._sample = recording
        runs[kv] = (llm.generate([prompt], params)[0].token_ids, logits)
    (x, a), (y, b) = runs["auto"], runs["int8"]
    same = next((i for i in range(len(x)) if x[i] != y[i]), len(x))
    rel = [float((p - q).abs().max() / p.std()) for p, q in zip(a[:same + 1], b[:same + 1])]
    return {"architecture": architecture, "greedy_agreement": same, "of": len(x),
            "max_rel_logit_diff": max(rel), "mean_rel_logit_diff": sum(rel) / len(rel)}


def shipped_bytes(model: str, kv: str, prompt_len: int) -> dict:
    from pd_runtime.config import ClusterConfig
    from pd_runtime.workers.local_pool import LocalPool

    engine = {"kv_cache_dtype": kv, "warmup_tokens": 0}
    cfg = ClusterConfig.model_validate({
        "model": model, "kv_transfer": {"backend": "local"},
        "prefill": {"num_workers": 1, "engine": engine},
        "decode": {"num_workers": 1, "engine": engine}})
    pool = LocalPool(cfg, model)
    prompts = [[random.Random(i).randrange(5, 8000) for _ in range(prompt_len)] for i in range(4)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run():
        for i, prompt in enumerate(prompts):
            async for chunk in pool.generate(f"b{i}", prompt, params, disaggregate=True):
                assert chunk.error is None, chunk.error

    try:
        asyncio.run(run())
        sent = pool.worker("prefill-0").agent.metrics()["bytes_sent"]
        per_token = pool.worker("decode-0").engine.runner.kv_bytes_per_token
    finally:
        pool.close()
    return {"kv_cache_dtype": kv, "bytes_per_request": sent / len(prompts),
            "kv_bytes_per_token": per_token}


def throughput(model: str, kv: str, args, budget: int) -> dict:
    llm = LLM(model, kv_cache_dtype=kv, kv_cache_memory_bytes=budget)
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 8000) for _ in range(args.prompt)] for _ in range(args.batch)]
    params = SamplingParams(max_tokens=args.output, temperature=0, ignore_eos=True)
    engine = llm.engine
    peak, start = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"t{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    seconds = time.perf_counter() - start
    return {"kv_cache_dtype": kv, "blocks": engine.block_manager.num_blocks,
            "peak_running": peak, "preemptions": engine.scheduler.num_preemptions,
            "seconds": seconds, "output_tok_s": args.batch * args.output / seconds}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--kv-sequences", type=int, default=16,
                    help="the KV budget: this many whole requests in a bf16 cache")
    ap.add_argument("--ship-prompt", type=int, default=2048)
    ap.add_argument("--json")
    args = ap.parse_args()
    model = bench_model(None)
    doc = {"machine": machine_line(), "args": vars(args)}
    print(f"# {doc['machine']}")
    doc["logits"] = [logits_agreement(a) for a in ("llama", "mistral", "qwen2", "qwen3")]
    print("architecture  greedy agreement  max |dlogit|/std  mean")
    for r in doc["logits"]:
        print(f"{r['architecture']:<12}  {r['greedy_agreement']:>3}/{r['of']:<12}  "
              f"{r['max_rel_logit_diff']:>15.4f}  {r['mean_rel_logit_diff']:.4f}")
    doc["shipped"] = [shipped_bytes(model, kv, args.ship_prompt) for kv in ("auto", "int8")]
    a, b = doc["shipped"]
    print(f"shipped per {args.ship_prompt}-token request: bf16 {a['bytes_per_request'] / 2**20:.2f}"
          f" MiB, int8 {b['bytes_per_request'] / 2**20:.2f} MiB "
          f"({b['bytes_per_request'] / a['bytes_per_request']:.3f}x)")
    per_token = json.loads((Path(model) / "config.json").read_text())
    bf16_token = 2 * per_token["num_hidden_layers"] * per_token["num_key_value_heads"] * \
        (per_token["hidden_size"] // per_token["num_attention_heads"]) * 2
    budget = args.kv_sequences * (args.prompt + args.output) * bf16_token
    doc["throughput"] = []
    for _ in range(2):  # alternately, twice
        for kv in ("auto", "int8"):
            doc["throughput"].append(throughput(model, kv, args, budget))
            r = doc["throughput"][-1]
            print(f"decode {args.batch} x ({args.prompt} + {args.output}), KV budget "
                  f"{budget / 2**20:.0f} MiB: {kv:<5} {r['blocks']} blocks, peak running "
                  f"{r['peak_running']}, preemptions {r['preemptions']}, "
                  f"{r['output_tok_s']:.1f} output tok/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
