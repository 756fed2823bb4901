"""The transports under the agent, one module each: torch.distributed (torch_dist.py, with ipc.py
for two processes on one GPU), UCX (ucx.py over ucx_worker.py), and in-process (local.py)."""
