"""The router's configuration: where it listens, its tenants, and the routing policy (the
`routing` section reloads live, config_loading.load_routing_config). Part of the cluster
file's schema (pd_runtime/config.py, which re-exports these names).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from pd_runtime.config_base import FieldValueError, _Strict


class DecodeCostWeights(_Strict):
    """Decode worker choice, lowest cost wins: running * weight_running - free * weight_free_blocks
    - overlap * weight_prefix_overlap, each term a fraction in [0, 1] (running / max_num_seqs,
    free / total KV blocks, expected prefix hit / prompt tokens)."""

    weight_free_blocks: float = Field(1.0, ge=0)
    weight_running: float = Field(1.0, ge=0)
    weight_prefix_overlap: float = Field(2.0, ge=0)


class PrefillCostWeights(_Strict):
    """Prefill worker choice, lowest cost wins: queued * weight_queued_tokens - overlap *
    weight_prefix_overlap (queued prefill tokens / max_prefill_queue_tokens; hit / prompt)."""

    weight_queued_tokens: float = Field(1.0, ge=0)
    weight_prefix_overlap: float = Field(1.0, ge=0)


class SLOTarget(_Strict):
    """Latency targets a request should meet: time to first token, and time per output token
    after the first (the mean gap, (end - first token) / (tokens - 1))."""

    ttft_s: float = Field(2.5, gt=0)
    tpot_s: float = Field(0.1, gt=0)


class SLOClass(_Strict):
    """Targets for the requests whose prompt has at least `min_prompt_tokens` tokens (the class
    with the largest such bound that a prompt reaches wins; tenant targets win over classes)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    min_prompt_tokens: int = Field(0, ge=0)
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)


class RoutingConfig(_Strict):
    """Colocated or disaggregated, per request; reloads live (load_routing_config)."""

    # slo: per request, the option (colocated on a decode worker, or a prefill/decode pair)
    # whose predicted TTFT and TPOT (pd_runtime/router/cost_model.py) meet the targets with the most
    # headroom; none meets them: `overload`. auto: the length threshold below.
    mode: Literal["slo", "auto", "always_disaggregated", "always_colocated"] = "slo"
    slo: SLOTarget = Field(default_factory=SLOTarget)
    slo_classes: list[SLOClass] = Field(default_factory=list)
    tenant_slos: dict[str, SLOTarget] = Field(default_factory=dict)  # tenant_id -> targets
    # When no option meets the targets: refuse at once with 429 and a Retry-After computed from
    # the queues, or hold the request at the router until one does, for up to max_queue_s.
    overload: Literal["reject", "queue"] = "reject"
    max_queue_s: float = Field(2.0, ge=0)
    # Admit a request only where its predicted TTFT and TPOT are within this fraction of the
    # targets: predictions are of the load now, and the requests arriving after it slow it too.
    slo_margin: float = Field(0.9, gt=0, le=1)
    # auto: disaggregate when the uncached prompt tokens exceed this and the prefill pool's
    # queued tokens are under max_prefill_queue_tokens. slo: the usual path's threshold. 256: a
    # CPU decode worker (one core in the default deployment) stalls its streams ~0.35 s for a
    # 512-token prefill that the prefill worker, on the machine's cores, does in less.
    max_local_prefill_tokens: int = Field(256, ge=0)
    max_prefill_queue_tokens: int = Field(8192, ge=0)
    # Expected prefix hits from the blocks each worker reports holding (its KV events, pulled
    # with the health checks: pd_runtime/router/prefix_index.py), in any tier; false: an
    # estimate from what the router sent where.
    kv_events: bool = True
    decode_cost: DecodeCostWeights = Field(default_factory=DecodeCostWeights)
    prefill_cost: PrefillCostWeights = Field(default_factory=PrefillCostWeights)


class TenantConfig(_Strict):
    # Also a metric label and the prefix-cache salt, hence the plain alphabet.
    tenant_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    api_key: str = Field(min_length=1, repr=False)
    # False: the tenant's cached prefixes are its own (tenant_id salts the block hashes).
    share_prefix_cache: bool = False
    requests_per_minute: Optional[int] = Field(None, ge=1)
    tokens_per_minute: Optional[int] = Field(None, ge=1)


class CorsConfig(_Strict):
    """Cross-origin requests from browsers, as vLLM's --allowed-origins, --allow-credentials,
    --allowed-methods and --allowed-headers answer them (every origin by default)."""

    allowed_origins: list[str] = Field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"])


class RunsConfig(_Strict):
    """Run records (pd_runtime/gateway/): every generation request a run with a state, its output kept
    for idempotent retries and resumed streams, and a usage ledger."""
    enabled: bool = True
    # None: SQLite in a file under the user's data directory; or sqlite:///path, or
    # postgresql://... (needed to share runs, idempotency keys and rate limits across
    # router replicas on several machines).
    store: Optional[str] = Field(None, min_length=1)
    # A client that leaves a run it sent an Idempotency-Key for has this long to come back
    # (retry or Last-Event-ID) before the run is cancelled; runs without a key are cancelled
    # as soon as their last client leaves.
    detach_grace_s: float = Field(10.0, ge=0)
    # Finished runs kept in memory for fast replay (older ones are read from the store).
    keep_finished: int = Field(1024, ge=0)
    # SSE `id:` lines (what Last-Event-ID resumes after): "auto" sends them to clients that
    # can use them (an Idempotency-Key, or Accept: text/event-stream), since clients written
    # for the OpenAI API often parse every line as `data:`; "always" to every stream.
    event_ids: Literal["auto", "always"] = "auto"
    # Each replica shows it is alive in the store this often / 3; the runs left in flight by
    # one not seen for this long (stopped, not restarted on its port) are marked failed, so a
    # retry following one through the store gets an answer instead of waiting it out.
    owner_lease_s: float = Field(30.0, gt=0)
    # A run's recorded output (what an Idempotency-Key retry or a Last-Event-ID resume
    # replays) is deleted this long after the run began; a later retry of it gets 409. null:
    # kept for good.
    keep_outputs_s: Optional[float] = Field(86400.0, gt=0)
    # A run's record (GET /v1/runs/{id}) and its Idempotency-Key are deleted this long after
    # it began; its usage stays in the ledger as the tenant's totals for its UTC day. null:
    # kept for good (the store then grows with every request).
    keep_runs_s: Optional[float] = Field(30 * 86400.0, gt=0)

    @model_validator(mode="after")
    def _outputs_within_runs(self):
        if (self.keep_outputs_s is not None and self.keep_runs_s is not None
                and self.keep_outputs_s > self.keep_runs_s):
            raise FieldValueError(("keep_outputs_s",), f"{self.keep_outputs_s:g} is longer "
                                  f"than keep_runs_s ({self.keep_runs_s:g}): an output goes "
                                  "with its run")
        return self

    @field_validator("store")
    @classmethod
    def _known_store(cls, url: Optional[str]) -> Optional[str]:
        scheme = url.split("://", 1)[0].lower() if url and "://" in url else None
        if scheme is not None and scheme not in ("sqlite", "postgresql", "postgres"):
            raise ValueError(f"unknown run store scheme {scheme!r}: use a file path, "
                             "sqlite:///path or postgresql://user@host/db")
        return url


class RouterConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # None: the basename of the model directory (see model_name).
    served_model_name: Optional[str] = Field(None, min_length=1)
    request_timeout_s: float = Field(600.0, gt=0)
    # Larger request bodies are refused with 413 while they are read, before any parsing.
    max_request_body_bytes: int = Field(32 * 1024 * 1024, ge=1024)
    # How often the router checks its config file for routing edits (SIGHUP checks at once).
    reload_interval_s: float = Field(2.0, gt=0)
    # Empty: no API keys, every request is the anonymous tenant.
    tenants: list[TenantConfig] = Field(default_factory=list)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    runs: RunsConfig = Field(default_factory=RunsConfig)
    # One INFO line per request on the router.http logger (id, method, path, status,
    # latency); false: none (vLLM's --disable-log-requests, --disable-uvicorn-access-log).
    log_requests: bool = True
    # Browsers' cross-origin requests (CORS): answered for these origins; [] answers none.
    cors: CorsConfig = Field(default_factory=CorsConfig)
    # vLLM's development endpoints (POST /reset_prefix_cache, as load generators' --reset-kv-cache
    # sends it): off by default, since any client the router admits could then empty every
    # worker's prefix cache; VLLM_SERVER_DEV_MODE=1 in the environment turns them on too.
    dev_endpoints: bool = False
    # Router processes serving `port` together (SO_REUSEPORT), all over the same pools.
    replicas: int = Field(1, ge=1, le=64)
    # What a request that leaves a sampling field out gets: "model", the sampling fields of the
    # model's generation_config.json (as vLLM does), else OpenAI's; "openai", always OpenAI's.
    sampling_defaults: Literal["model", "openai"] = "model"
    # How the model writes tool calls, for chat requests with tool_choice "auto"
    # (pd_runtime/parsers/tool_calls.py): "auto", the format its chat template shows (<function=...>
    # calls in <tool_call> blocks: qwen3_coder; JSON in them: hermes; [TOOL_CALLS]: mistral;
    # <|python_tag|>: llama3_json; <｜tool▁calls▁begin｜>: deepseek_v3; the
    # [func_name1(params_name1=...)] prompt: pythonic; <|tool_call|>: granite; harmony's
    # <|channel|>: harmony, gpt-oss's), else none; "none": auto tool choice refused.
    tool_call_parser: Literal["auto", "hermes", "mistral", "llama3_json", "qwen3_coder",
                              "deepseek_v3", "pythonic", "granite", "harmony",
                              "none"] = "auto"
    # A reasoning model's thinking on chat completions (pd_runtime/parsers/reasoning.py): "auto",
    # split into `reasoning` when its chat template knows <think> blocks (or writes harmony's
    # channels: gpt-oss, pd_runtime/parsers/harmony.py); "think" or "harmony", always; "none",
    # left in the content.
    reasoning_parser: Literal["auto", "think", "harmony", "none"] = "auto"
    # The chat template chat requests are rendered with instead of the model's own (vLLM's
    # --chat-template): a Jinja file's path (relative: to the working directory), or the
    # template itself; None: the model's. The tool-call and reasoning formats "auto" finds
    # are then this template's.
    chat_template: Optional[str] = Field(None, min_length=1)

    @field_validator("chat_template")
    @classmethod
    def _template_exists(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not _is_template(value) and \
                not Path(value).expanduser().is_file():
            raise ValueError(f"{value!r} is neither a file nor a Jinja template")
        return value

    def chat_template_path(self) -> Optional[Path]:
        """The file chat_template names, or None (none set, or the template itself)."""
        if self.chat_template is None or _is_template(self.chat_template):
            return None
        return Path(self.chat_template).expanduser()

    def chat_template_text(self) -> Optional[str]:
        """The template chat_template names (its file read now), or None."""
        path = self.chat_template_path()
        return self.chat_template if path is None else path.read_text()

    @model_validator(mode="after")
    def _check(self):
        for field in ("tenant_id", "api_key"):
            seen: set[str] = set()
            for index, tenant in enumerate(self.tenants):
                value = getattr(tenant, field)
                if value in seen:
                    raise FieldValueError(("tenants", index, field), f"duplicate {field}")
                seen.add(value)
        return self

    def model_name(self, model_dir: str) -> str:
        return self.served_model_name or Path(model_dir).name


def _is_template(value: str) -> bool:
    """Jinja text rather than a path: it holds a tag or an expression."""
    return "{{" in value or "{%" in value
