"""Random attention batches over a poisoned KV pool, for kernel tests and benchmarks.

Every pool slot and req->token entry that no request owns holds NaN (slot 0, the padding
target, holds zeros as in KVPool), so a kernel that reads outside its request's KV, or leaves
an output element unwritten in a NaN-filled `out`, produces NaN and fails the comparison.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.kernels.base import AttentionMetadata, ForwardMode


@dataclass
class AttentionBatch:
    q: torch.Tensor  # [T, num_heads, head_dim]
    k_new: torch.Tensor  # [T, num_kv_heads, head_dim], not yet in the pool
    v_new: torch.Tensor
    k_buffer: torch.Tensor  # [num_slots, num_kv_heads, head_dim], prefixes filled
    v_buffer: torch.Tensor
    meta: AttentionMetadata
    poison_slot: int  # a slot no request owns (NaN); unused req_to_token entries point here

    @property
    def kv_bytes_read(self) -> int:
        """Bytes of K and V that attention over every request's full KV reads."""
        row = self.k_buffer.shape[1] * self.k_buffer.shape[2] * self.k_buffer.element_size()
        return 2 * row * sum(self.meta.seq_lens_cpu)


def make_metadata(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    out_cache_loc: torch.Tensor,
) -> AttentionMetadata:
    device = req_to_token.device
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]

    def i32(xs: list[int]) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.int32, device=device)

    return AttentionMetadata(
        mode=mode,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices.to(device=device, dtype=torch.int64),
        seq_lens=i32(seq_lens),
        prefix_lens=i32(prefix_lens),
        extend_lens=i32(extend_lens),
        extend_start_loc=i32(starts),
        out_cache_loc=out_cache_loc.to(device=device, dtype=torch.int64),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens),
    )


def random_attention_batch(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    mode: ForwardMode = ForwardMode.EXTEND,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_slots: int = 7,
    spare_reqs: int = 2,
) -> AttentionBatch:
    """A batch whose requests own randomly permuted pool slots and req_to_token rows.

    Request i has prefix_lens[i] cached tokens (random K/V in the pool) and extend_lens[i]
    new tokens (q/k_new/v_new; their slots are in meta.out_cache_loc, still NaN in the pool).
    """
    if mode is ForwardMode.DECODE and any(e != 1 for e in extend_lens):
        raise ValueError("a decode batch has exactly one new token per request")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    batch = len(prefix_lens)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    num_tokens = sum(extend_lens)
    used = sum(seq_lens)
    num_slots = used + spare_slots + 2  # + slot 0 and the poison slot

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    slots = torch.randperm(num_slots - 2, generator=gen) + 2  # slot 1 is the poison slot
    poison_slot = 1
    k_buffer = torch.full((num_slots, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_buffer = torch.full_like(k_buffer, float("nan"))
    k_buffer[0] = 0
    v_buffer[0] = 0
    k_buffer, v_buffer = k_buffer.to(device), v_buffer.to(device)

    max_reqs = batch + spare_reqs
    max_context = max(seq_lens, default=0) + 3
    req_to_token = torch.full((max_reqs, max_context), poison_slot, dtype=torch.int32)
    req_rows = torch.randperm(max_reqs, generator=gen)[:batch]
    new_slots = []
    start = 0
    for i in range(batch):
        own = slots[start : start + seq_lens[i]]
        start += seq_lens[i]
        req_to_token[req_rows[i], : seq_lens[i]] = own.to(torch.int32)
        cached = own[: prefix_lens[i]].to(device)
        k_buffer[cached] = randn(prefix_lens[i], num_kv_heads, head_dim)
        v_buffer[cached] = randn(prefix_lens[i], num_kv_heads, head_dim)
        new_slots.append(own[prefix_lens[i] :])
    out_cache_loc = torch.cat(new_slots) if new_slots else torch.zeros(0, dtype=torch.int64)

    meta = make_metadata(
        mode, prefix_lens, extend_lens, req_to_token.to(device), req_rows, out_cache_loc
    )
    return AttentionBatch(
        q=randn(num_tokens, num_heads, head_dim),
        k_new=randn(num_tokens, num_kv_heads, head_dim),
        v_new=randn(num_tokens, num_kv_heads, head_dim),
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        meta=meta,
        poison_slot=poison_slot,
    )
