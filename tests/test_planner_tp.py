"""The planner with tensor-parallel workers (pd_runtime/planner/tensor_parallel.py): a worker of
degree t takes t devices, its step costs are measured at t or derived from t=1's by the
documented formula, its KV capacity follows the model's KV-head rule, and `pd-runtime plan`
names t. (The planner does not check memory: its KV blocks are the profile's.)
"""

from __future__ import annotations

import json

import pytest

from pd_runtime.config import RoutingConfig, SLOTarget
from pd_runtime.planner.costs import AllReduceCosts, ClusterCosts, ModelShape, RoleCosts
from pd_runtime.planner.plan import candidates, plan
from pd_runtime.planner.simulator import ClusterSim, Topology, shares_host
from pd_runtime.planner.tensor_parallel import (DEFAULT_ALL_REDUCE, derive, describe,
                                                kv_capacity_factor, kv_heads_per_rank, merge,
                                                role_costs)
from pd_runtime.planner.workload import SimRequest, Workload

COEF = dict(step_s=0.004, prefill_token_s=2.5e-4, prefill_attention_s=1e-8,
            decode_seq_s=8e-4, decode_context_s=2e-7)
SLO = SLOTarget(ttft_s=2.5, tpot_s=0.1)
MODEL = ModelShape(num_layers=8, num_kv_heads=8, hidden_size=1024, activation_bytes=2,
                   tensor_parallel_sizes=[1, 2, 4, 8])
ALL_REDUCE = AllReduceCosts(latency_s=1e-4, gbps=10.0, source="test")


def costs(model=MODEL, blocks=4096, t=1, **over) -> ClusterCosts:
    role = RoleCosts(coefficients=dict(COEF), num_kv_blocks=blocks, tensor_parallel_size=t)
    return ClusterCosts(prefill=role, decode=role, kv_bytes_per_token=32768, transfer_gbps=2.0,
                        rpc_s=0.002, router_overhead_s=0.0005, num_layers=8, model=model,
                        all_reduce={2: ALL_REDUCE}, **over)


# ---------------------------------------------------------------------------------- KV heads
def test_the_kv_head_rule_is_the_models():
    """The planner's torch-free rule against pd_runtime/model/tensor_parallel.py's, for every
    split the model allows (K and t, one dividing the other), every rank."""
    from pd_runtime.model.tensor_parallel import kv_heads_of_rank

    checked = 0
    for heads in range(1, 17):
        for t in range(1, 17):
            if heads % t and t % heads:
                continue
            per_rank = {len(kv_heads_of_rank(heads, t, r)) for r in range(t)}
            assert per_rank == {kv_heads_per_rank(heads, t)}, (heads, t)
            checked += 1
    assert checked > 50
    # Capacity per worker: K / (heads per rank) times t=1's; t when K >= t, K when fewer.
    assert [kv_capacity_factor(8, t) for t in (1, 2, 4, 8)] == [1, 2, 4, 8]
    assert [kv_capacity_factor(2, t) for t in (1, 2, 4, 8)] == [1, 2, 2, 2]
    assert kv_capacity_factor(1, 4) == 1


# ---------------------------------------------------------------------------------- costs
def test_derived_step_costs_follow_the_formula():
    base = costs().decode
    d = derive(base, 2, MODEL, ALL_REDUCE)
    reduces = 2 * 8
    per_token = reduces * 1024 * 2 / 10e9
    assert d.coefficients == pytest.approx({
        "step_s": 0.004 / 2 + reduces * 1e-4,
        "prefill_token_s": 2.5e-4 / 2 + per_token,
        "decode_seq_s": 8e-4 / 2 + per_token,
        "prefill_attention_s": 1e-8 / 2,
        "decode_context_s": 2e-7 / 2}, rel=1e-12)
    assert (d.num_kv_blocks, d.threads, d.tensor_parallel_size) == (4096 * 2, 2, 2)
    assert base.coefficients == COEF  # the measured role is not touched
    # Fewer KV heads than ranks: a head is replicated, each rank reads and holds 1 of 2.
    gqa = ModelShape(num_layers=8, num_kv_heads=2, hidden_size=1024, activation_bytes=2,
                     tensor_parallel_sizes=[1, 2, 4])
    d4 = derive(base, 4, gqa, ALL_REDUCE)
    assert d4.num_kv_blocks == 4096 * 2 and d4.threads == 4
    assert d4.coefficients["decode_context_s"] == pytest.approx(2e-7 / 2)
    assert d4.coefficients["prefill_attention_s"] == pytest.approx(1e-8 / 4)
    # engine.num_kv_blocks set: each rank holds that many blocks at any degree.
    fixed = RoleCosts(coefficients=dict(COEF), num_kv_blocks=512, kv_blocks_set=True)
    assert derive(fixed, 2, MODEL, ALL_REDUCE).num_kv_blocks == 512
    assert derive(base, 1, MODEL, ALL_REDUCE) is base


def test_measured_costs_at_t_win_and_what_is_missing_is_named():
    c = costs()
    assert role_costs(c, "decode", 1) is c.decode
    assert role_costs(c, "decode", 2).coefficients["step_s"] == pytest.approx(0.002 + 16e-4)
    assert "derived from t=1" in describe(c, "decode", 2) and "test" in describe(c, "decode", 2)
    # No measured all-reduce at 4 ranks: the documented default, said so.
    assert role_costs(c, "decode", 4).coefficients["step_s"] == \
        pytest.approx(0.004 / 4 + 16 * DEFAULT_ALL_REDUCE.latency_s)
    assert "default" in describe(c, "decode", 4)
    # A profile taken at t=2 (merged from a second file) is used as measured.
    at2 = costs(t=2)
    at2.decode = RoleCosts(coefficients={**COEF, "step_s": 0.0031}, tensor_parallel_size=2)
    merge(c, at2, "t2.json")
    assert role_costs(c, "decode", 2).coefficients["step_s"] == 0.0031
    assert describe(c, "decode", 2) == "decode t=2: measured"
    with pytest.raises(ValueError, match="second profile of the prefill workers"):
        merge(c, at2, "again.json")
    with pytest.raises(ValueError, match="divide by it"):
        role_costs(c, "decode", 3)
    with pytest.raises(ValueError, match="model's shape"):
        role_costs(costs(model=None), "decode", 2)
    with pytest.raises(ValueError, match="measured at tensor_parallel_size 2"):
        role_costs(costs(t=2), "decode", 4)


def test_the_cost_model_file_keeps_the_degrees(tmp_path):
    c = costs()
    merge(c, costs(t=2), "t2")
    path = tmp_path / "costs.json"
    c.save(path)
    again = ClusterCosts.load(path)
    assert again == c and again.measured_tp[2]["prefill"].tensor_parallel_size == 2
    assert again.all_reduce[2] == ALL_REDUCE and again.model == MODEL
    # A file from before tensor parallelism loads as t=1 with nothing to derive from.
    data = json.loads(path.read_text())
    for key in ("model", "all_reduce", "measured_tp"):
        del data[key]
    for role in ("prefill", "decode"):
        del data[role]["tensor_parallel_size"], data[role]["kv_blocks_set"]
    old = ClusterCosts.from_dict(data)
    assert old.decode.tensor_parallel_size == 1 and old.model is None and not old.all_reduce


# ---------------------------------------------------------------------------------- simulator
def test_a_worker_of_degree_t_counts_t_devices_and_t_times_the_threads():
    top = Topology(1, 2, RoutingConfig(), prefill_tp=2, decode_tp=2)
    assert top.devices == 6 and top.name == "1P(tp2)+2D(tp2) slo"
    assert Topology(1, 3).devices == 4 and Topology(1, 3).name == "1P+3D slo"
    from pd_runtime.planner.costs import HostCosts

    # Two one-thread workers fit a 2-core node; of degree 2 they take 4 cores: not that node.
    host = costs(host=HostCosts(cores=2))
    assert shares_host(host, Topology(1, 1))
    assert not shares_host(host, Topology(1, 1, prefill_tp=2, decode_tp=2))
    sample = Workload().requests(rate=1.0, num_requests=200, seed=0)
    tops = candidates(4, sample, RoutingConfig(), ((1, 1), (1, 2), (2, 2)))
    assert all(t.devices <= 4 for t in tops)
    names = {t.name for t in tops}
    assert {"0P+4D always_colocated", "0P+2D(tp2) always_colocated",
            "1P+1D(tp2) always_disaggregated", "1P(tp2)+1D(tp2) always_disaggregated"} <= names
    assert not any("3D(tp2)" in n or "2P(tp2)+1D(tp2)" in n for n in names)


def test_the_simulated_worker_steps_and_holds_as_derived():
    """One request on a colocated worker of degree 2: its first token after the derived
    prefill step; its KV blocks twice t=1's."""
    c = costs()
    sim = ClusterSim(c, Topology(0, 1, RoutingConfig(mode="always_colocated"), decode_tp=2))
    engine = sim.engines["decode-0"]
    assert engine.free_blocks == 2 * 4096 and engine.costs.tensor_parallel_size == 2
    [out] = sim.run([SimRequest(0, 1.0, 300, 1)])
    prefill = role_costs(c, "decode", 2).step_s(300, 300 * 301 // 2, 0, 0)
    assert out.ttft_s(c.router_overhead_s) == pytest.approx(c.rpc_s + prefill +
                                                            c.router_overhead_s, rel=1e-9)


def test_plan_considers_degrees_within_the_devices():
    ranked, info = plan(costs(), Workload(), SLO, devices=4, rates=[2.0, 8.0], duration_s=10.0,
                        tensor_parallel_sizes=[1, 2])
    assert info["degrees"] == {"prefill": [1, 2], "decode": [1, 2]}
    assert all(c.topology.devices <= 4 for c in ranked)
    assert {c.topology.decode_tp for c in ranked} == {1, 2}
    assert any("derived from t=1" in s for s in info["sources"])
    # Default: the degrees profiled (t=1 here): the same candidates as before.
    ranked1, _ = plan(costs(), Workload(), SLO, devices=4, rates=[2.0, 8.0], duration_s=10.0)
    assert all(c.topology.prefill_tp == c.topology.decode_tp == 1 for c in ranked1)
    assert {c.name for c in ranked1} <= {c.name for c in ranked}
    # A profile taken at t=2: its degree by default, each worker two devices.
    ranked2, _ = plan(costs(t=2), Workload(), SLO, devices=4, rates=[2.0], duration_s=5.0)
    assert {c.name for c in ranked2} >= {"0P+2D(tp2) always_colocated"}
    assert all(c.topology.devices <= 4 for c in ranked2)
    with pytest.raises(ValueError, match="devices-per-node"):
        plan(costs(), Workload(), SLO, devices=8, rates=[1.0], tensor_parallel_sizes=[1, 4],
             devices_per_node=2)
    with pytest.raises(ValueError, match="no worker of degree 8 fits"):
        plan(costs(), Workload(), SLO, devices=4, rates=[1.0], tensor_parallel_sizes=[8],
             devices_per_node=8)


def test_plan_command_names_t(tmp_path, capsys):
    from pd_runtime.cli import main

    path = tmp_path / "costs.json"
    costs().save(path)
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--cost-model", str(path), "--devices", "4", "--tensor-parallel-sizes",
                 "1,2", "--rates", "2", "8", "--duration", "5", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "(tp2)" in out and "# decode t=2: derived from t=1" in out
    assert "recommended:" in out and "tensor_parallel_size" in out and "devices)" in out
    ranked = json.loads(out_json.read_text())["ranked"]
    assert {r["decode_tp"] for r in ranked} == {1, 2} and all(r["devices"] <= 4 for r in ranked)
    # The all-reduce flags replace the measured figures for every derived degree.
    assert main(["plan", "--cost-model", str(path), "--devices", "2", "--tensor-parallel-sizes",
                 "2", "--rates", "2", "--duration", "5", "--all-reduce-latency-us", "50",
                 "--all-reduce-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "50 us + 100 GB/s: --all-reduce-latency-us/--all-reduce-gbps" in out
    assert main(["simulate", "--cost-model", str(path), "--rates", "2", "--num-requests", "20",
                 "--prefill", "0", "--decode", "1", "--mode", "always_colocated",
                 "--tensor-parallel-size", "2"]) == 0
    assert "0P+1D(tp2) always_colocated" in capsys.readouterr().out


def test_profile_records_what_it_could_not_measure():
    from pd_runtime.planner.profile import add_tensor_parallel
    from pd_runtime.planner.profile_tp import measure

    note: dict = {}
    assert measure([0, 1, 2], MODEL, "cuda", 512, note) == {}
    assert "NCCL" in note["all_reduce_2"] and len(note) == 1
    c = costs(model=None)
    add_tensor_parallel(c, None, "auto", "cpu", [2], 512)
    assert c.model is None and "--model" in c.source["model"]
