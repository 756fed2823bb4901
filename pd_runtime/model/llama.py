"""One decoder for the Llama family (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm,
and the families model_config.py reads into it, Gemma 3's norms around each block among them).

Runs a flat batch of tokens from many sequences against the paged KV cache; weights are fused
(qkv, gate_up) at load time so every layer is four matmuls over prepacked weights (float32:
the native kernel, pd_runtime/kernels/cpu_linear.c; bf16: oneDNN's layout).
With `batch_invariant`, every row's result is independent of the rows batched with it: matmuls
padded to a row count the library is stable from (pd_runtime/kernels/row_stable.py), the MLP activation
and attention by fixed-order native kernels (the runner passes their metadata).
With a tensor-parallel group (`tp`), this is one rank's part: its heads, MLP columns and
experts (model/tensor_parallel.py), the row-parallel outputs all-reduced.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace

import torch
import torch.nn.functional as F

from pd_runtime.kernels import native, row_stable
from pd_runtime.kernels.attention import AttentionMetadata, paged_attention
from pd_runtime.model.gpt_oss import clamped_swiglu
from pd_runtime.model.model_config import ModelConfig
from pd_runtime.model.parallel_comm import TensorParallelGroup
from pd_runtime.model.rope import apply_rope, rope_tables

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as the reference implementation: normalise in fp32, cast, then scale; the
    # in-place steps only reuse temporaries (`normed` is never `x`, even for fp32 input).
    # bf16 on the CPU: the same steps fused in one native pass (pd_runtime/kernels/native.py) when built.
    # A float32 weight on a half-precision x (gpt-oss's, loader.py) scales before the cast.
    if weight.dtype == torch.float32 and x.dtype != torch.float32:
        return gemma_rms_norm(x, weight, eps)
    fused = native.rms_norm_bf16(x, weight, eps) if x.dtype == torch.bfloat16 else None
    if fused is not None:
        return fused
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return normed.to(x.dtype).mul_(weight)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: `weight` is 1 + the checkpoint's (float32, loader.py), applied before
    the cast to x's dtype, as transformers orders it (gpt-oss's too, its weight as it is)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))
    return normed.mul_(weight).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm (no bias): mean-centred and scaled in float32, then cast, as
    transformers orders it."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    normed = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The residual add in place (`h += delta`), then RMSNorm(h); one native pass for bf16."""
    fused = native.add_rms_norm_bf16(h, delta, weight, eps) \
        if h.dtype == torch.bfloat16 == weight.dtype else None
    if fused is not None:
        return fused
    return rms_norm(h.add_(delta), weight, eps)


# A layer's linears: packed once at load (experts one packing each) and probed for their
# row-stable count. The dense MLP, or a sparse layer's router, experts and shared expert.
LINEARS = ("qkv", "o", "gate_up", "down", "router", "shared_gate_up", "shared_down",
           "shared_gate")
EXPERT_LINEARS = ("experts_gate_up", "experts_down")


def prepack_weight(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """A CPU weight in the layout its fastest matmul reads, or None to keep plain `F.linear`.

    float32: the native kernel's panels (pd_runtime/kernels/cpu_linear.c), in bf16 when the values are
    bf16: measured 1.5-3x torch's GEMM at decode-sized calls, equal at prefill-sized ones,
    and every row by one fixed order, so the batch-invariant mode needs no padding. bfloat16:
    oneDNN's blocked layout, spared a per-call weight reorder (0-5% on prefill-sized matmuls,
    10-20% on decode-sized ones), used only when a probe shows it reproduces `F.linear` bit for
    bit at several row counts. Either way, once packed every call of the layer takes that path.
    """
    if weight.dtype == torch.float32 and weight.device.type == "cpu":
        return native.pack_linear(weight)
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" \
            or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        gen = torch.Generator().manual_seed(0)
        for rows in (1, 64, 300):
            probe = torch.randn(rows, weight.shape[1], generator=gen).to(weight.dtype)
            if not torch.equal(packed_linear(probe, packed, bias), F.linear(probe, weight, bias)):
                return None
    except (AttributeError, RuntimeError, NotImplementedError):
        return None
    return packed


class WidenedLinear:
    """A bfloat16 weight computed through the native float32 kernel (cpu_linear.c: every row by
    one fixed order, the weight's bf16 values widened exactly), the output rounded to bf16: the
    batch-invariant mode's matmul where the CPU's own bf16 GEMM gives rows that depend on the
    row count at every padding tried (oneDNN on an AVX512-BF16 + AMX Xeon: up to 129 rows)."""

    def __init__(self, weight: torch.Tensor):
        self.native = native.pack_linear(weight.float())


def can_widen(weight: torch.Tensor) -> bool:
    """Whether `weight` can run as a WidenedLinear here (bf16 on a CPU the kernel runs on)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" \
        and native.pack_linear(torch.zeros(16, 8)) is not None


def widen(weight: torch.Tensor) -> "WidenedLinear | None":
    """`weight`'s WidenedLinear, or None where it cannot run here."""
    return WidenedLinear(weight) if can_widen(weight) else None


def packed_linear(x: torch.Tensor, packed, bias: torch.Tensor | None = None):
    if isinstance(packed, WidenedLinear):
        out = native.linear_f32(x.float(), packed.native, bias)
        if out is None:
            raise ValueError(f"native linear cannot take {tuple(x.shape)} {x.dtype}")
        return out.to(x.dtype)
    if isinstance(packed, native.PackedLinear):
        out = native.linear_f32(x, packed, bias)
        if out is None:  # the same kernel ran at load: only a caller's bad input gets here
            raise ValueError(f"native linear cannot take {tuple(x.shape)} {x.dtype}")
        return out
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, packed, bias: torch.Tensor | None = None,
           min_rows: int = 1) -> torch.Tensor:
    """`x @ weight.T + bias`, computed in a call of at least `min_rows` rows (zero rows padded
    on: the batch-invariant mode's row-stable count, pd_runtime/kernels/row_stable.py)."""
    rows = x.shape[0]
    if rows < min_rows:
        x = row_stable.pad_rows(x, min_rows)
    out = packed_linear(x, packed, bias) if packed is not None else F.linear(x, weight, bias)
    return out if rows >= min_rows else out[:rows]


class LlamaModel:
    """Holds the fused weights; `forward` returns final hidden states for the flat batch."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: str = "cpu", max_positions: int | None = None,
                 batch_invariant: bool = False, tp: TensorParallelGroup | None = None):
        self.cfg = cfg  # with tp: the rank's heads and MLP width (tensor_parallel.local_config)
        self.tp = tp if tp is not None and tp.size > 1 else None
        # The experts this rank holds are [expert_start, expert_start + len(its stack)).
        self.expert_start = tp.rank * (cfg.num_experts // tp.size) if self.tp else 0
        self.dtype = dtype
        self.device = device
        self.scale = cfg.attention_multiplier if cfg.attention_multiplier is not None \
            else cfg.head_dim ** -0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        w = weights
        self.embed = w["embed"]
        self.final_norm = w["final_norm"]
        self.lm_head = w.get("lm_head", self.embed)
        self.layers = w["layers"]
        self.nope_layers = frozenset(cfg.nope_layers)
        self.norm = gemma_rms_norm if cfg.gemma_norms else \
            layer_norm if cfg.norm_kind == "layer" else rms_norm
        # Gemma's embedding scale is rounded to the model's dtype first (a tensor); Granite's is
        # applied as a number.
        self.embed_scale = torch.tensor(cfg.embedding_multiplier).to(dtype) \
            if cfg.gemma_norms else cfg.embedding_multiplier
        # Each layer's attention window (0: the whole context).
        self.windows = [cfg.sliding_window if i in cfg.window_layers else 0
                        for i in range(cfg.num_layers)]
        # Kept beside the plain weights (which loading, transfers and tests read): a second
        # copy of the linear weights, half their size for bf16 values run in float32, their
        # size otherwise (the bench model's: 64 MB; its float32 weights 128 MB).
        self.packed = [{name: prepack_weight(layer[name], layer.get(name + "_bias"))
                        for name in LINEARS if name in layer} for layer in self.layers]
        for layer, packed in zip(self.layers, self.packed):  # experts: one packing each
            for name in EXPERT_LINEARS:
                if name in layer:
                    packed[name] = [prepack_weight(w) for w in layer[name]]
        # Only the driver rank computes logits: a follower keeps no LM head of its own (the
        # loader reads none; the embedding stands in, unused) and packs none.
        self.lm_head_packed = prepack_weight(self.lm_head) if not (self.tp and tp.rank) \
            else None
        self.batch_invariant = batch_invariant
        # Rows each matmul is padded to (1: as called); the activation in one native pass.
        self.min_rows = {name: 1 for name in (*LINEARS, *EXPERT_LINEARS, "lm_head")}
        self.native_silu = False
        if batch_invariant:
            self._probe_row_stability()
        n_pos = max_positions or cfg.max_position_embeddings
        # (OLMo and Cohere turn q and k in float32, as transformers does; OLMo's tables stay
        # float32 too.)
        rope_dtype = torch.float32 if cfg.rope_tables_float32 else dtype
        turn = functools.partial(apply_rope, interleaved=cfg.rope.interleaved)
        self._turn = (lambda x, cos, sin: turn(x.float(), cos, sin).to(x.dtype)) \
            if cfg.rope_float32 else turn
        self.cos, self.sin = rope_tables(cfg, n_pos, device, rope_dtype)
        # Gemma 3's and OLMo 3's windowed layers turn by a rope of their own.
        self.local_rope = rope_tables(replace(cfg, rope=cfg.local_rope), n_pos, device,
                                      rope_dtype) if cfg.local_rope is not None else None

    def _probe_row_stability(self) -> None:
        """Find each matmul shape's stable row count (the first layer stands for all: same
        shapes, same paths) and whether the native activation runs here."""
        for name in self.min_rows:
            index = next((i for i, layer in enumerate(self.layers) if name in layer), None)
            if name != "lm_head" and index is None:
                continue  # a model with no dense MLP, or no experts
            layer, packed = (self.layers[index], self.packed[index]) if index is not None \
                else ({}, {})
            weight = self.lm_head if name == "lm_head" else layer[name]
            pack = self.lm_head_packed if name == "lm_head" else packed.get(name)
            if name.startswith("experts_"):  # every expert has the first's shape and path
                weight, pack = weight[0], pack[0]
            bias = None if name in ("lm_head", *EXPERT_LINEARS) else layer.get(name + "_bias")
            key = (tuple(weight.shape), weight.dtype, str(weight.device), pack is not None,
                   bias is not None)
            widens = can_widen(weight)
            found = row_stable.stable_min_rows(
                lambda x: linear(x, weight, pack, bias), weight.shape[1], self.dtype,
                self.device, key, warn=not widens)
            if found is None and widens:
                # No padding makes this bf16 GEMM row-stable here: the native float32 kernel
                # for this matmul in every layer (probed too: it must be stable from 1 row).
                self._widen(name)
                pack = self.lm_head_packed if name == "lm_head" else self.packed[index][name]
                pack = pack[0] if name.startswith("experts_") else pack
                found = row_stable.stable_min_rows(
                    lambda x: linear(x, weight, pack, bias), weight.shape[1], self.dtype,
                    self.device, (*key, "widened"))
                log.info("batch invariance: the bf16 matmul %s is not row-stable here at any "
                         "padding; it runs through the native float32 kernel", key)
            self.min_rows[name] = found or 1
        width = self.cfg.moe_intermediate_size if self.cfg.num_experts else \
            self.cfg.intermediate_size
        probe = torch.zeros(1, 2 * width, dtype=self.dtype, device=self.device)
        self.native_silu = self.cfg.mlp_act == "silu" and native.silu_mul(probe) is not None

    def _widen(self, name: str) -> None:
        if name == "lm_head":
            if not (self.tp and self.tp.rank):  # (a follower computes no logits)
                self.lm_head_packed = widen(self.lm_head)
            return
        for layer, packed in zip(self.layers, self.packed):
            if name in layer:
                packed[name] = [widen(w) for w in layer[name]] if name.startswith("experts_") \
                    else widen(layer[name])

    def _attention(self, layer: dict, packed: dict, x: torch.Tensor, cos, sin, kv_layer,
                   meta, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every token (all of them write K/V); the output projection only for
        `rows` when given."""
        cfg = self.cfg
        qkv = linear(x, layer["qkv"], packed["qkv"], layer.get("qkv_bias"), self.min_rows["qkv"])
        v = qkv[:, self.q_size + self.kv_size:].view(-1, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rotated_qk(layer, qkv, cos, sin)
        out = paged_attention(q, k, v.contiguous(), kv_layer, meta, self.scale)
        out = out.reshape(-1, self.q_size)
        return self._row_parallel(out if rows is None else out[rows], layer, packed, "o")

    def _row_parallel(self, x: torch.Tensor, layer: dict, packed: dict, name: str):
        """A projection back to the hidden size: with tp, this rank's partial sum, all-reduced,
        its bias added once after."""
        bias = layer.get(name + "_bias")
        if self.tp is None:
            return linear(x, layer[name], packed[name], bias, self.min_rows[name])
        out = self.tp.all_reduce(linear(x, layer[name], packed[name], None,
                                        self.min_rows[name]))
        return out if bias is None else out.add_(bias)

    def rotated_qk(self, layer: dict, qkv: torch.Tensor, cos, sin):
        """q `[T, heads, d]` and k `[T, kv_heads, d]` of a layer's qkv projection, normed where
        the family norms them, turned by rope (cos None: not turned)."""
        cfg = self.cfg
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cos is None:  # a layer without rope (SmolLM3's NoPE layers)
            qk = qkv[:, :self.q_size + self.kv_size].reshape(-1, heads + kv_heads, head_dim)
            return qk[:, :heads], qk[:, heads:]
        if cfg.qk_norm and cfg.qk_norm_whole:  # (OLMo 2's, OLMoE's: over all heads)
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], -1)
            q = self.norm(q.contiguous(), layer["q_norm"], cfg.rms_norm_eps)
            k = self.norm(k.contiguous(), layer["k_norm"], cfg.rms_norm_eps)
            return (self._turn(q.view(-1, heads, head_dim), cos, sin),
                    self._turn(k.view(-1, kv_heads, head_dim), cos, sin))
        if cfg.qk_norm:
            # Contiguous first: the fused bf16 norm takes dense rows; torch's float path over
            # the strided view reduced in an order that depended on the row count (a token's
            # logprobs then changed with its batch).
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], -1)
            q = self._turn(self.norm(q.contiguous().view(-1, heads, head_dim), layer["q_norm"],
                                    cfg.rms_norm_eps), cos, sin)
            k = self._turn(self.norm(k.contiguous().view(-1, kv_heads, head_dim), layer["k_norm"],
                                    cfg.rms_norm_eps), cos, sin)
            return q, k
        # q and k heads side by side in qkv: one rotation for both (half the launches)
        qk = self._turn(qkv[:, :self.q_size + self.kv_size].view(-1, heads + kv_heads,
                                                                  head_dim), cos, sin)
        return qk[:, :heads], qk[:, heads:]

    def _mlp(self, layer: dict, packed: dict, x: torch.Tensor) -> torch.Tensor:
        if "router" in layer:
            return self._experts(layer, packed, x)
        gate_up = linear(x, layer["gate_up"], packed["gate_up"], layer.get("gate_up_bias"),
                         self.min_rows["gate_up"])
        return self._row_parallel(self._silu_mul(gate_up), layer, packed, "down")

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: SiLU, or Gemma's tanh-approximated GELU; gpt-oss's clamped SwiGLU."""
        if self.cfg.mlp_act == "clamped_swiglu":
            return clamped_swiglu(gate_up, self.cfg.swiglu_alpha, self.cfg.swiglu_limit)
        act = native.silu_mul(gate_up) if self.native_silu else None
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh").mul_(up) if self.cfg.mlp_act == "gelu_tanh" \
                else F.silu(gate).mul_(up)
        return act

    def _experts(self, layer: dict, packed: dict, x: torch.Tensor) -> torch.Tensor:
        """A sparse layer's MLP, as transformers computes it (its default grouped experts):
        the router's softmax (float32) picks each token's top experts; each expert runs on its
        tokens and its output is scaled by the token's weight for it; a token's weighted
        outputs are summed in the order of its choices (float32 accumulation for bf16) and
        rounded once. Every step is row by row (matmuls at their row-stable counts), so a
        token's result does not depend on which others share its batch. gpt-oss's and
        GraniteMoE's routers pick by logit and softmax over the picked (cfg.routing)."""
        cfg = self.cfg
        logits = linear(x, layer["router"], packed["router"], layer.get("router_bias"),
                        self.min_rows["router"])
        if cfg.routing != "softmax_topk":
            top, chosen = torch.topk(logits, cfg.experts_per_token, dim=-1)
            weights = torch.softmax(top, dim=-1, dtype=top.dtype) \
                if cfg.routing == "topk_softmax" else torch.softmax(top.float(), dim=-1)
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)
            if cfg.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True)
        if not cfg.router_weights_float32:
            weights = weights.to(logits.dtype)
        # Mixtral's float32 weights make float32 products (rounded only after the sum). With
        # tp, the slots of other ranks' experts stay zero and the all-reduce fills them.
        weighted = (torch.zeros if self.tp else torch.empty)(
            *chosen.shape, x.shape[-1], device=x.device,
            dtype=torch.promote_types(x.dtype, weights.dtype))
        local = range(self.expert_start, self.expert_start + len(layer["experts_gate_up"]))
        # gpt-oss's expert biases: added to the rounded products, as transformers adds them.
        up_bias, down_bias = layer.get("experts_gate_up_bias"), layer.get("experts_down_bias")
        for expert in torch.unique(chosen).tolist():
            if expert not in local:
                continue
            tokens, slot = torch.where(chosen == expert)
            e = expert - local.start
            gate_up = linear(x[tokens], layer["experts_gate_up"][e],
                             packed["experts_gate_up"][e], None,
                             self.min_rows["experts_gate_up"])
            if up_bias is not None:
                gate_up += up_bias[e]
            down = linear(self._silu_mul(gate_up), layer["experts_down"][e],
                          packed["experts_down"][e], None, self.min_rows["experts_down"])
            if down_bias is not None:
                down += down_bias[e]
            weighted[tokens, slot] = down * weights[tokens, slot, None]
        if self.tp is not None:  # each slot from one rank, zeros from the rest: exact
            self.tp.all_reduce(weighted)
        out = weighted.sum(dim=1).to(x.dtype)
        if "shared_gate_up" in layer:  # Qwen2-MoE: every token's shared expert, gated
            gate_up = linear(x, layer["shared_gate_up"], packed["shared_gate_up"], None,
                             self.min_rows["shared_gate_up"])
            shared = linear(self._silu_mul(gate_up), layer["shared_down"],
                            packed["shared_down"], None, self.min_rows["shared_down"])
            # (packed: torch's float32 GEMV for one output gave rows that depend on the count)
            gate = linear(x, layer["shared_gate"], packed["shared_gate"], None,
                          self.min_rows["shared_gate"])
            out = out + torch.sigmoid(gate) * shared
        return out

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states of the flat batch, or of `output_rows` only (the rows to be
        sampled). With output_rows, the last layer still computes every token's K/V, but its
        output projection and MLP only for those rows: in a prefill chunk only the last token
        is sampled, so this skips ~80% of the last layer's linear work there, and the rows it
        returns are exactly what the full computation gives (every op after attention is
        row-wise)."""
        eps = self.cfg.rms_norm_eps
        h = F.embedding(input_ids, self.embed)
        residual = self.cfg.residual_multiplier  # Granite's scalings (1.0 elsewhere)
        if self.cfg.embedding_multiplier != 1.0:
            h = h * self.embed_scale
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        if self.cfg.block_norms == "parallel":
            return self._parallel_layers(h, (cos, sin), kv_caches, meta, output_rows)
        if self.cfg.block_norms != "pre":
            return self._sandwich_layers(h, (cos, sin), positions, kv_caches, meta, output_rows)
        # The residual stream h is this forward's own tensor (the embedding output), never an
        # input, so it is updated in place; each block's output is added in front of the next
        # norm (add_rms_norm), which is where a fused kernel can take both.
        mlp_out = None
        last = len(self.layers) - 1
        for index, (layer, packed, kv_layer) in enumerate(zip(self.layers, self.packed,
                                                              kv_caches)):
            meta.layer, meta.window = index, self.windows[index]
            meta.sinks = layer.get("sinks")  # gpt-oss's
            x = rms_norm(h, layer["in_norm"], eps) if mlp_out is None \
                else add_rms_norm(h, mlp_out, layer["in_norm"], eps)
            rows = output_rows if index == last else None
            rope = (None, None) if index in self.nope_layers else (cos, sin)
            attn_out = self._attention(layer, packed, x, *rope, kv_layer, meta, rows)
            if meta.on_layer is not None:
                meta.on_layer(index)
            if rows is not None:
                h = h[rows]  # a new tensor: the residual stream of the output rows only
            if residual != 1.0:
                attn_out.mul_(residual)
            mlp_out = self._mlp(layer, packed, add_rms_norm(h, attn_out, layer["post_norm"], eps))
            if residual != 1.0:
                mlp_out.mul_(residual)
        return add_rms_norm(h, mlp_out, self.final_norm, eps)

    def _sandwich_layers(self, h: torch.Tensor, rope: tuple, positions: torch.Tensor,
                         kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                         output_rows: torch.Tensor | None) -> torch.Tensor:
        """Gemma 2/3's layers (forward's contract): each block's output normed before it joins
        the residual stream, the MLP's input by a norm of its own; Gemma 3's windowed layers
        turn by their own rope. OLMo 2's: the outputs' norms alone."""
        eps, norm, last = self.cfg.rms_norm_eps, self.norm, len(self.layers) - 1
        meta.softcap = self.cfg.attn_softcap or 0.0
        local = (self.local_rope[0][positions].unsqueeze(1),
                 self.local_rope[1][positions].unsqueeze(1)) if self.local_rope else rope
        for index, (layer, packed, kv_layer) in enumerate(zip(self.layers, self.packed,
                                                              kv_caches)):
            meta.layer, meta.window = index, self.windows[index]
            rows = output_rows if index == last else None
            turn = local if index in self.cfg.local_rope_layers else rope
            x = norm(h, layer["in_norm"], eps) if "in_norm" in layer else h
            attn_out = self._attention(layer, packed, x, *turn, kv_layer, meta, rows)
            if meta.on_layer is not None:
                meta.on_layer(index)
            if rows is not None:
                h = h[rows]  # a new tensor: the residual stream of the output rows only
            h.add_(norm(attn_out, layer["post_norm"], eps))
            mlp_out = self._mlp(layer, packed, norm(h, layer["pre_ff_norm"], eps)
                                if "pre_ff_norm" in layer else h)
            h.add_(norm(mlp_out, layer["post_ff_norm"], eps))
        return norm(h, self.final_norm, eps)

    def _parallel_layers(self, h: torch.Tensor, rope: tuple, kv_caches: list[torch.Tensor],
                         meta: AttentionMetadata,
                         output_rows: torch.Tensor | None) -> torch.Tensor:
        """Cohere's layers (forward's contract): one norm, whose output attention and the MLP
        both take, both added to the residual stream (attention's first)."""
        eps, last = self.cfg.rms_norm_eps, len(self.layers) - 1
        for index, (layer, packed, kv_layer) in enumerate(zip(self.layers, self.packed,
                                                              kv_caches)):
            meta.layer, meta.window = index, self.windows[index]
            rows = output_rows if index == last else None
            x = self.norm(h, layer["in_norm"], eps)
            turn = (None, None) if index in self.nope_layers else rope
            attn_out = self._attention(layer, packed, x, *turn, kv_layer, meta, rows)
            if meta.on_layer is not None:
                meta.on_layer(index)
            if rows is not None:
                h, x = h[rows], x[rows]  # the output rows only, from here on
            h.add_(attn_out).add_(self._mlp(layer, packed, x))
        return self.norm(h, self.final_norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.lm_head, self.lm_head_packed,
                        min_rows=self.min_rows["lm_head"])
        if self.cfg.logit_scale != 1.0:  # Cohere's, in the model's dtype as it multiplies
            logits = logits * self.cfg.logit_scale
        if self.cfg.logits_scaling != 1.0:  # Granite's, in the model's dtype as it divides
            logits = logits / self.cfg.logits_scaling
        if self.cfg.final_softcap:  # Gemma 2's, in the model's dtype too
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
