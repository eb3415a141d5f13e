"""flash-attn backend: flash-attn's varlen kernel over K/V gathered from the token-granular pool.

Why not flash-attn's paged path: `flash_attn_with_kvcache(..., block_table=...)` reads the
cache in pages of `page_block_size` tokens, which flash-attn 2 requires to be a multiple of
256, while KVPool hands out single-token slots in any order (page size 1). So each layer
gathers its requests' K/V rows into packed [total_kv, kv_heads, head_dim] tensors (one
index_select each, indices built once per forward in prepare) and calls
`flash_attn_varlen_func(causal=True)`. Its causal mask is aligned to the bottom right of each
request's (new tokens x KV) matrix (flash-attn >= 2.1), which is exactly "new token r sees KV
positions 0..prefix_len + r"; a decode step is the case of one new token per request.
The gather costs an extra read+write of the KV; the Triton backend reads the pool in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.kernels.base import AttentionBackend, AttentionMetadata
from plait.kernels.torch_backend import store_kv_reference

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool

_MIN_VERSION = (2, 1)  # bottom-right aligned causal mask when seqlen_q != seqlen_k


def _import_varlen():
    try:
        import flash_attn
    except ImportError as e:
        raise ImportError(
            "attention backend 'flashattn' needs the flash-attn package (CUDA only): "
            "`pip install flash-attn --no-build-isolation`, or choose the 'triton' or 'torch' "
            f"attention backend ({e})"
        ) from e
    version = tuple(int(x) for x in flash_attn.__version__.split(".")[:2] if x.isdigit())
    if version < _MIN_VERSION:
        raise ImportError(
            f"attention backend 'flashattn' needs flash-attn >= 2.1 (its causal mask for "
            f"prefix + new tokens), found {flash_attn.__version__}"
        )
    return flash_attn.flash_attn_varlen_func


@dataclass(frozen=True)
class _VarlenPlan:
    kv_indices: torch.Tensor  # [total_kv] int64: pool slots of every request's KV, packed
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int


def varlen_plan(meta: AttentionMetadata) -> _VarlenPlan:
    """Packed KV indices and cumulative lengths, built without a device sync."""
    device = meta.req_to_token.device
    seq_lens, ext_lens = meta.seq_lens_cpu, meta.extend_lens_cpu
    cu_k = [0]
    cu_q = [0]
    for s, e in zip(seq_lens, ext_lens):
        cu_k.append(cu_k[-1] + s)
        cu_q.append(cu_q[-1] + e)
    total_kv = cu_k[-1]
    cu_seqlens_k = torch.tensor(cu_k, dtype=torch.int32, device=device)
    seq_lens_dev = meta.seq_lens.to(torch.int64)
    # row of every packed KV position in req_to_token, and its column (position in its request)
    rows = torch.repeat_interleave(meta.req_pool_indices, seq_lens_dev, output_size=total_kv)
    firsts = torch.repeat_interleave(
        cu_seqlens_k[:-1].to(torch.int64), seq_lens_dev, output_size=total_kv
    )
    cols = torch.arange(total_kv, device=device) - firsts
    return _VarlenPlan(
        kv_indices=meta.req_to_token[rows, cols].to(torch.int64),
        cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max(ext_lens, default=0),
        max_seqlen_k=max(seq_lens, default=0),
    )


class FlashAttnBackend(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling)
        self._varlen = _import_varlen()

    def prepare(self, meta: AttentionMetadata) -> None:
        self._plan(meta)

    def _plan(self, meta: AttentionMetadata) -> _VarlenPlan:
        plan = meta.cache.get("flashattn_varlen")
        if plan is None:
            plan = meta.cache["flashattn_varlen"] = varlen_plan(meta)
        return plan

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        layer_id: int,
        kv_pool: KVPool,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_buffer, v_buffer = kv_pool.k_buffer[layer_id], kv_pool.v_buffer[layer_id]
        store_kv_reference(k_buffer, v_buffer, meta.out_cache_loc, k, v)
        plan = self._plan(meta)
        if q.shape[0] == 0:
            return torch.empty_like(q)
        k_packed = k_buffer.index_select(0, plan.kv_indices)  # [total_kv, kv_heads, head_dim]
        v_packed = v_buffer.index_select(0, plan.kv_indices)
        return self._varlen(
            q,
            k_packed,
            v_packed,
            plan.cu_seqlens_q,
            plan.cu_seqlens_k,
            plan.max_seqlen_q,
            plan.max_seqlen_k,
            softmax_scale=self.scaling,
            causal=True,
        )
