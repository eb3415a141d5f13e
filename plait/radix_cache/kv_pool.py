"""KV memory: per-layer K/V tensors with a token-granular free-slot allocator, and the
req->token table that maps (request slot, position) to a KV slot."""

from __future__ import annotations

import math

import numpy as np
import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled buffer. On the CPU through calloc (numpy.zeros), whose fresh pages are zero
    without being written: torch.zeros memsets them, which for SmolLM2's default 5.6 GB pool cost
    2.2 s of every start and made all of it resident for a one-request `plait generate`. Zeros
    rather than empty: kernels may read slots never written (the Triton attention kernel's
    masked blocks), and garbage there can be NaN."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVPool:
    """Per-layer K/V buffers of `size` token slots. Slot 0 is reserved as a padding target
    (never handed out), so padded gathers read harmless memory."""

    def __init__(
        self,
        size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if size < 2:
            raise ValueError(f"KV pool size must be >= 2 tokens, got {size}")
        self.size = size  # usable slots: 1..size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (size + 1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
        self.k_buffer = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self.v_buffer = [_zeros(shape, dtype, self.device) for _ in range(num_layers)]
        self._free = torch.arange(1, size + 1, dtype=torch.int64)  # CPU free list
        self._num_free = size

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def free_size(self) -> int:
        return self._num_free

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots (int64, CPU), or None if fewer than n are free."""
        if n > self._num_free:
            return None
        start = self._num_free - n
        out = self._free[start : self._num_free].clone()
        self._num_free = start
        return out

    def free(self, slots: torch.Tensor) -> None:
        n = int(slots.numel())
        if n == 0:
            return
        assert self._num_free + n <= self.size, "double free in KVPool"
        self._free[self._num_free : self._num_free + n] = slots.to(torch.int64).cpu()
        self._num_free += n

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._num_free = self.size


class ReqToTokenPool:
    """req_to_token[req_slot, pos] = KV slot of token `pos` of the request in that slot."""

    def __init__(self, max_reqs: int, max_context: int, device: torch.device | str = "cpu") -> None:
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
        self._free = list(range(max_reqs - 1, -1, -1))

    @property
    def free_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, idx: int) -> None:
        self._free.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[idx, start : start + slots.numel()] = slots.to(self.req_to_token.dtype)

    def read(self, idx: int, end: int, start: int = 0) -> torch.Tensor:
        return self.req_to_token[idx, start:end].to(torch.int64)
