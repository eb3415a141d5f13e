"""Small helpers for writing one row of a token bitmask (see base.py for the layout)."""

from __future__ import annotations

import torch


def bit(j: int) -> int:
    """Bit j of an int32 word (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j


def copy_row(bitmask: torch.Tensor, row: int, words: torch.Tensor) -> None:
    """bitmask[row] = words, zero-padded or cut to the bitmask's width (and device)."""
    width = min(bitmask.shape[1], words.shape[0])
    bitmask[row].zero_()
    bitmask[row, :width] = words[:width].to(bitmask.device)


def words_for(token_ids, num_words: int) -> torch.Tensor:
    """An int32 row [num_words] with exactly the given token ids allowed."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    ids = ids[ids < num_words * 32]
    bits = torch.zeros(num_words * 32, dtype=torch.bool)
    bits[ids] = True
    return pack_bits(bits)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [W * 32] -> int32 [W], bit j of word w = bits[32 * w + j]."""
    weights = torch.tensor([bit(j) for j in range(32)], dtype=torch.int64)
    packed = (bits.view(-1, 32).to(torch.int64) * weights).sum(dim=1)  # [W], in int32 range
    return packed.to(torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_ids) -> None:
    copy_row(bitmask, row, words_for(token_ids, bitmask.shape[1]))
