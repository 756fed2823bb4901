"""Backends by name: builds the Transport a KVTransferConfig asks for and the agent around it,
wrapped for link fault injection where the config asks (testing only; pd_runtime/kv_transfer/faults.py).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from pd_runtime.kv_transfer.agent import KVTransferAgent
from pd_runtime.kv_transfer.base import KVTransferError, ReleaseCallback, Transport
from pd_runtime.kv_transfer.faults import FaultInjectingTransport

_BACKENDS: dict[str, Callable[..., Transport]] = {}


def register_backend(name: str, factory: Callable[..., Transport]) -> None:
    _BACKENDS[name] = factory


def _builtin(name: str) -> Callable[..., Transport]:
    # Imported lazily: ucxx pulls in a large native stack that torch_dist users never need.
    if name == "local":
        from pd_runtime.kv_transfer.backends.local import LocalTransport
        return lambda config, device: LocalTransport()
    if name == "torch_dist":
        from pd_runtime.kv_transfer.backends.torch_dist import TorchDistTransport
        return lambda config, device: TorchDistTransport(config.host, config.port, device)
    if name == "ucx":
        from pd_runtime.kv_transfer.backends.ucx import UCXTransport
        return lambda config, device: UCXTransport(config.host, config.port, config.ucx_mode, device)
    raise KVTransferError(f"unknown kv_transfer backend {name!r}; known: local, torch_dist, ucx, {sorted(_BACKENDS)}")


def make_transport(config, device: torch.device) -> Transport:
    factory = _BACKENDS.get(config.backend) or _builtin(config.backend)
    return factory(config, device)


def create_agent(config, kv_caches: Sequence[torch.Tensor], *, engine_id: str, model_id: str,
                 on_release: Optional[ReleaseCallback] = None, transport: Optional[Transport] = None,
                 heartbeat_interval_s: Optional[float] = None,
                 peer_timeout_s: Optional[float] = None,
                 extra: Optional[dict] = None) -> KVTransferAgent:
    """Build the agent for a worker from its KVTransferConfig (pd_runtime.config); the two
    liveness keywords override the config for tests; `extra` joins its handshake metadata
    (a tensor-parallel rank's: the model's KV heads, its rank and degree)."""
    if heartbeat_interval_s is None:
        heartbeat_interval_s = config.heartbeat_interval_s
    if peer_timeout_s is None:
        peer_timeout_s = config.peer_timeout_s
    transport = transport or make_transport(config, kv_caches[0].device)
    if config.fault_injection and not isinstance(transport, FaultInjectingTransport):
        transport = FaultInjectingTransport(transport)
    return KVTransferAgent(
        transport, kv_caches, engine_id=engine_id, model_id=model_id,
        handshake_timeout_s=config.handshake_timeout_s, transfer_timeout_s=config.transfer_timeout_s,
        lease_timeout_s=config.lease_timeout_s, credit_window_bytes=config.credit_window_bytes,
        max_queued_sends=config.max_queued_sends, checksums=config.checksums, on_release=on_release,
        heartbeat_interval_s=heartbeat_interval_s, peer_timeout_s=peer_timeout_s, extra=extra)
