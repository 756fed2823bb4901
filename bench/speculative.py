"""Speculative decoding by prompt lookup against plain decoding, in the same run: output tokens
per second of the offline engine (`LLM(model)` defaults, `speculative_method` the one setting
that differs), its acceptance rate and tokens per verification, per workload and batch size.

Workloads:
  looping      the test-preset tiny model decoding on from its own greedy continuation, for
               seeds whose continuation has settled into a cycle (period <= 16) within the
               run-in: its next tokens repeat its context, the regime of code edits and
               summaries that quote (a random-weight model copies nothing otherwise)
  repetitive   the bench model, prompts that repeat a phrase several times (greedy); a random
               -weight model does not copy them, so this shows what a model that ignores its
               context costs the drafter
  random       the bench model, random prompts sampled at temperature 1: guesses almost never
               hold; the cost of having speculation on where it does not help

    .venv/bin/python bench/speculative.py [--batch 1 8] [--tokens 128] [--requests 8]
        [--repeats 3] [--speculative-tokens 4] [--run-in 96] [--json FILE]

Each (workload, batch) runs plain and speculative alternately `--repeats` times; the median of
each is reported. Outputs are checked equal (greedy) on every run.

`--draft` adds the draft-model drafter on the bench model (greedy, random prompts), with the
two drafts a random-weight model allows: the target itself (every guess holds, at the
target's cost) and its first layer alone (a cheap draft whose guesses fail): the mechanics'
two bounds, not a trained draft's speedup.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model, machine_line  # noqa: E402
from pd_runtime import LLM, SamplingParams  # noqa: E402


def workloads(num: int, tokens: int, bench_dir: str, looping_dir: str, plain: dict,
              run_in: int = 96):
    """(name, model dir, prompts, params) per workload, `num` prompts each."""
    rng = random.Random(0)
    warm = SamplingParams(max_tokens=run_in, temperature=0, ignore_eos=True)
    looping = []
    while len(looping) < num:  # seeds whose continuation has settled into a cycle
        seeds = [[rng.randrange(5, 500) for _ in range(8)] for _ in range(4 * num)]
        for seed, out in zip(seeds, plain[looping_dir].generate(seeds, warm)):
            if _cycles(out.token_ids[-32:]) and len(looping) < num:
                looping.append(seed + out.token_ids)
    vocab = json.loads((Path(bench_dir) / "config.json").read_text())["vocab_size"]
    repetitive = []
    for _ in range(num):
        phrase = [rng.randrange(5, vocab) for _ in range(24)]
        repetitive.append(phrase * 6)
    randoms = [[rng.randrange(5, vocab) for _ in range(144)] for _ in range(num)]
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    return [("looping", looping_dir, looping, greedy),
            ("repetitive", bench_dir, repetitive, greedy),
            ("random", bench_dir, randoms, sampled)]


def _cycles(tokens: list[int], longest: int = 16) -> bool:
    """The tokens repeat with a period of at most `longest`."""
    return any(tokens[p:] == tokens[:-p] for p in range(1, longest + 1))


def timed(llm: LLM, prompts, params, batch: int) -> tuple[float, list]:
    """The prompts `batch` at a time, one group after the other."""
    start, out = time.perf_counter(), []
    for i in range(0, len(prompts), batch):
        out += [o.token_ids for o in llm.generate(prompts[i:i + batch], params)]
    return time.perf_counter() - start, out


def measure(name: str, batch: int, base: LLM, spec: LLM, prompts, params, args) -> dict:
    """Plain and speculative alternately, `args.repeats` times; the row of the table."""
    stats = spec.engine.speculator.stats
    before = (stats.verifications, stats.drafted, stats.accepted)
    times = {"plain": [], "spec": []}
    for _ in range(args.repeats):
        t_plain, out_plain = timed(base, prompts, params, batch)
        t_spec, out_spec = timed(spec, prompts, params, batch)
        if params.greedy and out_plain != out_spec:
            raise SystemExit(f"{name} batch {batch}: speculative output differs")
        times["plain"].append(t_plain)
        times["spec"].append(t_spec)
    n = len(prompts) * args.tokens
    verif, drafted, accepted = (stats.verifications - before[0], stats.drafted - before[1],
                                stats.accepted - before[2])
    row = {"workload": name, "batch": batch,
           "plain_tok_s": n / statistics.median(times["plain"]),
           "spec_tok_s": n / statistics.median(times["spec"]),
           "acceptance": accepted / drafted if drafted else None,
           "tokens_per_verification": (accepted + verif) / verif if verif else None,
           "drafted": drafted, "times": times}
    row["speedup"] = row["spec_tok_s"] / row["plain_tok_s"]
    acc = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
    tpv = "-" if row["tokens_per_verification"] is None \
        else f"{row['tokens_per_verification']:.2f}"
    print(f"{name:<13} {batch:>5} {row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>11.1f} "
          f"{row['speedup']:>7.2f}x {acc:>7} {tpv:>9}", flush=True)
    return row


def first_layer_copy(model_dir: str) -> str:
    """The model with only its first layer (the same tokenizer, embeddings and head)."""
    import shutil

    out = Path(tempfile.mkdtemp()) / "first-layer"
    shutil.copytree(model_dir, out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def draft_rows(args, bench_dir: str, plain: LLM) -> list[dict]:
    rows = []
    rng = random.Random(1)
    vocab = json.loads((Path(bench_dir) / "config.json").read_text())["vocab_size"]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for name, draft in (("draft=target", bench_dir), ("draft=1 layer", first_layer_copy(bench_dir))):
        spec = LLM(bench_dir, speculative_method="draft", speculative_model=draft,
                   speculative_tokens=args.speculative_tokens)
        for batch in args.batch:
            prompts = [[rng.randrange(5, vocab) for _ in range(144)]
                       for _ in range(batch * max(1, args.requests // batch))]
            rows.append(measure(name, batch, plain, spec, prompts, params, args))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8,
                    help="per workload: batch-sized groups, one after the other")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--speculative-tokens", type=int, default=4)
    ap.add_argument("--run-in", type=int, default=96,
                    help="looping: tokens of the model's own continuation in the prompt")
    ap.add_argument("--draft", action="store_true", help="also the draft-model drafter")
    ap.add_argument("--json")
    args = ap.parse_args()
    from pd_runtime.model.tiny import make_tiny_model

    bench_dir = bench_model(None)
    looping_dir = str(make_tiny_model(Path(tempfile.mkdtemp()) / "test", preset="test"))
    engines = {}
    for d in (bench_dir, looping_dir):
        engines[d] = (LLM(d), LLM(d, speculative_method="ngram",
                                  speculative_tokens=args.speculative_tokens))
    plain = {d: pair[0] for d, pair in engines.items()}
    print(f"# {machine_line()}\n# speculative decoding (ngram, k={args.speculative_tokens}) vs "
          f"plain, {args.tokens} output tokens per request, median of {args.repeats}; looping "
          f"prompts: 8 tokens + {args.run_in} of the model's own greedy continuation")
    print(f"{'workload':<13} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} "
          f"{'speedup':>8} {'accept':>7} {'tok/verif':>9}")
    rows = []
    for batch in args.batch:
        num = batch * max(1, args.requests // batch)
        for name, model_dir, prompts, params in workloads(num, args.tokens, bench_dir,
                                                          looping_dir, plain, args.run_in):
            base, spec = engines[model_dir]
            rows.append(measure(name, batch, base, spec, prompts, params, args))
    if args.draft:
        rows += draft_rows(args, bench_dir, engines[bench_dir][0])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine_line(), "args": vars(args),
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
