"""The planner: its cost-model file, workloads, the simulator (against hand-computed timings,
against its own step-by-step reference, on the router's real policy), the plan search, and
`pd-runtime profile / simulate / plan` end to end (profile on in-process workers of the test
model). Its accuracy against the served product is a benchmark: bench/sim_accuracy.py.
"""

from __future__ import annotations

import json
import math

import pytest

from pd_runtime.config import RoutingConfig, SLOTarget
from pd_runtime.planner.costs import ClusterCosts, HostCosts, RoleCosts
from pd_runtime.planner.host import fit_host, load_cores, nnls, union_s
from pd_runtime.planner.engine_model import SimEngine
from pd_runtime.planner.simulator import ClusterSim, Topology, simulate
from pd_runtime.planner.workload import SimRequest, Workload, read_trace

COEF = dict(step_s=0.004, prefill_token_s=2.5e-4, prefill_attention_s=1e-8,
            decode_seq_s=8e-4, decode_context_s=2e-7)
SLO = SLOTarget(ttft_s=2.5, tpot_s=0.1)


def costs(**over) -> ClusterCosts:
    role = RoleCosts(coefficients=dict(COEF), num_kv_blocks=over.pop("blocks", 4096))
    return ClusterCosts(prefill=role, decode=role, kv_bytes_per_token=32768,
                        transfer_gbps=2.0, rpc_s=0.002, router_overhead_s=0.0005,
                        num_layers=8, **over)


def routing(mode: str, threshold: int = 512) -> RoutingConfig:
    return RoutingConfig(mode=mode, max_local_prefill_tokens=threshold)


# ---------------------------------------------------------------------------------- the file
def test_cost_model_file_round_trips_and_names_what_is_wrong(tmp_path):
    path = tmp_path / "costs.json"
    original = costs(transfer_exposed_s=0.004, host=HostCosts(cores=2, router_token_cpu_s=5e-4))
    original.save(path)
    assert ClusterCosts.load(path) == original
    data = json.loads(path.read_text())
    del data["decode"]["coefficients"]["decode_seq_s"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="decode_seq_s"):
        ClusterCosts.load(path)
    data["version"] = 7
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version"):
        ClusterCosts.load(path)
    with pytest.raises(ValueError, match="finite"):
        RoleCosts(coefficients={**COEF, "step_s": float("nan")})


# ---------------------------------------------------------------------------------- workloads
def test_bimodal_poisson_workload():
    reqs = Workload().requests(rate=4.0, num_requests=4000, seed=3)
    assert len(reqs) == 4000
    long = sum(r.prompt_len == 2048 for r in reqs) / len(reqs)
    assert 0.18 < long < 0.22 and {r.prompt_len for r in reqs} == {128, 2048}
    assert all(r.max_tokens == 64 for r in reqs)
    rate = len(reqs) / reqs[-1].arrival_s
    assert 3.8 < rate < 4.2
    assert Workload().requests(rate=4.0, num_requests=50, seed=3) == reqs[:50]
    bursty = Workload(arrival="gamma", burstiness=0.25).requests(rate=4.0, num_requests=4000)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(bursty, bursty[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert 1.7 < cv < 2.3  # 1/sqrt(0.25)
    with pytest.raises(ValueError, match="workload.mix"):
        Workload(mix="trimodal")


def test_traces_jsonl_and_bench_json(tmp_path):
    lines = tmp_path / "trace.jsonl"
    lines.write_text('{"t": 0.5, "input_len": 10, "output_len": 3}\n\n'
                     '{"t": 0.2, "input_len": 20, "output_len": 4}\n')
    reqs = Workload(mix="trace", arrival="trace", trace=str(lines)).requests()
    assert [(r.arrival_s, r.prompt_len, r.max_tokens) for r in reqs] == [(0.5, 10, 3),
                                                                           (0.2, 20, 4)]
    bench = tmp_path / "bench.json"
    point = {"requests": [{"scheduled_s": 1.0, "input_len": 128, "output_len": 64},
                          {"scheduled_s": 0.1, "input_len": 2048, "output_len": 64}]}
    bench.write_text(json.dumps({"label": "x", "points": [point, point]}))
    assert read_trace(bench, 1) == [(0.1, 2048, 64), (1.0, 128, 64)]
    with pytest.raises(ValueError, match="no point 2"):
        read_trace(bench, 2)
    lines.write_text('{"input_len": 10}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_trace(lines)


# ---------------------------------------------------------------------------------- simulator
def _one(mode: str, prompt_len: int, max_tokens: int, c: ClusterCosts) -> dict:
    topology = Topology(1, 1, routing(mode))
    sim = ClusterSim(c, topology)
    [out] = sim.run([SimRequest(0, 1.0, prompt_len, max_tokens)])
    return {"ttft": out.ttft_s(c.router_overhead_s), "tpot": out.tpot_s(), "path": out.path}


def _decode_steps_s(prompt_len: int, max_tokens: int) -> float:
    """The max_tokens - 1 decode steps after the first token, one sequence."""
    return sum(COEF["step_s"] + COEF["decode_seq_s"] + COEF["decode_context_s"] *
               (prompt_len + 1 + j) for j in range(max_tokens - 1))


def test_one_request_takes_what_the_cost_model_says():
    c = costs()
    prefill = COEF["step_s"] + COEF["prefill_token_s"] * 300 + \
        COEF["prefill_attention_s"] * (300 * 301 // 2)
    got = _one("always_colocated", 300, 10, c)
    assert got["path"] == "colocated"
    assert got["ttft"] == pytest.approx(c.rpc_s + prefill + c.router_overhead_s, rel=1e-9)
    assert got["tpot"] == pytest.approx(_decode_steps_s(300, 10) / 9, rel=1e-9)
    # Disaggregated: router -> decode -> prefill worker and the token back the same way; the
    # KV lands what is exposed after the prefill, and decoding starts on the decode worker.
    got = _one("always_disaggregated", 300, 10, c)
    assert got["path"] == "disaggregated"
    assert got["ttft"] == pytest.approx(2 * c.rpc_s + prefill + c.router_overhead_s, rel=1e-9)
    exposed = c.exposed_s(300)
    assert exposed == pytest.approx(300 * 32768 / 2e9 / 8)
    tpot = (exposed - c.rpc_s + _decode_steps_s(300, 10) + c.rpc_s / 2) / 9
    assert got["tpot"] == pytest.approx(tpot, rel=1e-9)


def test_runs_of_decode_steps_equal_the_step_by_step_reference(monkeypatch):
    """Pure-decode runs are computed in closed form and cut by arrivals: with every step its own
    event the outcomes must be the same, for every path and a KV cache small enough that
    reservations and admissions wait for blocks."""
    c = costs(blocks=300)
    requests = Workload(long_len=1500, output_len=40).requests(rate=3.0, num_requests=150,
                                                               seed=5)
    for mode in ("always_colocated", "always_disaggregated", "auto"):
        fast = ClusterSim(c, Topology(1, 2, routing(mode)))
        fast_out = fast.run(requests)
        monkeypatch.setattr(SimEngine, "max_run_steps", 1)
        slow = ClusterSim(c, Topology(1, 2, routing(mode)))
        slow_out = slow.run(requests)
        monkeypatch.setattr(SimEngine, "max_run_steps", None)
        assert slow.events > 3 * fast.events  # the reference really stepped one by one
        assert all(o.end_s is not None and not o.refused for o in fast_out)
        for a, b in zip(fast_out, slow_out):
            assert (a.path, a.request) == (b.path, b.request)
            assert (a.first_s, a.end_s) == pytest.approx((b.first_s, b.end_s), rel=1e-9)
        for engine in fast.engines.values():
            assert engine.free_blocks == c.decode.num_kv_blocks
            assert not engine.decode_batch and not engine.remote_waiting


def test_the_router_policy_decides_the_paths():
    c = costs()
    requests = Workload().requests(rate=1.0, num_requests=200, seed=2)
    long = sum(r.prompt_len == 2048 for r in requests)
    result = simulate(c, Topology(1, 1, routing("auto", 512)), requests, SLO)
    assert result["paths"] == {"colocated": 200 - long, "disaggregated": long}
    result = simulate(c, Topology(1, 1, routing("auto", 4096)), requests, SLO)
    assert result["paths"] == {"colocated": 200}
    # slo mode: a TTFT target no prompt can meet and `overload: reject` refuses early.
    strict = RoutingConfig(mode="slo", slo={"ttft_s": 0.001, "tpot_s": 0.1}, overload="reject")
    result = simulate(c, Topology(1, 1, strict), requests[:20], SLO)
    assert result["refused"] + result["completed"] == 20 and result["refused"] > 0
    # Same seed, same everything.
    again = simulate(c, Topology(1, 1, strict), requests[:20], SLO)
    assert again == result


def test_more_load_than_capacity_lowers_goodput_and_raises_latency():
    c = costs()
    low = simulate(c, Topology(1, 1, routing("auto")),
                   Workload().requests(rate=0.5, num_requests=200, seed=1), SLO)
    high = simulate(c, Topology(1, 1, routing("auto")),
                    Workload().requests(rate=20.0, num_requests=400, seed=1), SLO)
    assert low["good"] == low["sent"] == 200
    assert high["good"] < high["completed"] and high["ttft_s"]["p99"] > 5 * low["ttft_s"]["p99"]


# ---------------------------------------------------------------------------------- the node
def test_busy_time_and_the_node_load_it_implies():
    a = [(0.0, 1.0), (2.0, 3.0)]
    b = [(0.5, 2.5)]
    assert union_s([a, b]) == pytest.approx(3.0) and union_s([]) == 0.0
    # Any worker busy 3 s, 3 CPU seconds of traffic meanwhile: 1 core, on top of the background.
    assert load_cores(HostCosts(cores=2, idle_cores=0.5), [a, b], 3.0) == pytest.approx(1.5)
    assert load_cores(HostCosts(cores=2, idle_cores=0.5), [a, b], 30.0) == 2.0  # all of it


def _shared_node(host: HostCosts, load: float) -> tuple[ClusterSim, SimEngine, SimEngine]:
    sim = ClusterSim(costs(host=host), Topology(1, 1), host_load=load)
    return sim, sim.engines["prefill-0"], sim.engines["decode-0"]


def test_steps_on_a_shared_node_slow_down_only_while_they_overlap():
    """Two one-thread workers on two cores with half a core of other work: alone a step runs
    at full speed ((1 + 0.5) / 2 < 1), beside the other at 1 / 1.25; a step in progress is
    re-timed when the other starts or stops."""
    sim, a, b = _shared_node(HostCosts(cores=2), load=0.5)
    ends: dict = {}

    def piece(engine, seconds: float, name: str):
        def done() -> None:
            ends[name] = sim.now
            sim.cores.rest(engine)
        sim.cores.begin(engine, seconds, done)

    sim.at(0.0, lambda: piece(a, 1.0, "a"))
    sim.at(0.5, lambda: piece(b, 1.0, "b"))
    sim.at(3.0, lambda: piece(a, 0.4, "a alone"))
    sim.run([])
    # a: 0.5 s alone, then its last 0.5 s of compute at 1.25; b: 0.5 s of compute beside a
    # (0.625 s), then the rest alone.
    assert ends["a"] == pytest.approx(1.125) and ends["b"] == pytest.approx(1.625)
    assert ends["a alone"] == pytest.approx(3.4)
    assert sim.cores.work_s[a] == pytest.approx(1.4) and not sim.cores.busy

    # A run cut short while it shares the cores ends with the compute it has left.
    sim, a, b = _shared_node(HostCosts(cores=2), load=0.5)
    sim.at(0.0, lambda: piece(a, 2.0, "a"))
    sim.at(0.0, lambda: piece(b, 2.0, "b"))
    sim.at(1.0, lambda: sim.cores.resize(a, 1.0))  # 0.8 s of compute done by then; b 1.0 by
    # a's end at 1.25, the rest alone
    sim.run([])
    assert ends["a"] == pytest.approx(1.25) and ends["b"] == pytest.approx(2.25)

    # A worker whose step ends starts another's work in that moment (a prefill's KV lands): its
    # finished step is not re-timed, so it ends once.
    sim, a, b = _shared_node(HostCosts(cores=2), load=0.5)
    calls = []

    def a_done() -> None:
        calls.append(sim.now)
        piece(b, 0.5, "b after a")
        sim.cores.rest(a)

    sim.at(0.0, lambda: sim.cores.begin(a, 1.0, a_done))
    sim.run([])
    assert calls == [pytest.approx(1.0)] and ends["b after a"] == pytest.approx(1.5)

    # Relative to the calibration's own load (it fitted the steps with 1.5 cores busy): the
    # pair's 2.5 cores stretch by 1.25 / 1.25, a worker alone runs faster than it measured.
    sim, a, b = _shared_node(HostCosts(cores=2, calibration_cores=1.5), load=0.5)
    sim.cores.busy, sim.cores.busy_threads = {a, b}, 2
    assert sim.cores.stretch(a) == pytest.approx(1.0)
    sim.cores.busy, sim.cores.busy_threads = {a}, 1
    assert sim.cores.stretch(a) == pytest.approx(1 / 1.25)
    # Spare cores: no stretch.
    sim, a, b = _shared_node(HostCosts(cores=16), load=3.0)
    sim.cores.busy, sim.cores.busy_threads = {a, b}, 2
    assert sim.cores.stretch(a) == 1.0


def test_the_calibration_records_what_each_worker_stepped_beside():
    """Per stage: each worker's step time, weighted by the other workers' engine CPU over the
    stage (what its fitted step costs already hold); then the sweep's figure for the host."""
    from pd_runtime.planner.profile import _engines_beside

    # Two workers, 2 s: p stepped 1.5 s beside d's 1.0 s of CPU (0.5 cores), d 1.0 s beside
    # p's 1.2 s (0.6 cores).
    before = {"p": (10.0, 20.0), "d": (5.0, 7.0)}
    after = {"p": (11.5, 21.2), "d": (6.0, 8.0)}
    busy, beside = _engines_beside(before, after, 2.0, cores=2)
    assert busy == pytest.approx(2.5) and beside == pytest.approx(1.5 * 0.5 + 1.0 * 0.6)
    # A stale report can bring a second of earlier work into a short stage: held to the cores.
    _, beside = _engines_beside({"p": (10, 10), "d": (5, 5)}, {"p": (10.6, 10.6),
                                                              "d": (5.5, 5.5)}, 0.08, cores=2)
    assert beside == pytest.approx(0.6 * 2 + 0.5 * 2)
    # A worker in one report only (started, stopped) is left out; a restarted one too.
    assert _engines_beside({"p": (10, 10)}, {"p": (11, 11), "d": (1, 1)}, 2.0, 2) == (1, 0)
    assert _engines_beside({"p": (10, 10), "d": (5, 5)}, {"p": (11, 11), "d": (0.1, 0.1)},
                           2.0, 2) == (1, 0)
    stages = [{"seconds": 2.0, "requests": 1, "tokens": 10, "router_cpu_s": 0.1,
               "runtime_cpu_s": 0.1, "client_cpu_s": 0.1, "engine_busy_s": 2.5,
               "engine_beside_s": 1.35},
              {"seconds": 3.0, "requests": 2, "tokens": 5, "router_cpu_s": 0.2,
               "runtime_cpu_s": 0.1, "client_cpu_s": 0.1, "engine_busy_s": 0.5,
               "engine_beside_s": 0.0}]
    assert fit_host(stages, 2).calibration_others_cores == pytest.approx(1.35 / 3.0)


def test_nonnegative_least_squares_recovers_and_clamps():
    rows = [[s, r, t] for s, r, t in ((10, 4, 100), (5, 1, 40), (8, 8, 500), (20, 2, 20))]
    y = [0.01 * s + 0.002 * r + 0.0005 * t for s, r, t in rows]
    assert nnls(rows, y) == pytest.approx([0.01, 0.002, 0.0005], rel=1e-6)
    # A negative fit for a column is not a cost: it is left out and the others refitted.
    y = [0.01 * s - 0.002 * r for s, r, _ in rows]
    fit = nnls(rows, y)
    assert min(fit) >= 0 and fit[1] == 0.0


def test_router_cpu_on_the_workers_node_slows_them_with_the_rate():
    """Where the router (and the load generator) share the workers' cores, their CPU per token
    stretches the workers' steps as the rate grows; a deployment larger than that node is
    simulated as before."""
    busy_host = HostCosts(cores=2, router_token_cpu_s=2e-3, client_token_cpu_s=1e-3)
    requests = Workload().requests(rate=6.0, num_requests=150, seed=2)
    plain = simulate(costs(), Topology(1, 1, routing("auto")), requests, SLO)
    shared = simulate(costs(host=busy_host), Topology(1, 1, routing("auto"),
                                                     clients_on_host=True), requests, SLO)
    assert "stretch" not in plain and min(shared["stretch"].values()) > 1.0
    assert shared["tpot_s"]["p50"] > plain["tpot_s"]["p50"]
    router_only = simulate(costs(host=busy_host), Topology(1, 1, routing("auto")), requests, SLO)
    assert 1.0 <= max(router_only["stretch"].values()) < max(shared["stretch"].values())
    quiet = simulate(costs(host=busy_host), Topology(1, 1, routing("auto")),
                     Workload().requests(rate=0.2, num_requests=20, seed=2), SLO)
    assert max(quiet["stretch"].values()) < max(router_only["stretch"].values())
    larger = simulate(costs(host=busy_host), Topology(2, 2, routing("auto")), requests, SLO)
    assert "stretch" not in larger and larger == simulate(
        costs(), Topology(2, 2, routing("auto")), requests, SLO)


# ---------------------------------------------------------------------------------- plan
def test_plan_ranks_splits_and_plots(tmp_path):
    from pd_runtime.planner.plan import parse_slo, plan, plot, table

    assert parse_slo("ttft=2.5,tpot=100ms") == SLOTarget(ttft_s=2.5, tpot_s=0.1)
    with pytest.raises(ValueError, match="tpot"):
        parse_slo("ttft=2")
    ranked, info = plan(costs(), Workload(), SLO, devices=4, rates=[2.0, 6.0, 12.0],
                        duration_s=20.0)
    peaks = [c.peak["goodput_rps"] for c in ranked]
    assert peaks == sorted(peaks, reverse=True) and info["candidates"] == len(ranked) >= 5
    names = {c.name for c in ranked}
    assert "0P+4D always_colocated" in names and "1P+3D auto@2047" in names
    assert all(len(c.points) == 3 for c in ranked)
    text = table(ranked)
    assert ranked[0].name in text.splitlines()[1]
    # Without rates: each configuration's SLO capacity, bracketed and bisected.
    ranked, info = plan(costs(), Workload(), SLO, devices=2, duration_s=20.0)
    assert info["rates"] is None and info["simulations"] > 3 * info["candidates"]
    for cand in ranked:
        passing = [p["rate"] for p in cand.points if p["attainment"] >= 0.9]
        failing = [p["rate"] for p in cand.points if p["attainment"] < 0.9]
        assert cand.capacity == max(passing, default=0.0) and failing
        assert min(failing) > cand.capacity  # the search brackets it: nothing above passes
    assert [c.capacity for c in ranked] == sorted((c.capacity for c in ranked), reverse=True)
    png = tmp_path / "plan.png"
    plot(ranked, str(png), SLO)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------- commands
def _prompts_cost_more_the_longer(role) -> bool:
    """The fitted prefill cost grows with the prompt over the sweep's lengths. On a tiny model
    with a neighbour on the cores, the fit may put a prompt's cost in its per-token term or
    in its attention term (one of them reads 0 in some runs): their sum is what is measured."""
    short, long = (role.step_s(n, n * (n + 1) // 2, 0, 0) for n in (64, 1024))
    return 0 < short < long and long - short > 1e-4


def test_profile_simulate_plan_commands(llama_dir, tmp_path, capsys):
    import yaml

    from pd_runtime.cli import main

    engine = {"dtype": "float32", "num_kv_blocks": 512, "num_threads": 1, "warmup_tokens": 0}
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump({"model": llama_dir,
                                      "prefill": {"num_workers": 1, "engine": engine},
                                      "decode": {"num_workers": 1, "engine": engine}}))
    cost_path = tmp_path / "costs.json"
    assert main(["profile", "--config", str(config), "--in-process", "--quick",
                 "--out", str(cost_path)]) == 0
    measured = ClusterCosts.load(cost_path)
    assert _prompts_cost_more_the_longer(measured.prefill)
    assert _prompts_cost_more_the_longer(measured.decode)
    assert measured.decode.num_kv_blocks == 512 and measured.kv_bytes_per_token > 0
    assert measured.transfer_exposed_s is not None and measured.rpc_s > 0
    # For planning other degrees: the model's shape and the all-reduce timed over 2 ranks.
    assert measured.model.num_kv_heads == 2 and measured.model.tensor_parallel_sizes[:2] == [1, 2]
    assert measured.all_reduce[2].seconds(1) > 0 and "gloo" in measured.all_reduce[2].source
    assert measured.decode.tensor_parallel_size == 1 and measured.decode.kv_blocks_set
    capsys.readouterr()
    assert main(["simulate", "--cost-model", str(cost_path), "--rates", "5", "20",
                 "--num-requests", "100", "--mode", "auto", "--threshold", "256"]) == 0
    out = capsys.readouterr().out
    assert "1P+1D auto@256" in out and len(out.splitlines()) == 4
    assert main(["plan", "--cost-model", str(cost_path), "--workers", "3", "--rates", "5",
                 "20", "--duration", "10", "--png", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "recommended:" in out and (tmp_path / "p.png").exists()
    assert main(["plan", "--cost-model", str(cost_path), "--devices", "2",
                 "--tensor-parallel-sizes", "1,2", "--rates", "5", "--duration", "5"]) == 0
    out = capsys.readouterr().out
    assert "0P+1D(tp2) always_colocated" in out and "measured: gloo, 2 ranks" in out


def test_profile_through_a_running_routers_http_api(llama_dir):
    """`pd-runtime profile --url`: the sweep through the served OpenAI API (the router chooses
    the paths), the fitted figures from GET /v1/router/workers."""
    import asyncio

    import httpx

    from pd_runtime.config import RouterConfig
    from pd_runtime.planner.profile import calibrate_http
    from tests.pool_support import pair_config, served

    engine = {"dtype": "float32", "num_kv_blocks": 512, "num_threads": 1, "warmup_tokens": 0}
    router = RouterConfig(routing={"mode": "auto", "max_local_prefill_tokens": 128})
    cfg = pair_config(llama_dir, engine, router=router.model_dump(),
                      recovery={"health_check_interval_s": 0.5})
    with served(cfg, llama_dir, router) as base:
        costs = asyncio.run(calibrate_http(base, quick=True, repeats=2))
        workers = httpx.get(base + "/v1/router/workers").json()["workers"]
        metrics = httpx.get(base + "/metrics").text
    assert {w["role"] for w in workers.values()} == {"prefill", "decode"}
    assert all(w["load"]["step_costs"]["steps"] > 0 for w in workers.values())
    assert 'pd_routing_decisions_total{path="disaggregated"' in metrics
    assert _prompts_cost_more_the_longer(costs.prefill)
    assert costs.decode.coefficients["decode_seq_s"] > 0
    # Measured, not defaulted (on this tiny model the fit's noise can exceed them: >= 0).
    assert costs.colocated_overhead_s is not None and costs.colocated_overhead_s >= 0
    assert costs.disaggregated_overhead_s is not None and costs.disaggregated_overhead_s >= 0
    assert costs.transfer_exposed_s is not None
    # Router and workers in this one process on this machine: the node's CPU costs, measured.
    host = costs.host
    assert host is not None and host.cores >= 1 and host.calibration_cores > 0
    assert all(math.isfinite(v) and v >= 0 for v in vars(host).values())
    spread = costs.source["coefficient_spread"]  # two sweeps: each fit's median and range
    for worker_id, ranges in spread.items():
        role = "prefill" if worker_id.startswith("prefill") else "decode"
        fitted = getattr(costs, role).coefficients["decode_seq_s"]
        low, high = ranges["decode_seq_s"]
        assert low <= high and (role == "prefill" or low <= fitted <= high)


def test_ttft_fit_separates_a_fixed_cost_from_the_fits_error():
    from pd_runtime.planner.profile import _affine, apply_overheads

    assert _affine([(p, 0.02 + 1.25 * p) for p in (0.1, 0.4, 0.9)]) == \
        pytest.approx((0.02, 1.25))
    assert _affine([(0.3, 0.35), (0.3, 0.36), (0.3, 0.4)]) == pytest.approx((0.06, 1.0))
    assert _affine([]) == (0.0, 1.0)
    c = costs()
    before = c.prefill.coefficients["prefill_token_s"]
    timings = [{"path": "disaggregated", "concurrent": 1, "prompt_len": n, "tokens": 2,
                "tpot_s": None,
                "ttft_s": 0.05 + 1.5 * c.prefill.step_s(n, n * (n + 1) // 2, 0, 0)}
               for n in (512, 1024, 2048)]
    apply_overheads(c, timings)
    assert c.disaggregated_overhead_s == pytest.approx(0.05)
    assert c.prefill.coefficients["prefill_token_s"] == pytest.approx(1.5 * before)
