"""Moving paged KV blocks between workers (torch.distributed, UCX, local), nothing else."""

from pd_runtime.kv_transfer.base import (AgentMetadata, FailureReason, KVTransferError, LinkState,
                              MetadataMismatchError, Role, SendOutcome, TransferState,
                              TransferStatus)

__all__ = ["AgentMetadata", "FailureReason", "KVTransferError", "LinkState", "MetadataMismatchError",
           "Role", "SendOutcome", "TransferState", "TransferStatus", "create_agent"]


def create_agent(*args, **kwargs):
    """See pd_runtime.kv_transfer.registry.create_agent (imported lazily: it pulls in the agent threads)."""
    from pd_runtime.kv_transfer.registry import create_agent as _create
    return _create(*args, **kwargs)
