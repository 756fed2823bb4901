"""The cost model the planner simulates with: what a prefill, a decode step and a KV transfer
take on this deployment's workers, as the workers measured it (one model, not two: the
coefficients are those of each engine's own step-cost fit, pd_runtime/engine/step_costs.py,
which the router's live cost model, pd_runtime/router/cost_model.py, reads from the same load reports).

Written by `pd-runtime profile` as JSON; read by `pd-runtime plan`.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from pd_runtime.router.cost_model import WorkerCosts

COEFFICIENTS = ("step_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s",
                "decode_context_s")


@dataclass
class RoleCosts:
    """One kind of worker (prefill or decode): its step costs and its engine's limits."""

    coefficients: dict[str, float]
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    num_kv_blocks: int = 4096
    block_size: int = 16
    step_time_target_s: Optional[float] = None
    max_model_len: int = 4096
    # Per engine-loop iteration, besides the step's compute the engine fits: handing outputs
    # to the streams, commands, load reports (measured by `profile` as the batch-1 decode
    # period at the client minus the fitted step).
    step_overhead_s: float = 0.0
    threads: int = 1  # the cores one worker's steps use (torch threads, all of its ranks')
    # The worker's degree when measured: t ranks (engine.tensor_parallel_size). A pool planned
    # at another degree takes its costs from pd_runtime/planner/tensor_parallel.py.
    tensor_parallel_size: int = 1
    # engine.num_kv_blocks was set: each rank holds that many blocks at any degree (else the
    # blocks come from a byte budget per rank, and a rank's blocks shrink with its KV heads).
    kv_blocks_set: bool = False

    def __post_init__(self):
        missing = [name for name in COEFFICIENTS if name not in self.coefficients]
        if missing:
            raise ValueError(f"cost model: coefficients lack {missing}")
        bad = [name for name, value in self.coefficients.items()
               if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0)]
        if bad:
            raise ValueError(f"cost model: coefficients {bad} must be finite and >= 0")

    def worker_costs(self) -> WorkerCosts:
        c = self.coefficients
        return WorkerCosts(step_s=c["step_s"], prefill_token_s=c["prefill_token_s"],
                           prefill_attention_s=c["prefill_attention_s"],
                           decode_seq_s=c["decode_seq_s"],
                           decode_context_s=c["decode_context_s"],
                           max_batched_tokens=self.max_num_batched_tokens)

    def step_s(self, prefill_tokens: int, prefill_attention: int, decode_seqs: int,
               decode_context: int) -> float:
        """One engine step's seconds: the same linear form the engine fits to its steps."""
        c = self.coefficients
        return (c["step_s"] + self.step_overhead_s + c["prefill_token_s"] * prefill_tokens
                + c["prefill_attention_s"] * prefill_attention
                + c["decode_seq_s"] * decode_seqs + c["decode_context_s"] * decode_context)

    @classmethod
    def from_load(cls, load: dict, engine: Optional[dict] = None) -> "RoleCosts":
        """From a worker's load report (its fitted coefficients and limits) and, where the
        report does not say, the engine config it runs."""
        engine = engine or {}
        report = load.get("step_costs") or {}
        coefficients = report.get("coefficients")
        if not coefficients:
            raise ValueError(f"worker {load.get('worker_id')} reports no step costs yet")
        ranks = int(engine.get("tensor_parallel_size") or 1)
        return cls(coefficients={k: float(coefficients[k]) for k in COEFFICIENTS},
                   max_num_batched_tokens=int(load.get("max_num_batched_tokens", 2048)),
                   max_num_seqs=int(load.get("max_num_seqs", 128)),
                   num_kv_blocks=int(load.get("total_blocks", 4096)),
                   block_size=int(load.get("block_size", 16)),
                   step_time_target_s=engine.get("step_time_target_s"),
                   threads=ranks * int(load.get("num_threads") or engine.get("num_threads") or 1),
                   tensor_parallel_size=ranks,
                   kv_blocks_set=engine.get("num_kv_blocks") is not None,
                   max_model_len=int(load.get("max_model_len") or engine.get("max_model_len")
                                     or 4096))


@dataclass
class HostCosts:
    """The CPU that the router (and clients, where they run there too) takes on a node it
    shares with the workers, measured by `pd-runtime profile --url`: on such a node the workers'
    steps slow down as that CPU grows with the request rate (pd_runtime/planner/host.py)."""

    cores: int                           # the node's CPUs
    idle_cores: float = 0.0              # router + workers' background work, no traffic
    router_request_cpu_s: float = 0.0    # router CPU per request
    router_token_cpu_s: float = 0.0      # ... and per output token streamed
    client_request_cpu_s: float = 0.0    # the calibration's client, on the same node
    client_token_cpu_s: float = 0.0
    # The workers' own CPU outside their engine steps (streaming tokens out, sending KV).
    runtime_request_cpu_s: float = 0.0
    runtime_token_cpu_s: float = 0.0
    calibration_cores: float = 0.0       # router + client CPU during the sweep, in cores
    # The other workers' engines running beside a worker's steps during the sweep, in cores
    # (two colocated workers share its batches): its fitted step costs include that much.
    calibration_others_cores: float = 0.0

    def cpu_s(self, requests: int, tokens: int, seconds: float, clients: bool) -> float:
        """CPU seconds the router, the workers outside their steps (and the clients if
        `clients`) spend over `seconds` of
        serving `requests` requests and `tokens` output tokens."""
        cpu = self.idle_cores * seconds \
            + (self.router_request_cpu_s + self.runtime_request_cpu_s) * requests \
            + (self.router_token_cpu_s + self.runtime_token_cpu_s) * tokens
        if clients:
            cpu += self.client_request_cpu_s * requests + self.client_token_cpu_s * tokens
        return cpu


@dataclass
class ModelShape:
    """What splitting the model over t ranks changes, read from its config.json by `profile`
    (pd_runtime/planner/profile_tp.py: model_shape)."""

    num_layers: int
    num_kv_heads: int
    hidden_size: int
    activation_bytes: int  # one value of the hidden state in the dtype the engines run
    # The degrees its heads, MLP width and experts divide by (model/tensor_parallel.py's
    # unsupported_reason), up to engine.tensor_parallel_size's limit.
    tensor_parallel_sizes: list[int] = field(default_factory=lambda: [1])


@dataclass
class AllReduceCosts:
    """One all-reduce of a step's hidden states over a worker's ranks:
    latency_s + bytes / (gbps x 1e9), bytes = tokens x hidden_size x activation_bytes."""

    latency_s: float
    gbps: float
    source: str = ""  # measured where and how, or which default

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / (self.gbps * 1e9)


@dataclass
class ClusterCosts:
    """Everything the simulator needs to know about the hardware and the runtime."""

    prefill: RoleCosts
    decode: RoleCosts
    kv_bytes_per_token: int = 0
    transfer_gbps: float = 1.0        # prefill -> decode link, measured on the sends
    rpc_s: float = 0.003              # a Ray call and its answer
    router_overhead_s: float = 0.0005  # what the router adds to a request's TTFT
    # A request's time to first token besides its prefill's compute, router to first token at
    # the pool client and back, per path (measured by `profile`; None: rpc_s, 2 x rpc_s).
    colocated_overhead_s: Optional[float] = None
    disaggregated_overhead_s: Optional[float] = None
    num_layers: int = 1
    stream_layers: bool = True
    # Streamed: the mean wait from the prompt's last layer to the KV landed, as the prefill
    # workers measured it (TransferOverlap); None: the last layer's share of bytes/rate.
    transfer_exposed_s: Optional[float] = None
    # The router's node, when the workers share it (None: the router has its own cores).
    host: Optional[HostCosts] = None
    source: dict = field(default_factory=dict)  # where and when it was measured
    # Tensor parallelism (pd_runtime/planner/tensor_parallel.py): the model's shape, the
    # all-reduce measured by `profile` per number of ranks, and role costs measured at other
    # degrees (from other profiles: degree -> role -> costs).
    model: Optional[ModelShape] = None
    all_reduce: dict[int, AllReduceCosts] = field(default_factory=dict)
    measured_tp: dict[int, dict[str, RoleCosts]] = field(default_factory=dict)

    def transfer_s(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9)

    def overhead_s(self, path: str) -> float:
        if path == "colocated":
            return self.rpc_s if self.colocated_overhead_s is None else self.colocated_overhead_s
        return 2 * self.rpc_s if self.disaggregated_overhead_s is None \
            else self.disaggregated_overhead_s

    def exposed_s(self, tokens: int) -> float:
        """What the decode side waits for the KV after the prefill's last step."""
        if not self.stream_layers:
            return self.transfer_s(tokens)
        if self.transfer_exposed_s is not None:
            return self.transfer_exposed_s
        return self.transfer_s(tokens) / max(1, self.num_layers)

    # -- files -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": 1, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "ClusterCosts":
        if data.get("version") != 1:
            raise ValueError(f"cost model: version {data.get('version')!r} is not 1")
        fields = {k: v for k, v in data.items() if k != "version"}
        for role in ("prefill", "decode"):
            if role not in fields:
                raise ValueError(f"cost model: no '{role}' section")
        try:
            for role in ("prefill", "decode"):
                fields[role] = RoleCosts(**fields[role])
            if fields.get("host") is not None:
                fields["host"] = HostCosts(**fields["host"])
            if fields.get("model") is not None:
                fields["model"] = ModelShape(**fields["model"])
            # JSON keys are strings: the degrees back to ints.
            fields["all_reduce"] = {int(t): AllReduceCosts(**a)
                                    for t, a in (fields.get("all_reduce") or {}).items()}
            fields["measured_tp"] = {int(t): {role: RoleCosts(**r) for role, r in roles.items()}
                                     for t, roles in (fields.get("measured_tp") or {}).items()}
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(f"cost model: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "ClusterCosts":
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"cost model {path}: not JSON ({exc})") from None
        return cls.from_dict(data)

    @classmethod
    def from_loads(cls, prefill_load: dict, decode_load: dict, *, prefill_engine: dict,
                   decode_engine: dict, num_layers: int, stream_layers: bool,
                   rpc_s: float, router_overhead_s: float, max_model_len: int,
                   note: str = "") -> "ClusterCosts":
        """From one prefill and one decode worker's load reports after a calibration sweep."""
        send = (prefill_load.get("kv_transfer") or {}).get("send_gbps") or 1.0
        overlap = prefill_load.get("kv_overlap") or {}
        exposed = overlap["exposed_s_total"] / overlap["transfers"] \
            if overlap.get("transfers") else None
        limits = {"max_model_len": max_model_len}
        return cls(prefill=RoleCosts.from_load({**prefill_load, **limits}, prefill_engine),
                   decode=RoleCosts.from_load({**decode_load, **limits}, decode_engine),
                   kv_bytes_per_token=int(decode_load.get("kv_bytes_per_token") or 0),
                   transfer_gbps=float(send), rpc_s=rpc_s, router_overhead_s=router_overhead_s,
                   num_layers=num_layers, stream_layers=stream_layers,
                   transfer_exposed_s=exposed if stream_layers else None,
                   source={"measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "note": note})
