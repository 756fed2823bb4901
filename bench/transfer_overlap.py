"""KV transfer overlap on the served product: time to first token of the disaggregated path
against the colocated path, for long prompts, one request at a time, and the share of each KV
transfer hidden under the prefill's compute (the prefill worker's `pd_worker_kv_send_*`
counters: 1 - transfer time after the prompt's last layer was computed / whole transfer time;
"exposed" is that time after the compute, which the decode worker waits on top of the
prefill before its second token).

    .venv/bin/python bench/transfer_overlap.py [--sizes 2048 8192] [--repeats 3] [--out DIR]

Three servers in turn, each `pd-runtime serve` on the default cluster (1 prefill + 1 decode
worker, a core each) with the bench model made with a 16k context (`--model` to use another),
differing only in: `router.routing.mode: always_colocated` (the prompt runs on the decode
worker), `always_disaggregated` with `kv_transfer.stream_layers: true` (the default: layers
ship as the last prompt step computes them), and the same with `stream_layers: false` (the
whole KV after the prefill). Every request has a prompt of its own (no prefix-cache hits).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import goodput_study as study  # noqa: E402

MODES = {
    "colocated": {"router": {"routing": {"mode": "always_colocated"}}},
    "disagg-stream": {"router": {"routing": {"mode": "always_disaggregated"}},
                      "kv_transfer": {"stream_layers": True}},
    "disagg-whole": {"router": {"routing": {"mode": "always_disaggregated"}},
                     "kv_transfer": {"stream_layers": False}},
}


def long_context_model(max_len: int) -> str:
    from pd_runtime.model.tiny import make_tiny_model

    path = Path.home() / ".cache/pd-runtime/models" / f"tiny-bench-{max_len // 1024}k"
    if not (path / "config.json").exists():
        make_tiny_model(path, preset="bench", max_position_embeddings=max_len)
    return str(path)


class Server(study.Server):
    """goodput_study's server (readiness, stop) with this bench's config."""

    def __init__(self, name: str, model: str, out: Path, port: int, max_len: int):
        cfg = yaml.safe_load((ROOT / "cluster_configs/local.yaml").read_text())
        cfg = study.merge(cfg, MODES[name])
        cfg["model"] = model
        cfg["router"]["port"] = port
        for pool in ("prefill", "decode"):
            cfg[pool]["engine"]["max_model_len"] = max_len
        path = out / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        self.name, self.port = name, port
        self.log = open(out / f"{name}.server.log", "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen([str(ROOT / ".venv/bin/pd-runtime"), "serve", "--config",
                                      str(path)], stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)


def timed_request(base: str, model: str, prompt: list[int]) -> float:
    """Seconds to the first token of a streamed completion of 2 tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True}
    times = []
    start = time.perf_counter()
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    times.append(time.perf_counter() - start)
    return times[0]


def send_counters(base: str) -> tuple[float, float]:
    """Summed (whole, exposed) send seconds over the prefill workers, from /metrics."""
    text = httpx.get(base + "/metrics", timeout=10).text
    whole = sum(float(v) for v in re.findall(r"^pd_worker_kv_send_seconds_total\{.*\} (\S+)$",
                                             text, re.M))
    exposed = sum(float(v) for v in re.findall(
        r"^pd_worker_kv_send_exposed_seconds_total\{.*\} (\S+)$", text, re.M))
    return whole, exposed


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", type=int, default=[2048, 8192])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="/tmp/transfer-overlap")
    p.add_argument("--port", type=int, default=8011)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    max_len = max(16384, max(args.sizes) + 64)
    model = args.model or long_context_model(max_len)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    results = []
    for name in args.modes:
        server = Server(name, model, out, args.port, max_len)
        try:
            server.wait_ready()
            served = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
            for size in args.sizes:
                # One unmeasured request of this size first (allocations, first-use costs).
                timed_request(server.base_url, served, [rng.randrange(5, vocab) for _ in range(size)])
                time.sleep(2.0)
                before = send_counters(server.base_url)
                ttft = []
                for _ in range(args.repeats):
                    prompt = [rng.randrange(5, vocab) for _ in range(size)]
                    ttft.append(timed_request(server.base_url, served, prompt))
                time.sleep(3.0)  # the workers' next load reports carry the last sends
                after = send_counters(server.base_url)
                whole, exposed = after[0] - before[0], after[1] - before[1]
                row = {"mode": name, "tokens": size, "ttft_s": statistics.median(ttft),
                       "ttft_all": ttft,
                       "send_s": whole / args.repeats if whole else None,
                       "exposed_s": exposed / args.repeats if whole else None,
                       "hidden_share": 1 - exposed / whole if whole else None}
                results.append(row)
                print(json.dumps(row), flush=True)
        finally:
            server.stop()
    colocated = {r["tokens"]: r["ttft_s"] for r in results if r["mode"] == "colocated"}
    print("\n| mode | tokens | TTFT p50 s | vs colocated | send s | exposed s | hidden |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        ratio = r["ttft_s"] / colocated[r["tokens"]] if r["tokens"] in colocated else None
        ratio_s = "" if ratio is None else f"{ratio:.2f}x"
        send_s = "" if r["send_s"] is None else f"{r['send_s']:.3f}"
        exposed = "" if r["exposed_s"] is None else f"{r['exposed_s']:.3f}"
        hidden = "" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.1f}%"
        print(f"| {r['mode']} | {r['tokens']} | {r['ttft_s']:.2f} | {ratio_s} | {send_s} | "
              f"{exposed} | {hidden} |")
    (out / "overlap.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
