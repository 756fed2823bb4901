"""What run records cost the router: records off and on (the default) side by side in one
process, each its own PoolBackend + app + uvicorn server over workers that answer at once,
their requests interleaved so that the box's drift falls on both alike.

    python bench/records_cost.py [--samples 2000] [--rounds 6] [--seconds 4] [--blocks 30]

1. Loop-thread CPU per request in process (no sockets), alternated blocks of 100 requests.
2. Sequential latency over HTTP (one client process, the two servers' requests interleaved):
   the router's added latency (a completion minus the bare echo route of the same server) and
   a 16-token stream's latency, records on / off.
3. Saturation: `--rounds` alternated loads of each server (order swapped every round): rate and
   server CPU per request, the records' writer thread and writer process included.

The writer's background work (its thread in this process, its process beside it) runs while
either server serves, so parts 1 and 2 charge records on with the serving loop's share only;
part 3 counts the writer's CPU to records on.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.router_overhead import sustained  # noqa: E402
from bench.router_overhead_clients import run_client  # noqa: E402
from bench.router_overhead_stack import (ECHO_PATH, asgi_call, build_stack,  # noqa: E402
                                         completion_body, thread_cpu_s)

MODES = ("off", "on")


def latency_cases(ports: dict, name: str, prompt: str) -> list[dict]:
    cases = []
    for mode in MODES:
        cases += [
            {"name": f"{mode} echo", "method": "POST", "path": ECHO_PATH, "port": ports[mode],
             "body": completion_body(name, prompt, 1, False).decode()},
            {"name": f"{mode} 1 token", "method": "POST", "path": "/v1/completions",
             "port": ports[mode], "body": completion_body(name, prompt, 1, False).decode()},
            {"name": f"{mode} stream 16", "method": "POST", "path": "/v1/completions",
             "port": ports[mode], "body": completion_body(name, prompt, 16, True).decode(),
             "stream": True},
        ]
    return cases


async def loop_cpu(stacks: dict, prompt: str, blocks: int, per_block: int = 100) -> dict:
    """(mode, stream) -> median loop-thread CPU µs per request over alternated blocks."""
    out = {}
    for stream, tokens in ((False, 1), (True, 16)):
        bodies = {m: completion_body(stacks[m][0].model_name, prompt, tokens, stream)
                  for m in MODES}
        for m in MODES:  # warm-up
            for _ in range(per_block):
                await asgi_call(stacks[m][1], "POST", "/v1/completions", bodies[m])
        samples: dict = {m: [] for m in MODES}
        for block in range(blocks):
            for m in (MODES if block % 2 == 0 else MODES[::-1]):
                start = time.thread_time()
                for _ in range(per_block):
                    await asgi_call(stacks[m][1], "POST", "/v1/completions", bodies[m])
                samples[m].append((time.thread_time() - start) / per_block * 1e6)
        for m in MODES:
            out[(m, stream)] = statistics.median(samples[m])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the embedded bench model")
    ap.add_argument("--prompt", default="The capital of France is a city called")
    ap.add_argument("--samples", type=int, default=2000, help="sequential requests per case")
    ap.add_argument("--blocks", type=int, default=30, help="in-process blocks per mode")
    ap.add_argument("--rounds", type=int, default=6, help="saturation loads per mode")
    ap.add_argument("--seconds", type=float, default=4.0, help="duration of each load")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--load-client", choices=["raw", "httpx"], default="raw")
    args = ap.parse_args()

    from bench.common import bench_model, machine_line
    from pd_runtime.entrypoints.openai.server import settle_heap, start_in_thread

    model = bench_model(args.model)
    stacks = {m: build_stack(model, 1, 2, runs=m == "on") for m in MODES}
    settle_heap()  # as `pd-runtime serve` does before serving
    writer = stacks["on"][1].state.recorder.writer
    name = stacks["on"][0].model_name
    print(f"# {machine_line()}, {os.cpu_count()} CPUs; records off and on, one process, "
          f"model {name}; the store: {stacks['on'][2].router.runs.store or 'the default'}")
    cpu = asyncio.run(loop_cpu(stacks, args.prompt, args.blocks))  # before any server runs
    print(f"\n## Loop-thread CPU per request in process, µs (median of {args.blocks} "
          "alternated blocks of 100)")
    for stream in (False, True):
        off, on = cpu[("off", stream)], cpu[("on", stream)]
        label = "stream 16 tokens" if stream else "1 token"
        print(f"{label:<22} off {off:>6.0f}  on {on:>6.0f}  on/off {on / off:.3f}")

    servers = {m: start_in_thread(stacks[m][1]) for m in MODES}
    ports = {m: servers[m][1] for m in MODES}
    tids = {"off": [servers["off"][0].thread.native_id],
            "on": [servers["on"][0].thread.native_id, writer._thread.native_id]}
    try:
        lat = run_client("latency", [], {"port": ports["off"], "samples": args.samples,
                                         "warmup": max(50, args.samples // 10),
                                         "cases": latency_cases(ports, name, args.prompt)})
        print(f"\n## Sequential latency over HTTP, µs, {args.samples} of each, interleaved")
        print(f"{'':<22} {'off p50':>8} {'on p50':>8} {'on/off':>7}   request p99 off / on")
        for label, case in (("added, 1 token", "1 token"), ("stream 16 tokens", "stream 16")):
            p50 = {m: lat[f"{m} {case}"][0] - (lat[f"{m} echo"][0] if case == "1 token" else 0)
                   for m in MODES}
            print(f"{label:<22} {p50['off']:>8.0f} {p50['on']:>8.0f} "
                  f"{p50['on'] / p50['off']:>7.3f}   {lat[f'off {case}'][2]:.0f} / "
                  f"{lat[f'on {case}'][2]:.0f}")

        body = completion_body(name, args.prompt, 1, False).decode()
        loads: dict = {m: [] for m in MODES}
        for r in range(args.rounds):
            for m in (MODES if r % 2 == 0 else MODES[::-1]):
                gc.collect()
                thread0 = thread_cpu_s(writer._thread.native_id)
                loads[m].append(sustained(ports[m], tids[m], "/v1/completions", body, args,
                                          writer if m == "on" else None))
                loads[m][-1]["writer_thread_s"] = thread_cpu_s(writer._thread.native_id) - thread0
        print(f"\n## Saturation: {args.clients} {args.load_client} clients, {args.rounds} x "
              f"{args.seconds:g} s per mode, alternated (medians; per round in brackets)")
        for key, label in (("rate", "req/s"), ("cpu_us_per_request", "server CPU µs/req")):
            off = [x[key] for x in loads["off"]]
            on = [x[key] for x in loads["on"]]
            print(f"{label:<22} off {statistics.median(off):>6.0f}  on "
                  f"{statistics.median(on):>6.0f}  on/off "
                  f"{statistics.median(on) / statistics.median(off):.3f}  "
                  f"[{' '.join(f'{a / b:.2f}' for a, b in zip(on, off))}]")
        for key, label in (("writer_cpu_s", "process"), ("writer_thread_s", "thread")):
            per = [x[key] * 1e6 / x["total_requests"] for x in loads["on"]]
            print(f"{'of which writer ' + label:<22} {statistics.median(per):.0f} µs/req")
    finally:
        for server, _ in servers.values():
            server.stop()
        for backend, _, _ in stacks.values():
            backend.stop()


if __name__ == "__main__":
    main()
