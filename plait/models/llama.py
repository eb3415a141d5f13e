"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Qwen3, Mistral) over plait's KV pool.

Module names mirror Hugging Face's so checkpoints load by name. Tokens of a batch are
flattened ([num_tokens, hidden]); attention goes through an AttentionBackend with the
batch's metadata, so no model code knows the cache layout. The one exception is the CPU's
fused path (plait.kernels.fused_ops, `_forward_fused`): there rotary writes K and V straight
into the pool rows at meta.out_cache_loc, for a backend that accepts_stored_kv.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from plait.kernels import woq
from plait.kernels.cpu_attention import decode_kernel
from plait.kernels.fused_ops import FusedOps, fused_ops, rms_norm_reference, rotate_reference
from plait.models.registry import register_model

if TYPE_CHECKING:
    from plait.kernels.base import AttentionBackend, AttentionMetadata
    from plait.radix_cache.kv_pool import KVPool

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin of the batch's positions [T, 1, D/2]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling: unsupported rope_type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding with a precomputed cos/sin table."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        # computed on the CPU even inside load_model's meta-device build: arange on the meta
        # device goes through torch._refs and imports torch._dynamo (2.8 s per start)
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, theta, scaling).float()
            t = torch.arange(max_pos, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_pos, head_dim / 2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D/2] of the positions: looked up once per forward, for every
        layer (30 layers of SmolLM2 each indexing the table cost two ops apiece)."""
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]


class Attention(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        # q, k and v projections fused into one matmul (loaded from HF's q_proj/k_proj/v_proj)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(hidden, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.attn = attn_backend

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], kv_pool: KVPool,
                meta: AttentionMetadata):
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
            q, k = rotate_reference(q, *rope), rotate_reference(k, *rope)
        else:
            # q and k are adjacent in the fused output: rotate them as one [T, H + Hkv, D] view
            qk = qkv[:, : self.q_size + self.kv_size].unflatten(
                -1, (self.num_heads + self.num_kv_heads, self.head_dim)
            )
            qk = rotate_reference(qk, *rope)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        o = self.attn.forward(q, k, v, self.layer_id, kv_pool, meta)  # [T, H, D]
        return self.o_proj(o.reshape(num_tokens, -1))

    def forward_fused(self, x, rope: Rope, kv_pool: KVPool, meta: AttentionMetadata,
                      ops: FusedOps) -> torch.Tensor:
        """forward with rotary and the K/V store fused into one pass over the qkv rows: K and V
        go straight into this layer's pool rows at meta.out_cache_loc, and the backend (one that
        accepts_stored_kv) is given k = v = None. With q/k norms: forward."""
        if self.qk_norm or not getattr(self.attn, "accepts_stored_kv", False):
            return self.forward(x, rope, kv_pool, meta)
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        q = ops.rope_store_kv(
            qkv, rope[0], rope[1], kv_pool.k_buffer[self.layer_id],
            kv_pool.v_buffer[self.layer_id], meta.out_cache_loc, self.num_heads,
            self.num_kv_heads,
        )  # [T, H, D]
        o = self.attn.forward(q, None, None, self.layer_id, kv_pool, meta)
        return self.o_proj(o.reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)  # gate_proj ; up_proj
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)

    def forward_fused(self, x: torch.Tensor, ops: FusedOps) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if (isinstance(gate_up, woq.PanelLinear) and isinstance(down, woq.PanelLinear)
                and gate_up.takes_bf16(x.shape[0]) and down.takes_bf16(x.shape[0])
                and gate_up.bias is None and down.bias is None):
            # --cpu-bf16-linear-rows: gate_up's product stays bf16 through silu * up into the
            # down projection (converting [T, 2I] to fp32 and [T, I] back cost SmolLM2's MLP at
            # 4,096 rows 17.2 ms against 12.6)
            gate, up = gate_up.bf16_product(x).split(self.intermediate, dim=-1)
            return down.bf16_product(nn.functional.silu(gate) * up).float()
        if isinstance(gate_up, woq.GateUpPanelLinear):
            return down(gate_up.silu_product(x, ops))  # silu * up in gate_up's epilogue
        return down(ops.silu_mul(gate_up(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer_id: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, attn_backend)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, kv_pool, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, residual: torch.Tensor, h: torch.Tensor, rope: Rope, kv_pool: KVPool,
                      meta: AttentionMetadata, ops: FusedOps, next_norm: RMSNorm) -> torch.Tensor:
        """The layer on its normed input h [T, hidden], each residual add fused with the RMSNorm
        after it: `residual` (the stream) is updated in place, and the result is the stream
        normed by next_norm (the next layer's input norm, or the model's final norm)."""
        a = self.self_attn.forward_fused(h, rope, kv_pool, meta, ops)
        norm = self.post_attention_layernorm
        h = ops.add_rms_norm_(residual, a, norm.weight, norm.eps)
        m = self.mlp.forward_fused(h, ops)
        return ops.add_rms_norm_(residual, m, next_norm.weight, next_norm.eps)


class LlamaBody(nn.Module):
    def __init__(self, cfg: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        # _weight: no random init of a weight the checkpoint overwrites
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, attn_backend) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Also serves Qwen2 (qkv bias), Qwen3 (q/k norm) and Mistral through ModelConfig flags."""

    # set by the model runner (CPU, float32): run the small operators of each layer through
    # fused_cpu.cpp once it is built (plait.kernels.fused_ops), torch's until then
    use_fused_cpu_ops = False

    # checkpoint name -> (fused parameter name, index of its shard within the fused rows)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # tensor parallelism (plait.runtime.parallel): how each checkpoint module splits over ranks
    tp_plan = {
        "q_proj": "column", "k_proj": "kv_heads", "v_proj": "kv_heads",
        "gate_proj": "column", "up_proj": "column",
        "o_proj": "row", "down_proj": "row",
        "embed_tokens": "vocab", "lm_head": "vocab",
    }

    def shard_sizes(self, fused: str) -> list[int]:
        cfg = self.cfg
        if fused == "qkv_proj":
            kv = cfg.num_key_value_heads * cfg.head_dim
            return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
        return [cfg.intermediate_size, cfg.intermediate_size]

    def __init__(self, cfg: Any, attn_backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaBody(cfg, attn_backend)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            # skip_init: no random init of a weight the checkpoint overwrites
            self.lm_head = torch.nn.utils.skip_init(
                nn.Linear, cfg.hidden_size, cfg.vocab_size, bias=False, device="meta"
            )

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary(positions)
        ops = fused_ops() if self.use_fused_cpu_ops else None
        if ops is not None and x.dtype == torch.float32 and x.device.type == "cpu":
            return self._forward_fused(x, rope, kv_pool, meta, ops)
        for layer in self.model.layers:
            x = layer(x, rope, kv_pool, meta)
        return self.model.norm(x)

    def _forward_fused(self, x, rope: Rope, kv_pool: KVPool, meta: AttentionMetadata,
                       ops: FusedOps) -> torch.Tensor:
        """forward's result through the fused operators (bit-identical to torch's, see
        fused_cpu.cpp). x, the embeddings [T, hidden], is the residual stream, updated in place."""
        layers = list(self.model.layers)  # (slicing the ModuleList would build a new one)
        first = layers[0].input_layernorm
        h = ops.rms_norm(x, first.weight, first.eps)
        # the lean loops call the fp32 panel kernels directly: a forward whose linears run in
        # bf16 (--cpu-bf16-linear-rows) takes the modules
        bf16 = 0 < self.bf16_linear_rows <= x.shape[0]
        lean = self._lean_layers(kv_pool) if self.use_lean_loop and not bf16 else None
        if lean is not None:
            return self._forward_lean(x, h, rope, kv_pool, meta, ops, lean)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        for layer, next_norm in zip(layers, next_norms):
            h = layer.forward_fused(x, h, rope, kv_pool, meta, ops, next_norm)
        return h

    _lean: tuple[int, list[tuple]] | None = None  # (id of the pool, _lean_layers' list)
    bf16_linear_rows = 0  # set by the model runner (--cpu-bf16-linear-rows): 0, never
    use_lean_loop = True  # False: the module path (benchmarks A/B the two)

    def _lean_layers(self, kv_pool: KVPool) -> list[tuple] | None:
        """Each layer's raw operands for _forward_lean, when every linear is a panel linear
        (fp32 PanelLinear, or int8/int4 quantized) without bias on loaded kernels and the
        attention takes stored K/V; else None. Built once per pool (the modules do not change
        after the runner prepacks or quantizes them)."""
        if self._lean is not None and self._lean[0] == id(kv_pool):
            return self._lean[1]
        layers = list(self.model.layers)
        if self.cfg.qk_norm or not hasattr(layers[0].self_attn.attn, "layer_attention"):
            return None
        norms = [layer.input_layernorm for layer in layers[1:]] + [self.model.norm]
        out = []
        for i, (layer, next_norm) in enumerate(zip(layers, norms)):
            attn, mlp = layer.self_attn, layer.mlp
            lins = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(not isinstance(m, woq._PanelLinear) or m.bias is not None for m in lins):
                return None
            calls = [m.kernel_call() for m in lins]
            if any(c is None for c in calls):  # fp32 kernels still loading
                return None
            post = layer.post_attention_layernorm
            out.append((
                i, attn.num_heads, attn.num_kv_heads, *calls,
                post.weight, post.eps, next_norm.weight, next_norm.eps,
            ))
        self._lean = (id(kv_pool), out)
        return out

    def _forward_lean(self, x, h, rope: Rope, kv_pool: KVPool, meta: AttentionMetadata,
                      ops: FusedOps, lean: list[tuple]) -> torch.Tensor:
        """_forward_fused's layers with no module calls: the C++ kernels called in a row on
        operands gathered once (_lean_layers), attention through the backend's per-forward
        layer_attention. The same kernels on the same inputs as the module path, so the same
        results; ~100 us a step less Python per layer (SmolLM2's 30 layers on the AVX2 VM: 3.2
        ms of a 25 ms fp32 batch-1 step, A/B in one process). Each linear is (fn, operands):
        its panel kernel (fp32, int8 or int4) and weights (woq._PanelLinear.kernel_call)."""
        cos, sin = rope
        loc = meta.out_cache_loc
        backend = self.model.layers[0].self_attn.attn
        decoder = self._decode_layers(kv_pool, ops, lean) if self.use_cpp_layer_loop else None
        if decoder is not None:
            direct = backend.decode_kernel_operands(kv_pool, meta)
            if direct is not None:
                _, slots, lens, scaling, groups = direct
                return decoder.run(x, h, cos, sin, loc, slots, lens, scaling, groups)
        kb, vb = kv_pool.k_buffer, kv_pool.v_buffer
        attend = backend.layer_attention(kv_pool, meta)
        for (i, heads, kv_heads, (qkv, qkv_w), (o, o_w), (gu, gu_w), (down, d_w),
             post_w, post_eps, next_w, next_eps) in lean:
            q = ops.rope_store_kv(qkv(h, *qkv_w), cos, sin, kb[i], vb[i], loc, heads, kv_heads)
            a = o(attend(q, i), *o_w)
            h = ops.add_rms_norm_(x, a, post_w, post_eps)
            act = gu(h, *gu_w)
            if gu.__name__ != "fp32_linear_silu":  # (that one applies silu * up itself)
                act = ops.silu_mul(act)
            m = down(act, *d_w)
            h = ops.add_rms_norm_(x, m, next_w, next_eps)
        return h

    _decoder: tuple[int, Any] | None = None  # (id of the pool, fused_cpu.cpp's DecodeLayers)
    use_cpp_layer_loop = True  # False: _forward_lean's Python loop (benchmarks A/B the two)

    def _decode_layers(self, kv_pool: KVPool, ops: FusedOps, lean: list[tuple]):
        """_forward_lean's loop as one C++ call (fused_cpu.cpp's DecodeLayers: the same
        kernels in the same order, so the same results) for decode batches whose attention goes
        straight to attn_cpu.cpp (shared prefixes included); built once per pool, None until
        the attention kernel is loaded. It saves SmolLM2's ~270 Python calls a step (batch 1
        1.03-1.08x, batch 8 1.1x on the AVX2 VM: the README's measured sections)."""
        if self._decoder is not None and self._decoder[0] == id(kv_pool):
            return self._decoder[1]
        kernel = decode_kernel()
        cls = getattr(ops.module, "DecodeLayers", None)
        if kernel is None or cls is None:
            return None
        layers = [(*layer[:3], *(woq.kernel_entry(c) for c in layer[3:7]), *layer[7:])
                  for layer in lean]
        decoder = cls(layers, kv_pool.k_buffer, kv_pool.v_buffer, kernel.entry_points(),
                      ops.sum_lanes, ops.silu_lanes)
        self._decoder = (id(kv_pool), decoder)
        return decoder

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        packed = getattr(self, "packed_lm_head", None)
        if packed is not None:  # a oneDNN-prepacked copy of the weight (CPU, see cpu_tuning)
            return packed(hidden)
        return torch.matmul(hidden, self.lm_head_weight.t()).float()  # [N, vocab]


register_model("LlamaForCausalLM", LlamaForCausalLM)
register_model("MistralForCausalLM", LlamaForCausalLM)
register_model("Qwen2ForCausalLM", LlamaForCausalLM, {"attention_bias": True})
register_model("Qwen3ForCausalLM", LlamaForCausalLM, {"qk_norm": True})
