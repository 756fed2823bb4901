"""Moving paged KV blocks between workers, nothing else: the agent, its peer links and flow
control here, the transports (torch.distributed, UCX, in-process) in backends/."""

from pd_runtime.kv_transfer.base import (AgentMetadata, FailureReason, KVTransferError, LinkState,
                              MetadataMismatchError, Role, SendOutcome, TransferState,
                              TransferStatus)

__all__ = ["AgentMetadata", "FailureReason", "KVTransferError", "LinkState", "MetadataMismatchError",
           "Role", "SendOutcome", "TransferState", "TransferStatus", "create_agent"]


def create_agent(*args, **kwargs):
    """See pd_runtime.kv_transfer.registry.create_agent (imported lazily: it pulls in the agent threads)."""
    from pd_runtime.kv_transfer.registry import create_agent as _create
    return _create(*args, **kwargs)
