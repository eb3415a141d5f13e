"""Triton attention backend: store K/V, then extend or flash-decoding attention (GPU; runs on CPU
under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.kernels.base import AttentionBackend, AttentionMetadata, ForwardMode
from plait.kernels.triton_ops import (
    decode_attention,
    decode_workspace,
    default_num_kv_splits,
    extend_attention,
    store_kv,
)

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool


@dataclass(frozen=True)
class _DecodePlan:
    """What every layer of one decode forward shares: the split count and stage-1 buffers."""

    num_kv_splits: int
    workspace: tuple[torch.Tensor, torch.Tensor]  # ([B, H, S, D], [B, H, S]) fp32


class TritonAttnBackend(AttentionBackend):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_splits: int | None = None,  # None: chosen per batch from its shape
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scaling)
        if num_kv_splits is not None and num_kv_splits < 1:
            raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        self._plan_key = ("triton_decode", num_heads, num_kv_heads, head_dim, num_kv_splits)

    def prepare(self, meta: AttentionMetadata) -> None:
        if meta.mode is ForwardMode.DECODE:
            self._decode_plan(meta)

    def _decode_plan(self, meta: AttentionMetadata) -> _DecodePlan:
        plan = meta.cache.get(self._plan_key)
        if plan is None:
            device = meta.req_to_token.device
            splits = self.num_kv_splits or default_num_kv_splits(
                meta.batch_size, self.num_heads, self.num_kv_heads, meta.max_seq_len, device
            )
            workspace = decode_workspace(
                meta.batch_size, self.num_heads, self.head_dim, splits, device
            )
            plan = meta.cache[self._plan_key] = _DecodePlan(splits, workspace)
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
        store_kv(k_buffer, v_buffer, meta.out_cache_loc, k, v)
        if meta.mode is ForwardMode.DECODE:
            plan = self._decode_plan(meta)
            return decode_attention(
                q,
                k_buffer,
                v_buffer,
                meta,
                self.scaling,
                plan.num_kv_splits,
                workspace=plan.workspace,
            )
        return extend_attention(q, k_buffer, v_buffer, meta, self.scaling)
