"""Decode steps replayed from CUDA graphs: one graph per batch-size bucket, captured at start-up.

A decode step of B sequences runs the graph of the smallest bucket >= B with the rows past B
padded: slot -1 (the K/V write skips it), context length 0 (attention writes zeros and reads
no block), token and position 0; their logits are computed and dropped. Every input lives in a
static device buffer the graph was captured on; a step copies its indices there (two copies)
and replays. Block tables are captured at the widest a sequence can need
(max_model_len / block_size columns), so the decode kernel's split count, chosen from that
static width, is the same for every step; a step writes only its own columns, and a row reads
only the blocks its length covers. Batches beyond the largest bucket, and steps with prompt
tokens, run eagerly (ModelRunner).

At tensor_parallel_size t > 1 every rank holds the same buckets' graphs, each with its layers'
NCCL all-reduces inside: the ranks capture together at start (a capture's warm-up run is a
collective) and each step every rank replays the same bucket (they run the same plan). A
follower's graph ends at the hidden state; the driver's computes the logits.
"""

from __future__ import annotations

import logging
import time

import torch

from pd_runtime.kernels.attention import AttentionMetadata, DeviceAttention

log = logging.getLogger(__name__)


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_batch (and max_batch itself): a padded step
    costs at most 15 rows past 8 (the decode step is read-bound: extra rows are nearly free)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    sizes += list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, runner, max_batch: int):
        self.runner = runner
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = self.buckets[-1]
        self.width = runner.max_blocks_per_seq
        device = runner.device
        n = self.max_batch
        # ids, positions, slots as int64 and lengths (int64 here, int32 for the kernels) in one
        # buffer: one host-to-device copy per step; the tables are the second.
        self.flat = torch.zeros(4 * n, dtype=torch.long, device=device)
        self.ids, self.pos, self.slots, self.lens64 = self.flat.split(n)
        self.lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=device)
        self.staging = torch.zeros(4 * n, dtype=torch.long,
                                   pin_memory=device.type == "cuda")
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s: float | None = None
        self.replays = 0

    def _meta(self, batch: int) -> AttentionMetadata:
        device = self.runner.device
        none = torch.zeros(0, dtype=torch.int32, device=device)
        dev = DeviceAttention(decode_block_tables=self.tables[:batch],
                              decode_context_lens=self.lens[:batch],
                              query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
                              context_lens=none, block_tables=none.view(0, 0), max_query_len=0)
        return AttentionMetadata(slot_mapping=self.slots[:batch], num_decode_tokens=batch,
                                 device_attention=dev, device_kernels=self.runner.triton)

    def _run(self, batch: int) -> torch.Tensor:
        model = self.runner.model
        self.lens[:batch].copy_(self.lens64[:batch])
        hidden = model.forward(self.ids[:batch], self.pos[:batch], self.runner.kv_caches,
                               self._meta(batch))
        if self.runner.tp is not None and self.runner.tp.rank:
            return hidden  # a tensor-parallel follower has no LM head: its graph ends here
        return model.compute_logits(hidden)

    def capture(self) -> float:
        """Capture every bucket (largest first, sharing one memory pool); returns seconds."""
        started = time.perf_counter()
        self.slots.fill_(-1)  # no K/V written while capturing: every row is padding
        self.lens64.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.buckets):
                self._run(batch)  # warm-up: kernel compiles and allocator caching happen here
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._run(batch)
                self.graphs[batch] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - started
        log.info("CUDA graphs: %d decode batch sizes (1..%d) captured in %.1f s",
                 len(self.buckets), self.max_batch, self.capture_s)
        return self.capture_s

    def run(self, decodes: list) -> torch.Tensor | None:
        """Logits `[len(decodes), vocab]` of a decode-only step in `decodes` order, or None when
        no graph covers the batch (the caller runs it eagerly)."""
        batch = len(decodes)
        if batch > self.max_batch or not self.graphs:
            return None
        bucket = next(b for b in self.buckets if b >= batch)
        bs = self.runner.block_size
        n = self.max_batch
        host = self.staging
        ids, pos, slots, lens = host.split(n)
        ids[:bucket].zero_()
        pos[:bucket].zero_()
        slots[:bucket].fill_(-1)
        lens[:bucket].zero_()
        ids[:batch] = torch.tensor([s.token_ids[0] for s in decodes], dtype=torch.long)
        pos[:batch] = torch.tensor([s.start for s in decodes], dtype=torch.long)
        slots[:batch] = torch.tensor([s.block_ids[s.start // bs] * bs + s.start % bs
                                      for s in decodes], dtype=torch.long)
        lens[:batch] = pos[:batch] + 1
        width = max(len(s.block_ids) for s in decodes)
        tables = torch.tensor([s.block_ids + [0] * (width - len(s.block_ids)) for s in decodes],
                              dtype=torch.int32)
        # The staging buffer is reused next step: the copy must finish reading it first, so it
        # is not asynchronous (the step waits for its logits anyway).
        self.flat.copy_(host)
        self.tables[:batch, :width].copy_(tables)
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:batch]
