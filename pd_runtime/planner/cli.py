"""The planner's commands: `pd-runtime profile`, `pd-runtime simulate`, `pd-runtime plan`."""

from __future__ import annotations

import asyncio
import json
import sys
import time


def add_commands(sub) -> None:
    p = sub.add_parser("profile", help="calibrate the planner's cost model on a deployment")
    p.add_argument("--config", help="cluster YAML (default: the built-in local deployment)")
    p.add_argument("--model", help="HF model directory (default: the config's, or the "
                                   "embedded tiny model)")
    p.add_argument("--out", default="cost-model.json", help="where to write the cost model")
    p.add_argument("--quick", action="store_true", help="a shorter sweep (tests, smoke runs)")
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: the config's workers in this process (as serve --in-process)")
    p.add_argument("--url", help="calibrate a running deployment through its router "
                                 "(e.g. http://127.0.0.1:8000) instead of starting pools")
    p.add_argument("--api-key", help="with --url, when the router asks for one")
    p.add_argument("--repeats", type=int, default=1,
                   help="with --url: sweeps; each coefficient the median of their fits")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="with --url: the workers' engine.tensor_parallel_size (the load "
                        "reports do not say it)")
    p.add_argument("--device", default="cpu",
                   help="with --url: the workers' engine.device (the activations' dtype, and "
                        "whether the all-reduce can be timed here)")
    p.add_argument("--all-reduce-ranks", default="2",
                   help="comma-separated rank counts to time the runtime's all-reduce over on "
                        "this machine (CPU workers; 0: none), for planning other "
                        "tensor_parallel_size values")
    p.set_defaults(func=_cmd_profile)

    for name, text in (("simulate", "simulate one deployment on a workload"),
                       ("plan", "the best prefill/decode split and routing threshold")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--cost-model", required=True, nargs="+",
                       help="from pd-runtime profile; more files: profiles at other "
                            "tensor_parallel_size values (their workers' step costs)")
        p.add_argument("--all-reduce-latency-us", type=float,
                       help="one all-reduce's latency, for tensor_parallel_size values derived "
                            "from the t=1 profile (default: profile's measurement, else "
                            "pd_runtime/planner/tensor_parallel.py DEFAULT_ALL_REDUCE)")
        p.add_argument("--all-reduce-gbps", type=float,
                       help="the all-reduce's rate, GB/s (with --all-reduce-latency-us)")
        p.add_argument("--workload", help="workload YAML (default: the bimodal mix, Poisson)")
        p.add_argument("--slo", default="ttft=2.5,tpot=0.1", help="ttft=S,tpot=S targets")
        p.add_argument("--rates", type=float, nargs="+",
                       help="arrival rates, requests/s (plan: default, each configuration's "
                            "SLO capacity by bisection)")
        p.add_argument("--duration", type=float, default=60.0,
                       help="simulated seconds of arrivals per rate")
        p.add_argument("--num-requests", type=int, help="per rate, instead of --duration")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--json", help="write every result here")
        if name == "simulate":
            p.add_argument("--prefill", type=int, default=1, help="prefill workers")
            p.add_argument("--decode", type=int, default=1, help="decode workers")
            p.add_argument("--routing", help="routing YAML (as the router's), e.g. "
                                             "cluster_configs' router.routing section")
            p.add_argument("--mode", help="routing mode (overrides --routing's)")
            p.add_argument("--threshold", type=int, help="max_local_prefill_tokens")
            p.add_argument("--tensor-parallel-size", type=int,
                           help="every pool's engine.tensor_parallel_size (default: the "
                                "degree each pool was profiled at)")
            p.set_defaults(func=_cmd_simulate)
        else:
            p.add_argument("--devices", "--workers", type=int, required=True, dest="devices",
                           help="devices to split: GPUs, or on the CPU one worker rank's "
                                "resources each (a worker of tensor_parallel_size t takes t; "
                                "at t=1, the workers)")
            p.add_argument("--tensor-parallel-sizes",
                           help="comma-separated worker degrees to consider for either pool, "
                                "e.g. 1,2 (default: the degrees the pools were profiled at)")
            p.add_argument("--devices-per-node", type=int,
                           help="the most devices one worker may take (its ranks share a "
                                "node; default: --devices)")
            p.add_argument("--png", help="goodput vs rate plot of the best configurations")
            p.set_defaults(func=_cmd_plan)


def _cmd_profile(args) -> int:
    from pd_runtime.config import ClusterConfig
    from pd_runtime.config_loading import load_cluster_config
    from pd_runtime.default_model import ensure_default_model
    from pd_runtime.planner.profile import calibrate, calibrate_http

    ranks = _int_list(args.all_reduce_ranks, "--all-reduce-ranks")
    if args.url:
        from pd_runtime.planner.profile import add_tensor_parallel

        started = time.monotonic()
        costs = asyncio.run(calibrate_http(args.url, args.api_key, quick=args.quick,
                                           repeats=args.repeats,
                                           tensor_parallel_size=args.tensor_parallel_size))
        add_tensor_parallel(costs, args.model, "auto", args.device, ranks,
                            costs.decode.max_num_batched_tokens)
        return _report_profile(costs, args.out, started)
    cfg = load_cluster_config(args.config) if args.config else ClusterConfig()
    model = args.model or cfg.model or str(ensure_default_model())
    if args.in_process:
        from pd_runtime.workers.local_pool import LocalPool

        cfg = cfg.model_copy(update={"kv_transfer": cfg.kv_transfer.model_copy(
            update={"backend": "local"})})
        client = LocalPool(cfg, model)
    else:
        from pd_runtime.workers.launch import launch

        client = launch(cfg, model)
    try:
        started = time.monotonic()
        costs = asyncio.run(calibrate(client, cfg, model, quick=args.quick,
                                      all_reduce_ranks=ranks))
    finally:
        getattr(client, "close", lambda: None)()
    return _report_profile(costs, args.out, started)


def _report_profile(costs, out: str, started: float) -> int:
    costs.save(out)
    for role in ("prefill", "decode"):
        c = getattr(costs, role).coefficients
        print(f"{role}: step {c['step_s'] * 1e3:.2f} ms + {c['prefill_token_s'] * 1e6:.1f} "
              f"us/prompt token + {c['prefill_attention_s'] * 1e9:.3f} ns/attended pair + "
              f"{c['decode_seq_s'] * 1e3:.3f} ms/decoded seq + "
              f"{c['decode_context_s'] * 1e9:.1f} ns/context token")
    print(f"transfer {costs.transfer_gbps:.2f} GB/s, {costs.kv_bytes_per_token} B/token; "
          f"rpc {costs.rpc_s * 1e3:.2f} ms; to first token besides the prefill: colocated "
          f"{costs.overhead_s('colocated') * 1e3:.1f} ms, disaggregated "
          f"{costs.overhead_s('disaggregated') * 1e3:.1f} ms; per engine-loop iteration "
          f"{costs.decode.step_overhead_s * 1e3:.2f} ms")
    for t, a in sorted(costs.all_reduce.items()):
        print(f"all-reduce over {t} ranks: {a.latency_s * 1e6:.0f} us + {a.gbps:.2f} GB/s")
    print(f"wrote {out} in {time.monotonic() - started:.0f}s")
    return 0


def _int_list(text: str, flag: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated integers, got {text!r}") from None


def _inputs(args):
    from pd_runtime.planner.costs import AllReduceCosts, ClusterCosts
    from pd_runtime.planner.plan import parse_slo
    from pd_runtime.planner.tensor_parallel import merge
    from pd_runtime.planner.workload import Workload

    costs = ClusterCosts.load(args.cost_model[0])
    for path in args.cost_model[1:]:
        merge(costs, ClusterCosts.load(path), path)
    if (args.all_reduce_latency_us is None) != (args.all_reduce_gbps is None):
        raise ValueError("--all-reduce-latency-us and --all-reduce-gbps go together")
    if args.all_reduce_gbps is not None:
        if args.all_reduce_latency_us < 0 or args.all_reduce_gbps <= 0:
            raise ValueError("--all-reduce-latency-us must be >= 0 and --all-reduce-gbps > 0")
        given = AllReduceCosts(args.all_reduce_latency_us * 1e-6, args.all_reduce_gbps,
                               "--all-reduce-latency-us/--all-reduce-gbps")
        costs.all_reduce = {t: given for t in (costs.model.tensor_parallel_sizes
                                               if costs.model else ()) if t > 1}
    workload = Workload.load(args.workload) if args.workload else Workload()
    return costs, workload, parse_slo(args.slo)


def _print_row(label: str, result: dict) -> None:
    from pd_runtime.planner.plan import cell as f

    print(f"{label:>10} {result['sent']:>6} {result['completed']:>6} {result['refused']:>6} "
          f"{result['goodput_rps']:>7.2f}  {f(result['ttft_s']['p50']):>6}/"
          f"{f(result['ttft_s']['p99']):<6} {f(result['tpot_s']['p50'], 1e3, 1):>7}/"
          f"{f(result['tpot_s']['p99'], 1e3, 1):<7} {result['sim_s']:>6.2f}", flush=True)


def _cmd_simulate(args) -> int:
    import yaml

    from pd_runtime.config import RoutingConfig
    from pd_runtime.planner.simulator import Topology, simulate

    costs, workload, slo = _inputs(args)
    routing = RoutingConfig.model_validate(yaml.safe_load(open(args.routing)) or {}) \
        if args.routing else RoutingConfig()
    update = {k: v for k, v in (("mode", args.mode), ("max_local_prefill_tokens",
                                                      args.threshold)) if v is not None}
    routing = RoutingConfig.model_validate({**routing.model_dump(), **update})
    degrees = {"prefill_tp": costs.prefill.tensor_parallel_size,
               "decode_tp": costs.decode.tensor_parallel_size} \
        if args.tensor_parallel_size is None else \
        {"prefill_tp": args.tensor_parallel_size, "decode_tp": args.tensor_parallel_size}
    topology = Topology(args.prefill, args.decode, routing, **degrees)
    rates = args.rates or [None]
    if rates == [None] and workload.arrival != "trace":
        raise ValueError("--rates is needed unless the workload's arrival is a trace")
    print(f"# {topology.name}, SLO TTFT {slo.ttft_s:g}s TPOT {slo.tpot_s * 1e3:g}ms")
    print(f"{'rate':>10} {'sent':>6} {'done':>6} {'refus':>6} {'good/s':>7}  "
          f"{'TTFT p50/p99 s':>13} {'TPOT p50/p99 ms':>15} {'sim s':>6}")
    results = []
    for rate in rates:
        requests = workload.requests(rate, num_requests=args.num_requests,
                                     duration_s=None if args.num_requests else args.duration,
                                     seed=args.seed)
        started = time.monotonic()
        result = simulate(costs, topology, requests, slo, args.seed)
        result.update(rate=rate, sim_s=time.monotonic() - started)
        results.append(result)
        _print_row(f"{rate:g}" if rate else "trace", result)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"topology": topology.name, "slo": slo.model_dump(),
                       "results": results}, fh, indent=1)
    return 0


def _cmd_plan(args) -> int:
    from pd_runtime.planner.plan import plan, plot, table

    costs, workload, slo = _inputs(args)

    def progress(name, cand):
        what = f"SLO capacity {cand.capacity:.2f}/s" if cand.capacity is not None else \
            f"peak goodput {cand.peak['goodput_rps']:.2f}/s at {cand.peak['rate']:g}/s"
        print(f"  {name:<26} {what} ({len(cand.points)} runs)", file=sys.stderr, flush=True)

    sizes = _int_list(args.tensor_parallel_sizes, "--tensor-parallel-sizes") \
        if args.tensor_parallel_sizes else None
    ranked, info = plan(costs, workload, slo, args.devices, rates=args.rates,
                        duration_s=args.duration, seed=args.seed, progress=progress,
                        num_requests=args.num_requests, tensor_parallel_sizes=sizes,
                        devices_per_node=args.devices_per_node)
    rates = f"{len(info['rates'])} rates ({', '.join(f'{r:g}' for r in info['rates'])}/s)" \
        if info["rates"] else "an SLO-capacity search (>= 90% within the targets)"
    print(f"# {args.devices} devices, SLO TTFT {slo.ttft_s:g}s TPOT {slo.tpot_s * 1e3:g}ms; "
          f"{info['candidates']} configurations x {rates}, {info['simulations']} simulations, "
          + (f"{info['num_requests']} requests" if info["num_requests"] else
             f"{info['duration_s']:g} s simulated") + f" each, in {info['seconds']:.1f}s")
    for line in info["sources"]:
        print(f"# {line}")
    print(table(ranked))
    best = ranked[0].topology
    print(f"recommended: {best.num_prefill} prefill + {best.num_decode} decode workers, "
          f"tensor_parallel_size "
          + (f"prefill {best.prefill_tp}, " if best.num_prefill else "")
          + f"decode {best.decode_tp} ({best.devices} devices), routing mode {best.routing.mode}"
          + (f", max_local_prefill_tokens {best.routing.max_local_prefill_tokens}"
             if best.routing.mode == "auto" else "")
          + (f", max_prefill_queue_tokens {best.routing.max_prefill_queue_tokens}"
             if best.num_prefill else ""))
    if args.png:
        plot(ranked, args.png, slo)
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"info": info, "ranked": [
                {"name": c.name, "prefill_tp": c.topology.prefill_tp,
                 "decode_tp": c.topology.decode_tp, "devices": c.topology.devices,
                 "points": c.points} for c in ranked]}, fh, indent=1)
    return 0
