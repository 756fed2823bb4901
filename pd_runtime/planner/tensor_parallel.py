"""What a worker of degree t (engine.tensor_parallel_size: t ranks, each with 1/t of the heads,
MLP columns and experts, pd_runtime/model/tensor_parallel.py) costs the planner: t devices,
and its step costs and KV capacity, measured at t or derived from the t=1 profile.

Measured: a profile taken at t (its roles say `tensor_parallel_size`), or one merged from
another profile (`pd-runtime plan --cost-model t1.json t2.json`), is used as it is.

Derived from t=1's fitted step (pd_runtime/engine/step_costs.py's linear form), with L layers,
K KV heads, hidden size h, activations of b bytes and k = kv_heads_per_rank(K, t):

    step_s(t)              = step_s / t              + 2 L x latency
    prefill_token_s(t)     = prefill_token_s / t     + 2 L x h b / rate
    decode_seq_s(t)        = decode_seq_s / t        + 2 L x h b / rate
    prefill_attention_s(t) = prefill_attention_s / t
    decode_context_s(t)    = decode_context_s x k / K
    num_kv_blocks(t)       = num_kv_blocks x K // k  (unless engine.num_kv_blocks was set)

Each rank computes 1/t of every matmul and query head (compute split t ways); a decode step
reads each context token's KV of its own k heads (k / K of it: 1/t, or 1/K where a head is
replicated over t/K ranks); and every layer all-reduces its attention's and its MLP's output,
each all-reduce one message of the step's tokens' hidden states: latency + bytes / rate.
`latency` and `rate` come from `pd-runtime profile`, which times the runtime's own
all-reduce (model/parallel_comm.py) over t ranks on the machine it runs on (the CPU's gloo
only; NCCL is not measured), else from `plan --all-reduce-latency-us / --all-reduce-gbps`,
else DEFAULT_ALL_REDUCE, a rough figure for the CPU (see there). Optimistic where a step's
work does not split: Python per layer, the driver's sampling and logits, the replicated
embedding and norms sit in the fitted coefficients and are divided by t with them (a profile
at t measures them). The engine-loop overhead (step_overhead_s) stays whole.

KV: each rank holds the same byte budget (kv_cache_memory_bytes) for its k heads, so a worker
holds K / k times t=1's tokens: t times, or K times where K < t. The KV transfer is unchanged
(the same bytes per token at the measured link rate). Memory is not checked: the blocks are
what the profile's workers reported.
"""

from __future__ import annotations

import copy
from dataclasses import replace

from pd_runtime.planner.costs import AllReduceCosts, ClusterCosts, ModelShape, RoleCosts

# No measurement: two ranks' gloo all-reduce over loopback on the 2-core box, timed as
# `profile` times it (1 to 1024 tokens of 64 or 4096 float32 values: 0.7-1.0 ms and
# 0.7-0.9 GB/s), rounded: an order of magnitude for a CPU deployment, not for NCCL (measure, or pass the
# plan's --all-reduce-* flags).
DEFAULT_ALL_REDUCE = AllReduceCosts(latency_s=1e-3, gbps=1.0,
                                    source="default (gloo over loopback, 2-core box, rounded)")
ALL_REDUCES_PER_LAYER = 2  # attention's output projection and the MLP's down (or experts')


def kv_heads_per_rank(num_kv_heads: int, t: int) -> int:
    """The KV heads each rank of t holds: K / t, or one (replicated) where K < t; the rule of
    pd_runtime/model/tensor_parallel.py kv_heads_of_rank (a test holds them equal)."""
    return num_kv_heads // t if num_kv_heads >= t else 1


def kv_capacity_factor(num_kv_heads: int, t: int) -> int:
    """How many times t=1's KV tokens a worker of degree t holds, on the same budget per rank."""
    return num_kv_heads // kv_heads_per_rank(num_kv_heads, t)


def all_reduce_at(costs: ClusterCosts, t: int) -> AllReduceCosts:
    return costs.all_reduce.get(t, DEFAULT_ALL_REDUCE)


def derive(base: RoleCosts, t: int, model: ModelShape, all_reduce: AllReduceCosts) -> RoleCosts:
    """t=1's role costs at degree t (the module's formula)."""
    if base.tensor_parallel_size != 1:
        raise ValueError(f"role costs measured at tensor_parallel_size "
                         f"{base.tensor_parallel_size}: only t=1's are derived from")
    if t == 1:
        return base
    c, k = base.coefficients, kv_heads_per_rank(model.num_kv_heads, t)
    reduces = ALL_REDUCES_PER_LAYER * model.num_layers
    per_token = reduces * model.hidden_size * model.activation_bytes / (all_reduce.gbps * 1e9)
    coefficients = {
        "step_s": c["step_s"] / t + reduces * all_reduce.latency_s,
        "prefill_token_s": c["prefill_token_s"] / t + per_token,
        "decode_seq_s": c["decode_seq_s"] / t + per_token,
        "prefill_attention_s": c["prefill_attention_s"] / t,
        "decode_context_s": c["decode_context_s"] * k / model.num_kv_heads,
    }
    blocks = base.num_kv_blocks if base.kv_blocks_set else \
        base.num_kv_blocks * kv_capacity_factor(model.num_kv_heads, t)
    return replace(base, coefficients=coefficients, num_kv_blocks=blocks,
                   threads=base.threads * t, tensor_parallel_size=t)


def role_costs(costs: ClusterCosts, role: str, t: int) -> RoleCosts:
    """`role`'s costs ("prefill" or "decode") for workers of degree t: measured at t, else
    derived from t=1's. Errors name what is missing."""
    measured = getattr(costs, role)
    if measured.tensor_parallel_size == t:
        return measured
    if role in costs.measured_tp.get(t, {}):
        return costs.measured_tp[t][role]
    if measured.tensor_parallel_size != 1:
        raise ValueError(f"cost model: the {role} costs were measured at tensor_parallel_size "
                         f"{measured.tensor_parallel_size} and none at {t}; add a profile at "
                         f"t={t} or at t=1 (plan --cost-model FILE FILE...)")
    model = costs.model
    if model is None:
        raise ValueError(f"cost model: deriving tensor_parallel_size {t} needs the model's "
                         "shape; profile again with this version (or --model with --url)")
    if t not in model.tensor_parallel_sizes:
        raise ValueError(f"tensor_parallel_size {t}: the model's heads, MLP width or experts "
                         f"do not divide by it (it splits over {model.tensor_parallel_sizes})")
    return derive(measured, t, model, all_reduce_at(costs, t))


def merge(costs: ClusterCosts, other: ClusterCosts, name: str = "") -> None:
    """Add another profile's role costs (at its degree) and all-reduce figures to `costs`;
    the cluster-wide figures (link, RPC, host) stay `costs`'."""
    for role in ("prefill", "decode"):  # all checked before any is added
        t = getattr(other, role).tensor_parallel_size
        if t == getattr(costs, role).tensor_parallel_size or role in costs.measured_tp.get(t, {}):
            raise ValueError(f"cost model {name}: a second profile of the {role} workers at "
                             f"tensor_parallel_size {t}")
    for role in ("prefill", "decode"):
        theirs = getattr(other, role)
        costs.measured_tp.setdefault(theirs.tensor_parallel_size, {})[role] = \
            copy.deepcopy(theirs)
    for t, measured in other.all_reduce.items():
        costs.all_reduce.setdefault(t, measured)
    if costs.model is None:
        costs.model = other.model


def describe(costs: ClusterCosts, role: str, t: int) -> str:
    """Where `role`'s costs at degree t come from, for the plan's output."""
    measured = getattr(costs, role)
    if measured.tensor_parallel_size == t or role in costs.measured_tp.get(t, {}):
        return f"{role} t={t}: measured"
    a = all_reduce_at(costs, t)
    if costs.model is None:
        return f"{role} t={t}: not measured, and no model shape to derive it from"
    return (f"{role} t={t}: derived from t=1 (compute / {t}, "
            f"{ALL_REDUCES_PER_LAYER * costs.model.num_layers} all-reduces a step at "
            f"{a.latency_s * 1e6:.0f} us + {a.gbps:.3g} GB/s: {a.source})")
