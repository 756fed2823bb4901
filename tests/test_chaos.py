"""Chaos suite, short form: the served product (`pd-runtime serve`, one prefill and one decode
worker, a small float32 model) under worker kills and stops, client disconnect storms, a burst
over capacity and link faults, every streamed request checked against the offline engine.

Asserted in every phase: no request wrong (silently different), hung or broken without an
OpenAI error, KV blocks back to baseline and nothing in flight; for a single worker killed or
stopped: no request failed either. The long form with the table is bench/chaos.py.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.chaos_support import faults, plans, report
from tests.chaos_support.product import ServedProduct, chaos_config, free_port
from tests.chaos_support.runner import RunSettings, run_phase, wait_quiescent
from tests.chaos_support.workload import SpecFactory, ambiguous_token_strings, references, \
    vocab_size

pytest.importorskip("ray")
pytestmark = pytest.mark.timeout(300)

DTYPE = "float32"  # bf16 is not yet batch-invariant; bench/chaos.py takes --dtype
SEED = 20261130
NUM_KV_BLOCKS = 256
MAX_LOCAL_PREFILL_TOKENS = 64  # long prompts (96-200 tokens) go disaggregated
STOP_S = 3.0
SETTINGS = RunSettings(hung_bound_s=60.0, back_timeout_s=90.0, quiesce_timeout_s=30.0)
# Small limits so that the burst really is far over capacity (8 running + 16 waiting each).
ENGINE_LIMITS = {"max_num_seqs": 8, "max_waiting_requests": 16}
LINK_FAULTS = {"drop": 0.3, "delay_s": 0.2, "corrupt": 0.3, "duplicate": 0.3}

WORKER_FAULTS = [  # (action, role, point): each single worker fault, one worker of each role
    ("kill", "prefill", "before_first_token"),
    ("kill", "prefill", "mid_transfer"),
    ("kill", "decode", "mid_stream"),
    ("kill", "decode", "mid_transfer"),
    ("stop", "prefill", "before_first_token"),
    ("stop", "decode", "mid_stream"),
]


def build_plans(vocab: int) -> dict[str, plans.PhasePlan]:
    rng = random.Random(SEED)
    factory = SpecFactory(vocab, SEED)
    out = [plans.PhasePlan("fault-free", plans.wave(factory, "fault-free", 4, 4, 0.05, rng))]
    for action, role, point in WORKER_FAULTS:
        name = f"{action}-{role}-{point}"
        arrivals = plans.wave(factory, name, 3, 5, 0.05, rng, max_tokens=32)
        out.append(plans.worker_fault(factory, rng, action, role, point, arrivals,
                                      stop_s=STOP_S, delay_kv_send_s=1.5, num_probes=10))
    out.append(plans.disconnect_storm(factory, rng, 16, max_tokens=200))
    out.append(plans.burst(factory, rng, 64))
    out.extend(plans.link_fault(factory, rng, kind, value, 8) for kind, value in
               LINK_FAULTS.items())
    return {p.name: p for p in out}


@pytest.fixture(scope="module")
def chaos(llama_dir, tmp_path_factory):
    phase_plans = build_plans(vocab_size(llama_dir))
    specs = [s for p in phase_plans.values() for s in p.specs()]
    refs = references(llama_dir, DTYPE, specs, num_kv_blocks=1024)
    overrides = {"prefill": {"engine": ENGINE_LIMITS}, "decode": {"engine": ENGINE_LIMITS},
                 "ray": {"num_cpus": 4}, "recovery": {"health_check_interval_s": 0.25},
                 # A dropped chunk fails its transfer at this deadline (then a local prefill).
                 "kv_transfer": {"transfer_timeout_s": 5.0, "lease_timeout_s": 10.0}}
    config = chaos_config(llama_dir, free_port(), DTYPE, NUM_KV_BLOCKS,
                          MAX_LOCAL_PREFILL_TOKENS, overrides)
    product = ServedProduct(config, tmp_path_factory.mktemp("chaos"))
    done = []
    try:
        product.start()
        ok, detail = wait_quiescent(product, SETTINGS.quiesce_timeout_s)
        assert ok, f"not at baseline before any fault: {detail}"
        yield dict(product=product, plans=phase_plans, refs=refs, done=done,
                   ambiguous=ambiguous_token_strings(llama_dir))
    finally:
        left = product.stop()
        print("\n" + report.table(done) + "\n" + report.details(done)
              + f"\nserve log: {product.log_path}")
    assert not left, f"processes left behind: {[(p.pid, p.cmdline[:80]) for p in left]}"


def run(chaos, name: str):
    product = chaos["product"]
    ok, detail = wait_quiescent(product, SETTINGS.quiesce_timeout_s)
    assert ok, f"{name}: the product is not at baseline before the phase: {detail}"
    phase = asyncio.run(run_phase(product, chaos["plans"][name], chaos["refs"],
                                  chaos["ambiguous"], SETTINGS))
    chaos["done"].append(phase)
    return phase


def check(phase, failed_allowed: bool) -> None:
    c = phase.counts
    why = f"{report.row(phase)}\n{report.details([phase])}"
    assert c["wrong"] == 0, f"silently wrong requests\n{why}"
    assert c["hung"] == 0, f"hung requests\n{why}"
    assert c["unclear"] == 0, f"requests broken without an OpenAI error\n{why}"
    if not failed_allowed:
        assert c["failed"] == 0, f"requests failed\n{why}"
    assert phase.quiescent, f"KV blocks not back to baseline or requests left in flight\n{why}"


def test_fault_free_served_output_matches_offline_engine(chaos):
    phase = run(chaos, "fault-free")
    check(phase, failed_allowed=False)
    assert phase.counts["correct"] == len(phase.results)


@pytest.mark.parametrize("action,role,point", WORKER_FAULTS,
                         ids=[f"{a}-{r}-{p}" for a, r, p in WORKER_FAULTS])
def test_single_worker_fault_loses_no_request(chaos, action, role, point):
    phase = run(chaos, f"{action}-{role}-{point}")
    assert phase.fault_at is not None, f"the fault never fired: {phase.notes}"
    if action == "kill":
        assert phase.worker_back_at is not None, f"killed worker not back: {phase.notes}"
    check(phase, failed_allowed=False)
    assert phase.recovery_s is not None, f"no correct request after the fault: {phase.notes}"


def test_disconnect_storm_frees_every_block(chaos):
    phase = run(chaos, "disconnect-storm")
    check(phase, failed_allowed=False)
    assert phase.counts["cancelled"] >= len(phase.results) // 2


def test_burst_over_capacity_is_refused_fast_or_served(chaos):
    phase = run(chaos, "burst")
    check(phase, failed_allowed=True)
    refused = [r for r in phase.results if r.label_class == "failed"]
    assert refused, "the burst never went over capacity: raise its size"
    bad = [f"{r.spec.label} {r.response_id}: HTTP {r.status}, retry-after {r.retry_after}, "
           f"in stream: {r.error_in_stream}" for r in refused
           if r.status not in (429, 503) or r.error_in_stream or not r.retry_after]
    assert not bad, "refusals must be 429/503 before the stream, with Retry-After:\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("kind", list(LINK_FAULTS))
def test_link_faults_lose_nothing(chaos, kind):
    unsupported = faults.link_faults_unsupported()
    if unsupported:
        pytest.skip(unsupported)
    phase = run(chaos, f"link-{kind}")
    counted = "delay" if kind == "delay_s" else kind
    assert phase.link_faults_applied.get(counted, 0) > 0, \
        f"no chunk was {counted}: {phase.link_faults_applied}"
    check(phase, failed_allowed=True)
