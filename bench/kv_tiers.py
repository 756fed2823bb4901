"""KV tiers under multi-turn chat: many sessions re-send a growing history, their KV together
several times a worker's device pool. Each system is served fresh in turn on this machine, the
same open-loop load (bench/goodput.py --workload multiturn) against each:

    unshare -n sh -c 'ip link set lo up; exec .venv/bin/python bench/kv_tiers.py --out /tmp/kv'
        [--systems pd-off pd-host pd-disk vllm vllm-offload] [--rate 2] [--num-requests 192]
        [--conversations 32] [--turns 6] [--input-len 512] [--user-len 64] [--output-len 32]
        [--pool-mib 64] [--host-gib 1] [--disk-gib 2]

Systems (the bench model; every pd-runtime system is `pd-runtime serve`'s default deployment,
1 prefill + 1 decode worker, with ONE setting changed for all: engine.kv_cache_memory_bytes =
--pool-mib, so that the sessions' KV is 5-10x a worker's pool within minutes of load; the
default pool is 512 MiB):
  pd-off        no tiers: a block the pool evicts is gone
  pd-host       engine.kv_offloading_size = --host-gib (evicted blocks move to host memory)
  pd-disk       a host tier the size of the device pool, and --disk-gib of disk below it
  vllm          vLLM-CPU with the same KV bytes (--kv-cache-gib), its prefix cache on
  vllm-offload  the same with vLLM's --kv-offloading-size --host-gib (if its CPU build takes it)
  vllm-big      vLLM-CPU with a device pool of --host-gib: what memory alone buys, for scale
  pd2-host      two decode workers (a core each, no prefill pool), host tiers: routing matters
  *-estimate    the same with routing.kv_events false: the router's prefix index an estimate
                from what it sent where, instead of the blocks the workers report holding

Per system: the prefix-cache hit rate over the run (`vllm:prefix_cache_hits_total` /
`queries_total`, which both servers export), TTFT p50/p99 of the first turns and of the later
ones, SLO attainment and goodput; a table, `kv_tiers.json` and a plot (`kv_tiers.png`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import bench_model  # noqa: E402
from bench.goodput_study import Server, merge  # noqa: E402

SYSTEMS = ("pd-off", "pd-host", "pd-disk", "vllm", "vllm-offload", "vllm-big",
           "pd-host-estimate", "pd2-host", "pd2-host-estimate", "pd2-off", "pd2-off-estimate")
GIB = 1 << 30


def pd_config(name: str, args, out: Path) -> Path:
    engine = {"kv_cache_memory_bytes": args.pool_mib << 20}
    if "-host" in name:
        engine["kv_offloading_size"] = args.host_gib
    elif name == "pd-disk":
        engine.update(kv_offloading_size=args.pool_mib / 1024, kv_offloading_disk_size=args.disk_gib,
                      kv_offloading_disk_dir=str(out / "kv-disk"))
    over = {"prefill": {"engine": engine}, "decode": {"engine": engine},
            "router": {"port": args.port,
                       "routing": {"kv_events": not name.endswith("-estimate")}}}
    if name.startswith("pd2"):  # two decode workers, a core each, no prefill pool
        over["prefill"]["num_workers"] = 0
        over["decode"]["num_workers"] = 2
    cfg = yaml.safe_load((ROOT / "cluster_configs/local.yaml").read_text())
    cfg = merge(cfg, over)
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prefix_tokens(base_url: str) -> tuple[float, float]:
    """(queried, hit) prompt tokens so far, from vLLM's metric names."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    got = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got["vllm:prefix_cache_queries_total"], got["vllm:prefix_cache_hits_total"]


def session_kv(args, model_dir: str) -> dict:
    """The open sessions' KV at their longest against one worker's device pool."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    longest = args.input_len + (args.turns - 1) * (args.output_len + args.user_len) \
        + args.output_len
    tokens = args.conversations * longest
    pool = (args.pool_mib << 20) // per_token
    return {"kv_bytes_per_token": per_token, "session_tokens": tokens,
            "pool_tokens": pool, "x_pool": tokens / pool}


def run_system(name: str, args, out: Path, model_dir: str) -> dict:
    # (vLLM needs a pool that holds one request of max_model_len: the sessions' longest)
    longest = args.input_len + args.turns * (args.output_len + args.user_len)
    pool_gib = args.host_gib if name == "vllm-big" else args.pool_mib / 1024
    vllm_args = ("--kv-cache-gib", str(pool_gib), "--max-model-len",
                 str(min(4096, -(-longest // 256) * 256)))
    if name == "vllm-offload":
        vllm_args += ("--", "--kv-offloading-size", str(args.host_gib))
    server = Server(name, out, args.port, model_dir,
                    None if name.startswith("vllm") else pd_config(name, args, out), vllm_args)
    result = {"system": name}
    try:
        result["startup_s"] = server.wait_ready(args.startup_timeout_s)
        print(f"## {name}: ready in {result['startup_s']:.0f}s", flush=True)
        before = prefix_tokens(server.base_url)
        report = out / f"{name}.goodput.json"
        cmd = [sys.executable, str(ROOT / "bench/goodput.py"), "--base-url", server.base_url,
               "--label", name, "--json", str(report), "--model-dir", model_dir,
               "--workload", "multiturn", "--rates", str(args.rate),
               "--num-requests", str(args.num_requests), "--conversations",
               str(args.conversations), "--turns", str(args.turns), "--input-len",
               str(args.input_len), "--user-len", str(args.user_len), "--output-len",
               str(args.output_len), "--slo-ttft", str(args.slo_ttft), "--slo-tpot",
               str(args.slo_tpot), "--seed", str(args.seed)]
        if subprocess.run(cmd, cwd=ROOT).returncode != 0:
            raise RuntimeError(f"bench/goodput.py failed against {name}")
        after = prefix_tokens(server.base_url)
        queried, hit = after[0] - before[0], after[1] - before[1]
        result["hit_rate"] = hit / queried if queried else None
        summary = json.loads(report.read_text())["points"][0]["summary"]
        result.update(summarized(summary, json.loads(report.read_text())["points"][0]))
        if not name.startswith("vllm"):
            result["tiers"] = tier_metrics(server.base_url)
            metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
            (out / f"{name}.metrics.txt").write_text(metrics)
            result["routes"] = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                                for line in metrics.splitlines()
                                if line.startswith("pd_routing_decisions_total{")}
    except Exception as exc:  # one system failing must not lose the others' results
        result["error"] = str(exc)
        print(f"## {name}: {exc}", flush=True)
    finally:
        server.stop()
    return result


def summarized(summary: dict, point: dict) -> dict:
    """TTFT of the first turns and of the later ones (those the cache can serve)."""
    def pct(values: list, q: float):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None

    ttft = {"first": [], "later": []}
    for r in point["requests"]:
        if r["outcome"] == "completed" and r["ttft_s"] is not None:
            ttft["first" if r["kind"] == "turn0" else "later"].append(r["ttft_s"])
    return {"attainment": summary["attainment"], "goodput_rps": summary["goodput_rps"],
            "refused": summary["refused"], "failed": summary["failed"],
            "sent": summary["sent"], "ttft_s": summary["ttft_s"],
            "ttft_first_s": {"p50": pct(ttft["first"], 0.5), "p99": pct(ttft["first"], 0.99)},
            "ttft_later_s": {"p50": pct(ttft["later"], 0.5), "p99": pct(ttft["later"], 0.99)},
            "ttfts_later": ttft["later"]}


def tier_metrics(base_url: str) -> dict:
    """pd_worker_kv_tier gauges summed over the workers: {tier: {kind: value}}."""
    out: dict = {}
    for line in httpx.get(base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("pd_worker_kv_tier{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:
                                                             line.index("}")].split(","))
            tier, kind = labels["tier"].strip('"'), labels["kind"].strip('"')
            out.setdefault(tier, {})
            out[tier][kind] = out[tier].get(kind, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def table(results: list[dict]) -> str:
    def f(x, digits=2):
        return "-" if x is None else f"{x:.{digits}f}"

    rows = ["| system | hit rate | TTFT p50 / p99 s (later turns) | TTFT p50 / p99 s (first) | "
            "within targets | goodput req/s | refused |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['system']} | failed: {r['error'][:60]} | | | | | |")
            continue
        rows.append(
            f"| {r['system']} | {f(r['hit_rate'] and 100 * r['hit_rate'], 0)}% | "
            f"{f(r['ttft_later_s']['p50'])} / {f(r['ttft_later_s']['p99'])} | "
            f"{f(r['ttft_first_s']['p50'])} / {f(r['ttft_first_s']['p99'])} | "
            f"{r['attainment']:.0%} | {f(r['goodput_rps'])} | {r['refused']} of {r['sent']} |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(11, 4))
    done = [r for r in results if "error" not in r]
    for r in done:
        xs = sorted(r["ttfts_later"])
        if xs:
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["system"])
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT of later turns (s)")
    cdf.set_ylabel("share of requests")
    cdf.legend()
    cdf.grid(alpha=0.3)
    names = [r["system"] for r in done]
    bars.bar(names, [100 * (r["hit_rate"] or 0) for r in done], color="tab:blue",
             label="prefix hit rate (%)")
    bars.plot(names, [100 * r["attainment"] for r in done], "o-", color="tab:red",
              label="within targets (%)")
    bars.set_ylim(0, 105)
    bars.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="/tmp/kv-tiers")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--rate", type=float, default=2.0)
    p.add_argument("--num-requests", type=int, default=192)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--pool-mib", type=int, default=64)
    p.add_argument("--host-gib", type=float, default=1.0)
    p.add_argument("--disk-gib", type=float, default=2.0)
    p.add_argument("--slo-ttft", type=float, default=2.5)
    p.add_argument("--slo-tpot", type=float, default=0.1)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--model", default=None, help="default: the embedded bench model")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = bench_model(args.model)
    kv = session_kv(args, model_dir)
    print(f"# sessions' KV at their longest: {kv['session_tokens']} tokens = "
          f"{kv['x_pool']:.1f} x a worker's device pool ({kv['pool_tokens']} tokens, "
          f"{args.pool_mib} MiB)", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results = [run_system(name, args, out, model_dir) for name in args.systems]
    doc = {"started": started, "config": vars(args), "session_kv": kv, "results": results}
    (out / "kv_tiers.json").write_text(json.dumps(doc, indent=1))
    print(table(results))
    plot(results, out / "kv_tiers.png",
         f"{args.conversations} sessions x {args.turns} turns at {args.rate:g} req/s, KV "
         f"{kv['x_pool']:.1f}x a {args.pool_mib} MiB pool ({started})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
