"""Typed configuration for every part of pd-runtime; with config_router.py (the router section)
and config_base.py, the only place defaults live.

YAML files are parsed into these pydantic models at load time by config_loading.py (errors name
the file, the dotted field and its line); constructors take the models.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pd_runtime.config_base import FieldValueError, _dotted, _Strict  # noqa: F401 (re-exported)
from pd_runtime.config_router import (DecodeCostWeights, PrefillCostWeights,  # noqa: F401
                                      RouterConfig, RoutingConfig, SLOClass, SLOTarget,
                                      TenantConfig)


# ---------------------------------------------------------------------------------- engine
class EnginePoolSettings(_Strict):
    """Engine settings of every worker in a pool: EngineConfig without the cluster-wide model."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = Field(16, ge=1, le=1024)
    max_model_len: Optional[int] = Field(None, ge=1, description="Defaults to the model's.")
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    # KV memory budget; num_kv_blocks overrides it when set.
    kv_cache_memory_bytes: int = Field(512 * 1024 * 1024, ge=1)
    # CUDA only (vLLM's --gpu-memory-utilization): the fraction of the GPU's memory this
    # engine takes in all; the KV cache gets what the weights, activations, CUDA graphs and
    # runtime leave of it (pd_runtime/engine/kv_cache/memory_plan.py), in place of
    # kv_cache_memory_bytes. Engines sharing a GPU each need their own share. No effect on
    # a CPU. num_kv_blocks still wins.
    gpu_memory_utilization: Optional[float] = Field(None, gt=0, le=1)
    num_kv_blocks: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = Field(256 * 1024 * 1024, ge=0)
    max_waiting_requests: int = Field(4096, ge=1)
    max_waiting_tokens: int = Field(1 << 22, ge=1)
    # Steps a waiting request may be passed over before its priority is raised by one.
    priority_aging_steps: int = Field(64, ge=1)
    num_threads: Optional[int] = Field(None, ge=1, description="torch CPU threads.")
    # A worker of degree t is t ranks, each holding 1/t of the attention heads, MLP columns and
    # experts (pd_runtime/model/tensor_parallel.py), joined by all-reduces over
    # torch.distributed (NCCL on GPUs, gloo on the CPU); the driver rank schedules and
    # samples, the others follow its plan. On the CPU each rank takes 1/t of the cores unless
    # num_threads says otherwise. The heads (and KV heads, or t a multiple of them), the MLP
    # width and the experts must divide by t.
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    # The most memory one rank's plan may take (pd_runtime/engine/kv_cache/memory_plan.py: its weights,
    # KV cache, side buffers and largest step's activations): a plan over it is refused
    # before the model loads, naming this field. None: unchecked on a CPU; a GPU is always
    # checked against its own memory (and against this too, when set).
    memory_budget_bytes: Optional[int] = Field(None, ge=1)
    # Decode keeps the running batch's K/V contiguous in a side buffer of up to this fraction
    # of the KV cache's bytes (appends instead of re-gathering blocks each step); 0 disables.
    decode_kv_buffer_fraction: float = Field(1.0, ge=0)
    # Outputs independent of batch composition, chunk boundaries and prefix-cache hits in
    # every dtype: per-sequence reduction orders fixed (see docs/configuration.md for its cost).
    batch_invariant: bool = True
    # A worker runs a throwaway prompt of this many tokens before it reports ready: first-use
    # costs (kernel builds, allocations) are paid before any request, and the live cost model
    # starts from measured steps. 0: no warm-up.
    warmup_tokens: int = Field(1024, ge=0)
    # While sequences are decoding, a step's prompt tokens are cut so that the step's predicted
    # time (the live step-cost model) stays within this: a decode never waits behind a prefill
    # chunk longer than the TPOT target allows (at least one block of prompt per step still
    # runs). None: only max_num_batched_tokens. (Measured with the SLO router on the 2-core
    # box, 0.09 s: ITL p99 -35%, goodput -5 to -14%: shorter chunks delay first tokens.)
    step_time_target_s: Optional[float] = Field(None, gt=0)
    # CPU decode workers only: while a prefill worker on this machine computes (its flag in
    # /dev/shm: pd_runtime/workers/node_signals.py), a step starts no sooner than this after
    # the previous one started, so decode steps leave the cores their TPOT target does not
    # need to the prefill; while none computes the steps run back to back. 0: never. null:
    # 0.8 x the router's TPOT target for a decode worker on the CPU of a local cluster that
    # has a prefill pool (pd_runtime/workers/pool.py: default_step_interval), else 0.
    min_step_interval_s: Optional[float] = Field(None, ge=0)
    # CUDA only: decode steps of up to this many sequences replay CUDA graphs captured at
    # start-up (one per batch-size bucket; larger batches and prompt steps run eagerly).
    cuda_graphs: bool = True
    cuda_graph_max_batch_size: int = Field(256, ge=1)
    # Speculative decoding: "ngram" guesses up to speculative_tokens next tokens per step from
    # the request's own context (prompt lookup, n-grams of speculative_ngram_min..max tokens)
    # and verifies them in one forward; outputs follow the model exactly (greedy: the same
    # tokens). None: off. (pd_runtime/engine/spec_decode/speculative.py)
    # The KV cache's storage: "auto" the model's dtype; "int8": 8 bits per value with a float32
    # scale per token and KV head (pd_runtime/kernels/kv_quant.py), about half the bytes per token held
    # and shipped; attention dequantizes inside the kernel. CPU, batch_invariant only for now;
    # the prefill and decode pools must agree.
    kv_cache_dtype: Literal["auto", "int8"] = "auto"
    speculative_method: Optional[Literal["ngram", "draft"]] = None
    # "draft": a small model with the target's tokenizer (a local HF directory) that guesses.
    speculative_model: Optional[str] = None
    speculative_tokens: int = Field(4, ge=1, le=32)
    speculative_ngram_max: int = Field(4, ge=1)
    speculative_ngram_min: int = Field(2, ge=1)
    # Tiers below the KV cache (pd_runtime/engine/kv_cache/tiers.py): prefix blocks the pool
    # evicts move to this many GiB of host memory (vLLM's kv_offloading_size), and from there
    # to kv_offloading_disk_size GiB of checksummed files under kv_offloading_disk_dir; a
    # later prompt that hits them gets them copied back instead of recomputed. None or 0: off.
    # Needs enable_prefix_caching and tensor_parallel_size 1.
    kv_offloading_size: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    kv_offloading_disk_size: Optional[float] = Field(None, ge=0, allow_inf_nan=False)
    kv_offloading_disk_dir: Optional[str] = None  # None: <the system's temp dir>/pd-runtime-kv

    @model_validator(mode="after")
    def _check(self):
        if self.max_model_len is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.kv_cache_dtype == "int8" and (not self.batch_invariant
                                              or not self.device.startswith("cpu")):
            raise ValueError("kv_cache_dtype 'int8' runs on the CPU's fixed-order attention "
                             "kernel: it needs device 'cpu' and batch_invariant: true (got "
                             f"device {self.device!r}, batch_invariant {self.batch_invariant})")
        if self.speculative_method == "draft" and not self.speculative_model:
            raise ValueError("speculative_method 'draft' needs speculative_model: the draft "
                             "model's directory")
        if self.kv_offloading_size or self.kv_offloading_disk_size:
            if not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size / kv_offloading_disk_size keep evicted "
                                 "prefix-cache blocks: they need enable_prefix_caching: true")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_offloading_size / kv_offloading_disk_size: the KV tiers "
                                 "hold one rank's cache; tensor_parallel_size must be 1 (got "
                                 f"{self.tensor_parallel_size})")
            if self.kv_offloading_disk_size and not self.kv_offloading_size:
                raise ValueError("kv_offloading_disk_size needs a host tier above it: set "
                                 "kv_offloading_size (GiB) too")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(f"speculative_ngram_min ({self.speculative_ngram_min}) must not "
                             f"exceed speculative_ngram_max ({self.speculative_ngram_max})")
        return self


class EngineConfig(EnginePoolSettings):
    """Settings of one engine instance (one worker, or the offline LLM)."""

    model: str = Field(description="Path to a local HF model directory.")


def _is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


# ---------------------------------------------------------------------------------- kv transfer
class KVTransferConfig(_Strict):
    """Settings of the KV transfer agent of one worker."""

    backend: Literal["torch_dist", "ucx", "local"] = "torch_dist"
    # Address the agent listens on (torch_dist store / UCX listener); port 0 picks a free one.
    # In a cluster file, "auto" means each worker's own Ray node IP (see for_node).
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    # backend ucx only (docs/kv_transfer.md): "tcp", "shm" (host caches), "rdma" (InfiniBand or
    # RoCE NICs, host or CUDA caches; refused at agent start where there is none), or "auto":
    # cuda transports for a CUDA cache, else shm on a loopback host, else tcp; never rdma.
    ucx_mode: Literal["auto", "tcp", "shm", "rdma"] = "auto"
    credit_window_bytes: int = Field(256 * 1024 * 1024, ge=1)
    max_queued_sends: int = Field(64, ge=1)
    handshake_timeout_s: float = Field(10.0, gt=0)
    transfer_timeout_s: float = Field(30.0, gt=0)
    lease_timeout_s: float = Field(60.0, gt=0)
    checksums: bool = False
    # Liveness is ours, not the transport's (UCX shared memory has no peer-failure detection):
    # a link with no frame for peer_timeout_s is dead and its transfers fail with peer_lost.
    heartbeat_interval_s: float = Field(0.5, gt=0)
    peer_timeout_s: float = Field(5.0, gt=0)
    # Prefill workers ship each layer of a prompt's KV as its last step computes it, so the
    # transfer runs under the remaining layers; false: the whole KV after the prefill.
    stream_layers: bool = True
    # Testing only: wrap the transport so faults (drop, delay, corrupt, duplicate) can be
    # injected at the link at run time (PDWorker.set_fault_injection); off in production.
    fault_injection: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.ucx_mode != "auto" and self.backend != "ucx":
            raise FieldValueError(("ucx_mode",), f"{self.ucx_mode!r} applies to backend 'ucx' only, "
                                  f"and kv_transfer.backend is {self.backend!r}")
        return self

    def for_node(self, node_ip: str) -> "KVTransferConfig":
        """The agent config of a worker on `node_ip`: host "auto" becomes that address."""
        return self.model_copy(update={"host": node_ip}) if self.host == "auto" else self


# ---------------------------------------------------------------------------------- pools
# Ray owns these names; a custom resource may not reuse them.
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class ResourcesConfig(_Strict):
    """What Ray reserves for one worker actor (and its placement-group bundle)."""

    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    custom: dict[str, Annotated[float, Field(ge=0)]] = Field(default_factory=dict)
    memory_bytes: Optional[int] = Field(None, ge=1)
    # The GPU model each worker must get, by Ray's name for it ("H100", "A100-80G", ...): Ray
    # places the worker only on nodes that have one, and the memory arithmetic of the pool
    # (pd_runtime/engine/kv_cache/memory_plan.py) is checked against it.
    accelerator_type: Optional[str] = None

    @model_validator(mode="after")
    def _check(self):
        if self.accelerator_type is not None and self.num_gpus <= 0:
            raise FieldValueError(("accelerator_type",), "needs num_gpus > 0")
        for name in self.custom:
            if name in _RAY_BUILTIN_RESOURCES:
                raise FieldValueError(("custom", name), f"{name!r} is a Ray built-in resource; "
                                      "use num_cpus / num_gpus / memory_bytes")
        return self

    def ray_options(self) -> dict[str, Any]:
        """Keyword arguments for `ActorClass.options(...)`."""
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.custom:
            options["resources"] = dict(self.custom)
        if self.memory_bytes is not None:
            options["memory"] = self.memory_bytes
        if self.accelerator_type is not None:
            options["accelerator_type"] = self.accelerator_type
        return options

    def bundle(self) -> dict[str, float]:
        """The placement-group bundle of one worker (Ray rejects zero-only bundles)."""
        wanted = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom,
                  "memory": self.memory_bytes or 0}
        if self.accelerator_type is not None:  # how Ray spells the constraint in a bundle
            wanted[f"accelerator_type:{self.accelerator_type}"] = 0.001
        return {name: amount for name, amount in wanted.items() if amount > 0}


class PlacementConfig(_Strict):
    """One Ray placement group per pool, one bundle per worker."""

    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    enabled: bool = True
    # Waiting for a group the cluster cannot fit must end with an error, not hang.
    ready_timeout_s: float = Field(120.0, gt=0)


class PoolConfig(_Strict):
    """A pool of identical workers of one role."""

    num_workers: int = Field(ge=0)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    engine: EnginePoolSettings = Field(default_factory=EnginePoolSettings)
    # Replaces the cluster-wide `placement` for this pool when set.
    placement: Optional[PlacementConfig] = None

    @model_validator(mode="after")
    def _check(self):
        cuda = _is_cuda(self.engine.device)
        if cuda and self.resources.num_gpus <= 0:
            raise FieldValueError(("engine", "device"), f"device {self.engine.device!r} needs "
                                  "resources.num_gpus > 0 (Ray hides GPUs from actors without)")
        if not cuda and self.resources.num_gpus > 0:
            raise FieldValueError(("resources", "num_gpus"), "GPUs are reserved but "
                                  f"engine.device is {self.engine.device!r}; set it to 'cuda'")
        return self

    def engine_config(self, model: str) -> EngineConfig:
        return EngineConfig(model=model, **self.engine.model_dump())


# ---------------------------------------------------------------------------------- runtime
# "" starts a local Ray; "auto" joins the cluster of this node; ray://host:port is Ray Client;
# host:port is the GCS address of an existing cluster.
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)"
_RAY_ADDRESS = re.compile(rf"^(auto|(ray://)?{_HOST}:[0-9]{{1,5}})$")


class RayConfig(_Strict):
    address: str = ""
    namespace: str = Field("pd-runtime", min_length=1)
    include_dashboard: bool = False
    # CPUs of a local Ray (address ""); None lets Ray count the machine's.
    num_cpus: Optional[int] = Field(None, ge=1)
    runtime_env: Optional[dict[str, Any]] = None

    @field_validator("address")
    @classmethod
    def _address(cls, value: str) -> str:
        if value and not _RAY_ADDRESS.match(value):
            raise ValueError(f"{value!r} is not '' (local Ray), 'auto', 'ray://host:port' "
                             "or 'host:port'")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.num_cpus is not None and self.address:
            raise FieldValueError(("num_cpus",), "only a local Ray (address '') takes num_cpus; "
                                  "an existing cluster has its own")
        return self


class RecoveryConfig(_Strict):
    # Ray actor restarts per worker; -1 restarts forever.
    max_restarts: int = Field(3, ge=-1)
    # Hedged prefill: a decode worker that has no first token from its prefill worker after
    # hedge_min_s + hedge_factor x (the prompt's expected remote prefill time, from the
    # measured rate) prefills locally into its reservation and aborts the remote prefill.
    hedge_min_s: float = Field(1.0, gt=0)
    hedge_factor: float = Field(3.0, ge=1.0)
    # The hard ceiling on that wait, whatever the estimate says.
    remote_prefill_timeout_s: float = Field(30.0, gt=0)
    # How long a disaggregated request may wait for decode blocks before it is refused.
    reservation_timeout_s: float = Field(30.0, gt=0)
    health_check_interval_s: float = Field(1.0, gt=0)
    # A request whose decode worker died (or that finds none up) waits this long for one to
    # serve it (another, or the restarted actor) before it fails with Retry-After; covers an
    # actor restart (9-21 s measured on the 2-core AVX2 box under load, warm-up included).
    decode_recovery_wait_s: float = Field(40.0, ge=0)


# ---------------------------------------------------------------------------------- planner
class PoolBounds(_Strict):
    """How small and how large the autoscaler may make one pool."""

    min_workers: int = Field(0, ge=0)
    max_workers: int = Field(4, ge=0)

    @model_validator(mode="after")
    def _check(self):
        if self.min_workers > self.max_workers:
            raise FieldValueError(("min_workers",), f"{self.min_workers} is above max_workers "
                                  f"{self.max_workers}")
        return self


class AutoscaleConfig(_Strict):
    """planner.autoscale: the planner as a controller (pd_runtime/planner/autoscale.py decides,
    pd_runtime/workers/elastic.py acts). Every interval_s it reads the traffic the router saw
    over window_s, asks the planner's simulator which split of prefill and decode workers
    meets the SLO at that load (times 1 + headroom), and starts or drains workers towards it;
    no change within cooldown_s of the last, and no fewer workers within scale_down_delay_s. Off by default: the pools keep their sizes."""

    enabled: bool = False
    interval_s: float = Field(10.0, gt=0)
    window_s: float = Field(60.0, gt=0)
    cooldown_s: float = Field(30.0, ge=0)
    # Fewer workers no sooner than this after the last change (or the start): up fast, down
    # slow, so a window not yet full of a new load does not drain what that load will need.
    scale_down_delay_s: float = Field(60.0, ge=0)
    headroom: float = Field(0.2, ge=0, le=10)
    # The share of requests that must meet both targets in the simulation (DistServe's 90%).
    attainment: float = Field(0.9, gt=0, le=1)
    # None: the router's routing.slo targets.
    ttft_s: Optional[float] = Field(None, gt=0)
    tpot_s: Optional[float] = Field(None, gt=0)
    prefill: PoolBounds = Field(default_factory=lambda: PoolBounds(min_workers=0, max_workers=2))
    decode: PoolBounds = Field(default_factory=lambda: PoolBounds(min_workers=1, max_workers=4))
    # The CPUs and GPUs all workers together may hold (None: what the Ray cluster has).
    max_cpus: Optional[float] = Field(None, gt=0)
    max_gpus: Optional[float] = Field(None, ge=0)
    # How long a drained worker's streams may take before it is stopped all the same (its
    # streams then migrate to another decode worker, as after a crash).
    drain_timeout_s: float = Field(120.0, gt=0)

    @model_validator(mode="after")
    def _check(self):
        if self.decode.max_workers < 1:
            raise FieldValueError(("decode", "max_workers"), "the decode pool serves every "
                                  "request; it needs at least 1")
        return self


class PlannerConfig(_Strict):
    autoscale: AutoscaleConfig = Field(default_factory=AutoscaleConfig)


# ---------------------------------------------------------------------------------- cluster
ROLES = ("prefill", "decode", "colocated")


class ClusterConfig(_Strict):
    """A whole deployment: model, Ray, the three pools, transfer, recovery and the router."""

    # None: the embedded default (the tiny bench model, generated on first use).
    model: Optional[str] = None
    ray: RayConfig = Field(default_factory=RayConfig)
    prefill: PoolConfig = Field(default_factory=lambda: PoolConfig(num_workers=1))
    decode: PoolConfig = Field(default_factory=lambda: PoolConfig(num_workers=1))
    colocated: PoolConfig = Field(default_factory=lambda: PoolConfig(num_workers=0))
    placement: PlacementConfig = Field(default_factory=PlacementConfig)
    kv_transfer: KVTransferConfig = Field(default_factory=KVTransferConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    planner: PlannerConfig = Field(default_factory=PlannerConfig)

    @model_validator(mode="before")
    @classmethod
    def _pool_defaults(cls, data):
        # A prefill or decode section that only tunes its engine keeps the pool's one worker;
        # a colocated pool (none by default) must say how many it wants.
        if isinstance(data, dict):
            for role in ("prefill", "decode"):
                section = data.get(role)
                if isinstance(section, dict) and "num_workers" not in section:
                    data = {**data, role: {**section, "num_workers": 1}}
        return data

    @model_validator(mode="after")
    def _check(self):
        if self.decode.num_workers + self.colocated.num_workers == 0:
            raise FieldValueError(("decode", "num_workers"), "no worker can decode: set "
                                  "decode.num_workers or colocated.num_workers to 1 or more")
        if self.prefill.num_workers and not self.decode.num_workers:
            raise FieldValueError(("prefill", "num_workers"), "prefill workers ship KV to decode "
                                  "workers, and decode.num_workers is 0; set one of them")
        # KV blocks move between the pools byte for byte, and a disaggregated request must
        # give what a colocated one gives (the same arithmetic on both sides).
        for name in ("block_size", "dtype", "batch_invariant", "kv_cache_dtype"):
            ours, theirs = getattr(self.prefill.engine, name), getattr(self.decode.engine, name)
            if self.prefill.num_workers and ours != theirs:
                raise FieldValueError(("prefill", "engine", name), f"{ours!r} differs from "
                                      f"decode.engine.{name} {theirs!r}; KV moves between them")
        if self.prefill.num_workers:
            if self.kv_transfer.ucx_mode in ("tcp", "shm") and _is_cuda(self.prefill.engine.device):
                raise FieldValueError(("kv_transfer", "ucx_mode"), f"{self.kv_transfer.ucx_mode!r} "
                                      "moves host memory only and the KV cache is on the GPU; "
                                      "use 'auto' (a CUDA cache gets UCX's CUDA transports) or "
                                      "'rdma'")
        if self.router.routing.mode == "always_disaggregated" and not self.prefill.num_workers:
            raise FieldValueError(("router", "routing", "mode"),
                                  "always_disaggregated needs prefill.num_workers >= 1")
        scale = self.planner.autoscale
        if scale.enabled:
            if self.colocated.num_workers:
                raise FieldValueError(("planner", "autoscale", "enabled"), "the autoscaler sizes "
                                      "the prefill and decode pools; colocated.num_workers must "
                                      "be 0 (a decode worker serves colocated requests)")
            for role in ("prefill", "decode"):
                bounds, have = getattr(scale, role), getattr(self, role).num_workers
                if not bounds.min_workers <= have <= bounds.max_workers:
                    raise FieldValueError((role, "num_workers"), f"{have} is outside "
                                          f"planner.autoscale.{role} [{bounds.min_workers}, "
                                          f"{bounds.max_workers}]: the pool starts at its size")
        for role, pool in self.pools().items():
            if pool.num_workers and self.placement_for(role).enabled and not pool.resources.bundle():
                raise FieldValueError((role, "resources"), "a placement-group bundle needs a "
                                      "resource > 0; reserve some or disable placement")
        return self

    def pools(self) -> dict[str, PoolConfig]:
        return {role: getattr(self, role) for role in ROLES}

    def placement_for(self, role: str) -> PlacementConfig:
        return getattr(self, role).placement or self.placement
