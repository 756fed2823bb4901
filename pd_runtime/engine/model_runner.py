"""Executes a scheduler plan: builds the flat token batch and attention metadata, runs the
model over the paged KV cache, and returns logits for the requests due a sample.

With `batch_invariant` (EngineConfig), every token's attention goes through the fixed-order
kernel (pd_runtime/kernels/fixed_order.py) and the model's matmuls are row-stable, so a request's logits
do not depend on its company, its chunking or its prefix-cache hits.

Tensor parallel (`tp`, a TensorParallelGroup): every rank has a runner over its part of the
model and its part of the KV cache (its KV heads, the same block ids). The driver's `execute`
sends the plan to the others first (`follow` runs them there), so every rank builds the same
batch and runs the same collectives; only the driver computes logits.
"""

from __future__ import annotations

import logging

import torch

from pd_runtime.kernels import fixed_order, kv_quant, native
from pd_runtime.kernels.attention import AttentionMetadata, DecodeKVBuffer, DeviceAttention, PrefillSegment
from pd_runtime.config import EngineConfig
from pd_runtime.engine.kv_cache.host_memory import host_zeros
from pd_runtime.engine.kv_cache.memory_plan import (check_fits, decode_buffer_fraction, kv_cache_budget,
                                           plan_memory)
from pd_runtime.engine.scheduler import SchedulerOutput
from pd_runtime.model.loader import load_model
from pd_runtime.model.model_config import load_model_config, served
from pd_runtime.model.parallel_comm import TensorParallelGroup

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, max_model_len: int,
                 tp: TensorParallelGroup | None = None):
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.block_size = config.block_size
        # Every tensor a step reads is on this device: built on the host and copied once
        # (`_put`), or built there. On CUDA, attention is the Triton kernels (pd_runtime/kernels/
        # triton_paged.py) over device-side block tables; on the host, the native/torch paths.
        self.device = torch.device(config.device)
        self.on_host = self.device.type == "cpu"
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        if config.batch_invariant and not self.on_host:
            log.warning("batch_invariant: the fixed-order paths are the host's; on %s results "
                        "can depend on the batch", config.device)
        # The whole model's config (the model holds its rank's part): what the memory plan
        # counts from.
        self.whole_config = served(load_model_config(config.model), max_model_len)
        if config.memory_budget_bytes is not None:  # refused before anything loads
            check_fits(plan_memory(config, self.whole_config, max_model_len),
                       config.memory_budget_bytes, "engine.memory_budget_bytes",
                       "memory" + (f" per rank (of {config.tensor_parallel_size})"
                                   if self.tp is not None else ""), "the budget is")
        self.model = load_model(config.model, config.dtype, config.device, max_model_len,
                                config.batch_invariant and self.on_host, self.tp)
        cfg = self.model.cfg
        self.dtype = self.model.dtype
        if self.dtype in (torch.bfloat16, torch.float32) and self.on_host:
            native.available()  # build (or find) the native kernels now, not at the first step
        self.triton = None
        if self.device.type == "cuda":
            from pd_runtime.kernels import triton_paged

            reason = triton_paged.unsupported_reason(self.dtype, cfg.head_dim, self.block_size,
                                                     cfg.num_heads, cfg.num_kv_heads)
            if reason is not None:
                raise ValueError(f"engine.device {config.device!r}: the GPU attention kernels "
                                 f"cannot run this model: {reason}")
            self.triton = triton_paged
        self.fixed_order = config.batch_invariant and self.on_host
        if self.fixed_order:
            reason = fixed_order.unsupported_reason(self.dtype, config.device, cfg.head_dim)
            if reason is not None:
                log.warning("batch_invariant: %s; attention runs the regular paths, whose "
                            "results can depend on the batch", reason)
                self.fixed_order = False
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # The cache's element type and row width: the model's dtype, or int8 rows of head_dim
        # values and a float32 scale (pd_runtime/kernels/kv_quant.py).
        self.kv_dtype = torch.int8 if config.kv_cache_dtype == "int8" else self.dtype
        row = kv_quant.row_width(cfg.head_dim) if self.kv_dtype == torch.int8 \
            else cfg.head_dim * elem
        if self.kv_dtype == torch.int8 and not self.fixed_order:
            raise ValueError("kv_cache_dtype 'int8' needs the fixed-order attention kernel, "
                             "which cannot run here (see the batch_invariant warning above)")
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * row
        block_bytes = self.kv_bytes_per_token * self.block_size
        device_bytes = torch.cuda.get_device_properties(self.device).total_memory \
            if self.device.type == "cuda" else None
        if config.gpu_memory_utilization is not None and device_bytes is None:
            log.info("engine.gpu_memory_utilization has no effect on %s: the KV cache is "
                     "kv_cache_memory_bytes (%d)", self.device, config.kv_cache_memory_bytes)
        elif config.gpu_memory_utilization is not None and config.num_kv_blocks is None:
            # As vLLM: the share must be free now (not held by another engine on this GPU).
            free, _ = torch.cuda.mem_get_info(self.device)
            share = config.gpu_memory_utilization * device_bytes
            if free < share:
                raise ValueError(
                    f"engine.gpu_memory_utilization: {config.gpu_memory_utilization} of "
                    f"{self.device} is {share / 2**30:.1f} GiB, and {free / 2**30:.1f} GiB is "
                    "free (another process holds the rest); lower it so that the engines "
                    "sharing this GPU fit together")
        self.num_blocks = config.num_kv_blocks or max(1, kv_cache_budget(
            config, self.whole_config, max_model_len, device_bytes, block_bytes) // block_bytes)
        if self.tp is not None:  # one scheduler's block ids address every rank's cache
            self.tp.agree(self.num_blocks, "the KV block count")
        # One allocation for all layers; per-layer views are what attention and transfers use.
        # Layout [layers, 2 (K, V), blocks, kv_heads, block_size, head_dim]: see pd_runtime/kernels/attention.
        # On the host it lives in huge pages (host_memory: transfers pull from it 2x faster).
        if self.device.type == "cuda":  # fail here, naming the settings, not at a long prompt
            plan = plan_memory(config, self.whole_config, max_model_len, device_bytes)
            check_fits(plan, device_bytes, f"engine.device {config.device!r}")
            self.memory_plan = plan  # bench/gpu_check.py sets it beside the measured peak
            log.info("GPU memory plan (%d KV blocks):\n%s", self.num_blocks, plan.table())
        width = row if self.kv_dtype == torch.int8 else cfg.head_dim
        kv_shape = (cfg.num_layers, 2, self.num_blocks, cfg.num_kv_heads, self.block_size, width)
        if self.on_host:
            self.kv_cache = host_zeros(kv_shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=config.device)
        self.kv_caches = list(self.kv_cache.unbind(0))
        # The decode side buffer is a host-path device: off the host, the paged kernels read
        # the blocks in place and it would only take memory (pd_runtime/kernels/attention.py).
        self.decode_buffer = DecodeKVBuffer(int(self.kv_cache.numel()
                                                * self.kv_cache.element_size()
                                                * decode_buffer_fraction(config)))
        self._row_bytes = cfg.num_kv_heads * cfg.head_dim * elem
        self.num_swap_blocks = config.swap_space_bytes // block_bytes \
            if config.preemption_mode == "swap" else 0
        self.swap_cache = torch.zeros(cfg.num_layers, 2, self.num_swap_blocks, cfg.num_kv_heads,
                                      self.block_size, width, dtype=self.kv_dtype,
                                      pin_memory=config.device.startswith("cuda"))
        # CUDA graphs of decode steps, captured now so that no request waits for them.
        self.graphs = None
        self.graph_capture_s: float | None = None
        if self.triton is not None and config.cuda_graphs and cfg.num_experts:
            # The experts' loop runs the experts its tokens chose: shapes a graph cannot hold.
            log.info("cuda_graphs: off for a mixture-of-experts model (decode runs eagerly)")
        elif self.triton is not None and config.cuda_graphs:
            # At t > 1 the all-reduces are NCCL kernels, which a graph holds: every rank
            # captures the same buckets in the same order (the warm-up runs before each capture
            # are collectives of all ranks) and replays the one its plan's batch names.
            from pd_runtime.engine.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, min(config.cuda_graph_max_batch_size,
                                                 config.max_num_seqs))
            self.graph_capture_s = self.graphs.capture()
        log.info("KV cache: %d bytes/token (2 x %d layers x %d kv heads x %d B per row, %s), "
                 "%d blocks of %d tokens = %.1f MiB", self.kv_bytes_per_token, cfg.num_layers,
                 cfg.num_kv_heads, row, config.kv_cache_dtype, self.num_blocks,
                 self.block_size, self.num_blocks * block_bytes / 2**20)

    def execute(self, plan: SchedulerOutput, on_layer=None,
                whole_chunks: tuple = ()) -> torch.Tensor | None:
        """Run one step; returns logits `[num_sampled, vocab]` in plan order of sample rows.
        `on_layer(i)`: called once layer i's K/V of this step are in the cache.
        `whole_chunks` (scheduled chunks, plan order): every row of their hidden states, before
        the vocabulary projection, is left in `whole_hidden` (prompt logprobs project them a
        slice at a time: a long chunk's logits at once could outgrow the memory plan)."""
        if self.tp is not None:
            self.tp.send_plan((plan, whole_chunks))
        return self._execute(plan, on_layer, whole_chunks)

    def follow(self) -> None:
        """A follower rank: run the driver's plans until it stops or is gone."""
        while (message := self.tp.recv_plan()) is not None:
            plan, whole_chunks = message
            self._execute(plan, None, whole_chunks)
            self.whole_hidden = None

    def stop_followers(self) -> None:
        """The driver: end the followers' `follow`."""
        if self.tp is not None and self.tp.rank == 0:
            try:
                self.tp.send_plan(None)
            except RuntimeError:
                pass  # a follower already gone
            self.tp.close()

    def _execute(self, plan: SchedulerOutput, on_layer, whole_chunks: tuple):
        self.whole_hidden = None
        self._on_layer = on_layer
        if plan.swap_out:
            dev, host = zip(*plan.swap_out)
            self.swap_cache[:, :, list(host)] = self.kv_cache[:, :, list(dev)].to("cpu")
        if plan.swap_in:
            host, dev = zip(*plan.swap_in)
            self.kv_cache[:, :, list(dev)] = self.swap_cache[:, :, list(host)].to(
                self.kv_cache.device)
        if not plan.scheduled:
            return None
        decodes = [s for s in plan.scheduled if len(s.token_ids) == 1]
        prefills = [s for s in plan.scheduled if len(s.token_ids) > 1]
        ordered = decodes + prefills
        # Rows to sample, in the order of plan.scheduled (the engine's order): a chunk's last
        # row, and with drafts (speculative decoding) the rows of the token before each one.
        row_of = {}
        offset = 0
        for s in ordered:
            offset += len(s.token_ids)
            row_of[s.request_id] = offset - 1
        rows = [r for s in plan.scheduled if s.sample
                for r in range(row_of[s.request_id] - len(s.draft_ids),
                               row_of[s.request_id] + 1)]
        num_sampled = len(rows)
        rows += [r for s in whole_chunks
                 for r in range(row_of[s.request_id] - len(s.token_ids) + 1,
                                row_of[s.request_id] + 1)]
        if self.graphs is not None and not prefills and not whole_chunks:
            logits = self.graphs.run(decodes)
            if logits is not None and self.tp is not None and self.tp.rank:
                return None  # (a follower replayed its part; the driver samples)
            if logits is not None:  # rows in plan order (every decode row is sampled)
                return logits if rows == list(range(len(rows))) \
                    else logits[torch.tensor(rows, device=self.device)]
        if self.triton is not None:
            hidden = self._forward_device(decodes, prefills, rows)
        else:
            hidden = self._forward_host(decodes, prefills, ordered, rows)
        if len(rows) > num_sampled:
            self.whole_hidden = hidden[num_sampled:]
            hidden = hidden[:num_sampled]
        if not num_sampled or (self.tp is not None and self.tp.rank):
            return None  # (a follower: the driver samples)
        return self.model.compute_logits(hidden)

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        """A host-built tensor on the engine's device (one copy; none on the host)."""
        return t if self.on_host else t.to(self.device, non_blocking=True)

    def _forward_host(self, decodes, prefills, ordered, rows) -> torch.Tensor:
        """The host attention paths' metadata (decode buffer, fixed-order rows, per-segment
        tables); also what runs on a non-CUDA device (tests place it on `meta`)."""
        bs = self.block_size
        put = self._put
        # Decodes (one token each) as plain lists; prefill chunks as tensor ranges: per-token
        # Python lists cost ~1 ms per 2048 tokens.
        input_ids = [s.token_ids[0] for s in decodes]
        positions = [[s.start for s in decodes]]
        slots = [[s.block_ids[s.start // bs] * bs + s.start % bs for s in decodes]]
        meta = AttentionMetadata(slot_mapping=None)
        if self.fixed_order:  # every token reads the paged cache in place: no decode buffer
            meta.fixed_order = fixed_order.FixedOrderRows.build(
                [s.block_ids for s in ordered], [s.start for s in ordered],
                [len(s.token_ids) for s in ordered])
        elif decodes:
            meta.num_decode_tokens = len(decodes)
            lens = [s.start + 1 for s in decodes]
            meta.decode_context_lens = put(torch.tensor(lens, dtype=torch.long))
            fresh = self.decode_buffer.plan(tuple(s.request_id for s in decodes), lens,
                                            len(self.kv_caches), self._row_bytes)
            if fresh is not None:
                meta.decode_buffer = self.decode_buffer
            gathered = decodes if fresh is None else [decodes[i] for i in fresh]
            if gathered:  # block tables only of the rows read from the paged cache
                width = max(len(s.block_ids) for s in gathered)
                meta.decode_block_tables = put(torch.tensor(
                    [s.block_ids + [0] * (width - len(s.block_ids)) for s in gathered],
                    dtype=torch.long))
        offset = len(decodes)
        for s in prefills:
            n = len(s.token_ids)
            ctx = s.start + n
            table = torch.tensor(s.block_ids[:-(-ctx // bs)], dtype=torch.long)
            meta.prefills.append(PrefillSegment(offset, n, ctx, put(table)))
            input_ids.extend(s.token_ids)
            pos = torch.arange(s.start, ctx, dtype=torch.long)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            offset += n
        meta.slot_mapping = put(_cat_long(slots))
        meta.on_layer = self._on_layer
        # Nothing sampled (a chunk mid-prompt): the forward still writes K/V, for no rows.
        return self.model.forward(put(torch.tensor(input_ids, dtype=torch.long)),
                                  put(_cat_long(positions)), self.kv_caches, meta,
                                  output_rows=put(torch.tensor(rows, dtype=torch.long)))

    def _forward_device(self, decodes, prefills, rows) -> torch.Tensor:
        """CUDA: one host buffer of every index the step needs (ids, positions, slots, block
        tables, lengths), copied to the device in one transfer; the Triton kernels take
        block tables as they are (no gathers, no side buffer)."""
        bs = self.block_size
        nd = len(decodes)
        input_ids = [s.token_ids[0] for s in decodes]
        positions = [[s.start for s in decodes]]
        slots = [[s.block_ids[s.start // bs] * bs + s.start % bs for s in decodes]]
        seg_starts, seg_lens, seg_tables = [0], [], []
        for s in prefills:
            n = len(s.token_ids)
            ctx = s.start + n
            table = s.block_ids[:-(-ctx // bs)]
            seg_tables.append(table)
            seg_lens.append(ctx)
            seg_starts.append(seg_starts[-1] + n)
            input_ids.extend(s.token_ids)
            pos = torch.arange(s.start, ctx, dtype=torch.long)
            positions.append(pos)
            slots.append(torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs)
        dec_width = max((len(s.block_ids) for s in decodes), default=0)
        pre_width = max((len(t) for t in seg_tables), default=0)
        parts = [torch.tensor(input_ids, dtype=torch.long), _cat_long(positions),
                 _cat_long(slots), torch.tensor(rows, dtype=torch.long),
                 torch.tensor([s.start + 1 for s in decodes], dtype=torch.long),
                 torch.tensor([b for s in decodes
                               for b in s.block_ids + [0] * (dec_width - len(s.block_ids))],
                              dtype=torch.long),
                 torch.tensor(seg_starts, dtype=torch.long),
                 torch.tensor(seg_lens, dtype=torch.long),
                 torch.tensor([b for t in seg_tables for b in t + [0] * (pre_width - len(t))],
                              dtype=torch.long)]
        sizes = [len(p) for p in parts]
        flat = torch.cat(parts)
        if flat.device != self.device:
            flat = flat.pin_memory().to(self.device, non_blocking=True) \
                if self.device.type == "cuda" else flat.to(self.device)
        (ids, pos, slot_mapping, out_rows, dec_lens, dec_tables, qsl, pre_lens,
         pre_tables) = flat.split(sizes)
        dev = DeviceAttention(
            decode_block_tables=dec_tables.view(nd, dec_width).to(torch.int32),
            decode_context_lens=dec_lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32), context_lens=pre_lens.to(torch.int32),
            block_tables=pre_tables.view(len(prefills), pre_width).to(torch.int32),
            max_query_len=max((len(s.token_ids) for s in prefills), default=0))
        meta = AttentionMetadata(slot_mapping=slot_mapping, num_decode_tokens=nd,
                                 device_attention=dev, device_kernels=self.triton,
                                 on_layer=self._on_layer)
        sample_all = rows == list(range(len(input_ids)))  # every row, in order: no gather
        return self.model.forward(ids, pos, self.kv_caches, meta,
                                  output_rows=None if sample_all else out_rows)


def _cat_long(parts: list) -> torch.Tensor:
    """One int64 tensor from a leading Python list followed by tensors."""
    head = torch.tensor(parts[0], dtype=torch.long)
    return torch.cat([head, *parts[1:]]) if len(parts) > 1 else head
