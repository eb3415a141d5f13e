"""The KV pool's prefaulter: pages of the never-used slots ahead of the allocator are faulted
in by a background thread (Linux MADV_POPULATE_WRITE) without changing any slot's contents."""

from __future__ import annotations

import os

import pytest
import torch

from plait.radix_cache.kv_pool import KVPool

pytestmark = pytest.mark.skipif(os.uname().sysname != "Linux", reason="madvise populate")


def resident_pages(t: torch.Tensor, first_slot: int, last_slot: int) -> int:
    """Pages of t's slots [first, last) resident in memory (/proc/self/pagemap bit 63)."""
    row = t[0].numel() * t.element_size()
    start = (t.data_ptr() + first_slot * row) // 4096
    end = (t.data_ptr() + last_slot * row - 1) // 4096 + 1
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        data = f.read((end - start) * 8)
    return sum(int.from_bytes(data[i : i + 8], "little") >> 63 for i in range(0, len(data), 8))


def test_prefault_keeps_a_window_ahead_of_the_allocator_and_keeps_contents():
    size, heads, dim = 40_000, 2, 64  # 512 B rows: 8 slots a page
    per_token = KVPool.bytes_per_token(2, heads, dim, torch.float32)
    pool = KVPool(size, 2, heads, dim, torch.float32, prefault_bytes=2048 * per_token)
    pf = pool.prefaulter
    assert pf is not None
    assert pf.wait() and not pf.failed
    k = pool.k_buffer[1]
    # the top 2,048 slots (the allocator's first) are resident; nothing below was asked for
    # (the bottom's residency depends on where the allocator took the buffer from)
    assert pf.done_low == size - 2048 + 1
    assert resident_pages(k, size - 2000, size) == pytest.approx(2000 / 8, abs=2)
    # written slots keep their values while the window moves down past them
    first = pool.alloc(1500)
    k[first] = 7.0
    more = pool.alloc(3000)
    assert pf.wait()
    assert pf.done_low <= size - 4500 - 2048 + 1
    assert bool((k[first] == 7.0).all()) and bool((k[more] == 0).all())
    assert resident_pages(k, size - 6500, size - 4600) == pytest.approx(1900 / 8, abs=2)


def test_no_prefault_unless_asked():
    assert KVPool(100, 1, 1, 8, torch.float32).prefaulter is None
