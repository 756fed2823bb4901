"""Moving paged KV blocks between workers (torch.distributed, UCX, local), nothing else."""
