"""Torch attention over the KV pool: the plain references (the oracle every kernel is tested
against) and the `torch` backend, which runs the faster paths of plait.kernels.cpu_attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.kernels.base import AttentionBackend, AttentionMetadata
from plait.kernels.cpu_attention import decode_attention_cpu, decode_kernel, plan_rows
from plait.kernels.cpu_extend import KERNEL_POOL_DTYPES, extend_attention_cpu, plan_extend

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool


def store_kv_reference(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    # k_buffer: [num_slots, kv_heads, head_dim]; loc: [T]; k: [T, kv_heads, head_dim]
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.to(v_buffer.dtype)


def extend_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]; K/V read from the pool (already holding the new tokens)."""
    out = torch.empty_like(q)
    num_heads, num_kv_heads = q.shape[1], k_buffer.shape[1]
    group = num_heads // num_kv_heads
    start = 0
    for i in range(meta.batch_size):
        ext, seq, pre = meta.extend_lens_cpu[i], meta.seq_lens_cpu[i], meta.prefix_lens_cpu[i]
        slots = meta.req_to_token[meta.req_pool_indices[i], :seq].long()
        k = k_buffer[slots].to(q.dtype)  # [S, Hkv, D]
        v = v_buffer[slots].to(q.dtype)
        qi = q[start : start + ext]  # [E, H, D]
        # token at row r sits at absolute position pre + r and sees keys 0..pre + r
        q_pos = torch.arange(pre, pre + ext, device=q.device)[:, None]
        k_pos = torch.arange(seq, device=q.device)[None, :]
        mask = k_pos <= q_pos  # [E, S]
        o = torch.nn.functional.scaled_dot_product_attention(
            qi.transpose(0, 1),  # [H, E, D]
            k.transpose(0, 1).repeat_interleave(group, dim=0),  # [H, S, D]
            v.transpose(0, 1).repeat_interleave(group, dim=0),
            attn_mask=mask,
            scale=scaling,
        )
        out[start : start + ext] = o.transpose(0, 1)
        start += ext
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
) -> torch.Tensor:
    """q: [B, H, D] (one token per request) -> [B, H, D], padded-batch attention."""
    kv_idx, valid = _decode_gather_index(meta)
    bsz, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    group = num_heads // num_kv_heads
    k = k_buffer[kv_idx].to(q.dtype)  # [B, L, Hkv, D]
    v = v_buffer[kv_idx].to(q.dtype)
    qg = q.view(bsz, num_kv_heads, group, head_dim)  # [B, Hkv, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg, k) * scaling  # [B, Hkv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v)
    return out.reshape(bsz, num_heads, head_dim)


def _decode_gather_index(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    cached = meta.cache.get("decode_gather")
    if cached is None:
        max_len = meta.max_seq_len
        kv_idx = meta.req_to_token[meta.req_pool_indices, :max_len].long()  # [B, L]
        pos = torch.arange(max_len, device=kv_idx.device)[None, :]
        valid = pos < meta.seq_lens[:, None].to(kv_idx.device)
        kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
        cached = meta.cache["decode_gather"] = (kv_idx, valid)
    return cached


class TorchAttnBackend(AttentionBackend):
    """The CPU backend (and a portable fallback anywhere torch runs)."""

    use_cpu_kernel = False  # set by the model runner: decode through attn_cpu.cpp when built
    use_cpu_extend_kernel = False  # ... and extend through extend_attn_cpu.cpp
    # forward(q, None, None, ...): the model already wrote this layer's new K/V into the pool
    # at meta.out_cache_loc (the fused rotary + KV store of plait.kernels.fused_ops)
    accepts_stored_kv = True

    def prepare(self, meta: AttentionMetadata) -> None:
        # once for every layer: shared-prefix groups (decode, and an extend attended as decode
        # rows: plan_rows), slots and masks (extend)
        if plan_rows(meta) is None:
            plan_extend(meta)

    def decode_kernel_operands(self, kv_pool: KVPool, meta: AttentionMetadata):
        """(kernel, slots, lens, scaling, groups) when this forward's attention can go
        straight to attn_cpu.cpp (a decode batch or an extend taken as decode rows by
        plan_rows, fp32 contiguous pools, the kernel built):
        out, lse = kernel.decode_attention(q [B, Hkv, G, D], k_buffer[layer], v_buffer[layer],
        slots, lens, scaling) over each request's KV after its shared prefix, then for each
        (members, prefix slots [1, P], prefix lens [1]) in groups the members' rows against the
        prefix, merged in (decode_attention_cpu's steps). Else None. (An fp32 forward's pool:
        fp32, or bf16 with --kv-cache-dtype bfloat16.)"""
        if not (
            self.use_cpu_kernel
            and self.head_dim % 8 == 0
            and kv_pool.k_buffer[0].dtype in KERNEL_POOL_DTYPES
            and kv_pool.k_buffer[0].is_contiguous()
            and kv_pool.v_buffer[0].is_contiguous()
        ):
            return None
        kernel = decode_kernel()
        plan = plan_rows(meta) if kernel is not None else None
        if plan is None:
            return None
        groups = [(g.members, *g.kernel_slots) for g in plan.groups]
        return kernel, plan.suffix_slots, plan.suffix_lens, self.scaling, groups

    def layer_attention(self, kv_pool: KVPool, meta: AttentionMetadata):
        """attend(q [T, H, D], layer_id) -> [T, H * D] for a forward whose K/V are stored
        already: the model's lean CPU loop calls it once a layer. A decode batch without
        shared prefixes goes straight to attn_cpu.cpp (the plan, checks and views of forward
        are done once here, not 30 times); anything else through forward."""
        direct = self.decode_kernel_operands(kv_pool, meta)
        if direct is not None and not direct[4]:  # (shared prefixes: through forward)
            kernel, slots, lens, scaling, _ = direct
            kb, vb = kv_pool.k_buffer, kv_pool.v_buffer
            num_kv, group = self.num_kv_heads, self.num_heads // self.num_kv_heads

            def attend_decode(q: torch.Tensor, layer_id: int) -> torch.Tensor:
                qg = q.view(q.shape[0], num_kv, group, q.shape[2])
                out, _ = kernel.decode_attention(qg, kb[layer_id], vb[layer_id], slots, lens,
                                                 scaling)
                return out.view(q.shape[0], -1)

            return attend_decode

        def attend(q: torch.Tensor, layer_id: int) -> torch.Tensor:
            return self.forward(q, None, None, layer_id, kv_pool, meta).reshape(q.shape[0], -1)

        return attend

    def shared_kv_tokens(self, meta: AttentionMetadata) -> int:
        plan = meta.cache.get("cpu_decode_plan")
        return plan.shared_tokens if plan is not None else 0

    def forward(self, q, k, v, layer_id: int, kv_pool: KVPool, meta: AttentionMetadata):
        k_buffer, v_buffer = kv_pool.k_buffer[layer_id], kv_pool.v_buffer[layer_id]
        if k is not None:  # else already stored (accepts_stored_kv)
            loc = meta.cache.get("out_cache_loc64")
            if loc is None:  # index_copy_ wants int64; converted once for every layer
                loc = meta.cache["out_cache_loc64"] = meta.out_cache_loc.long()
            # index_copy_ rather than `buffer[loc] = k` (advanced indexing): half the overhead
            k_buffer.index_copy_(0, loc, k.to(k_buffer.dtype))
            v_buffer.index_copy_(0, loc, v.to(v_buffer.dtype))
        if plan_rows(meta) is not None:
            return decode_attention_cpu(
                q, k_buffer, v_buffer, meta, self.scaling, use_kernel=self.use_cpu_kernel
            )
        return extend_attention_cpu(
            q, k_buffer, v_buffer, meta, self.scaling, use_kernel=self.use_cpu_extend_kernel
        )
