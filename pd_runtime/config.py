"""Typed configuration for every part of pd-runtime; the only place defaults live.

YAML files are parsed into these pydantic models at load time; constructors take the models.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    # Unknown keys are almost always typos in YAML; reject them with the field name.
    model_config = ConfigDict(extra="forbid")


class EngineConfig(_Strict):
    """Settings of one engine instance (one worker, or the offline LLM)."""

    model: str = Field(description="Path to a local HF model directory.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "cpu"
    seed: int = 0
    block_size: int = Field(16, ge=1, le=1024)
    max_model_len: Optional[int] = Field(None, ge=1, description="Defaults to the model's.")
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(128, ge=1)
    # KV memory budget; num_kv_blocks overrides it when set.
    kv_cache_memory_bytes: int = Field(512 * 1024 * 1024, ge=1)
    num_kv_blocks: Optional[int] = Field(None, ge=1)
    enable_prefix_caching: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    swap_space_bytes: int = Field(256 * 1024 * 1024, ge=0)
    max_waiting_requests: int = Field(4096, ge=1)
    max_waiting_tokens: int = Field(1 << 22, ge=1)
    # Steps a waiting request may be passed over before its priority is raised by one.
    priority_aging_steps: int = Field(64, ge=1)
    num_threads: Optional[int] = Field(None, ge=1, description="torch CPU threads.")

    @model_validator(mode="after")
    def _check(self):
        if self.max_model_len is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        return self


class KVTransferConfig(_Strict):
    """Settings of the KV transfer agent of one worker."""

    backend: Literal["torch_dist", "ucx", "local"] = "torch_dist"
    # Address the agent listens on (torch_dist store / UCX listener); port 0 picks a free one.
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535)
    ucx_mode: Literal["auto", "tcp", "shm"] = "auto"
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
