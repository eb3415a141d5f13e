"""Transparent huge pages for the weight panels and the KV pool (plait/runtime/hugepages.py):
the memory is advised (the kernel's own smaps says THPeligible), the values are unchanged,
and the flag turns it off."""

from __future__ import annotations

import mmap

import pytest
import torch

from plait.args import ServerArgs
from plait.kernels import woq
from plait.radix_cache.kv_pool import KVPool
from plait.runtime import hugepages

pytestmark = pytest.mark.skipif(not hugepages.thp_available(),
                                reason="needs Linux with transparent huge pages (madvise/always)")


def _thp_eligible(t: torch.Tensor) -> bool:
    """Whether the mapping holding t's first byte is eligible for huge pages (/proc smaps)."""
    addr = t.data_ptr()
    eligible = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("THPeligible:"):
                eligible = line.split()[1] == "1"
                break
    assert eligible is not None, "no smaps entry for the tensor"
    return eligible


def _unadvised_is_ineligible() -> bool:
    """Whether this kernel reads a fresh, never-advised anonymous mapping as not eligible: the
    not-advised checks need that. With THP `always` (or a multi-size THP size set to `always`,
    Linux 6.8+) every anonymous mapping is eligible and smaps cannot tell advised memory apart."""
    m = mmap.mmap(-1, 2 * hugepages.HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    t = torch.frombuffer(m, dtype=torch.uint8)
    t[::4096] = 1  # touch it so the mapping has pages
    eligible = _thp_eligible(t)
    del t
    return not eligible


MADVISE_MODE = hugepages.thp_available() and _unadvised_is_ineligible()


def test_huge_zeros_is_zero_aligned_and_advised():
    t = hugepages.huge_zeros(5 * hugepages.HUGE_PAGE + 100)
    assert t is not None and t.dtype == torch.uint8 and t.numel() == 5 * hugepages.HUGE_PAGE + 100
    assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    assert _thp_eligible(t)  # (that a never-advised mapping reads otherwise: MADVISE_MODE)


def test_move_buffers_keeps_values_and_rebinds_shared_buffers():
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(woq.PanelLinear(torch.randn(96, 64, generator=gen)),
                                woq.Int4Linear(torch.randn(64, 96, generator=gen)))
    model.register_buffer("small", torch.ones(8))  # under the threshold: stays
    shared = torch.randn(40000, generator=gen)
    model[0].register_buffer("shared", shared)
    model[1].register_buffer("shared", shared)
    x = torch.randn(3, 64, generator=gen)
    before = model(x)
    small = model.small
    moved = hugepages.move_buffers_to_huge_pages(model, min_bytes=1024)
    assert moved > 0
    assert model.small is small
    assert model[0].shared is model[1].shared and torch.equal(model[0].shared, shared)
    for t in (model[0].panels, model[1].qweight, model[0].shared):
        assert _thp_eligible(t)
    torch.testing.assert_close(model(x), before, atol=0, rtol=0)


def test_kv_pool_buffers_on_huge_pages():
    pool = KVPool(4096, 2, 3, 64, torch.float32, huge_pages=True)
    assert all(_thp_eligible(b) and int(b.count_nonzero()) == 0
               for b in pool.k_buffer + pool.v_buffer)
    if MADVISE_MODE:
        assert not _thp_eligible(KVPool(4096, 1, 3, 64, torch.float32).k_buffer[0])


@pytest.mark.parametrize("disable", [False, True])
def test_runner_puts_panels_and_pool_on_huge_pages_unless_disabled(checkpoint, disable,
                                                                   monkeypatch):
    """The runner moves the weight panels and allocates the KV pool on advised memory, and
    with --disable-huge-pages does neither. The off case is checked on the mechanism (neither
    function is called) rather than on smaps: whether memory plait never advised reads as
    eligible depends on what else the process did (a full-suite run on this project's VM once
    read plait-tiny's unadvised panels as eligible, alone they read not eligible)."""
    from plait.radix_cache import kv_pool
    from plait.runtime import model_runner
    from plait.runtime.model_runner import ModelRunner

    calls = {"move": 0, "zeros": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(model_runner, "move_buffers_to_huge_pages",
                        counted("move", model_runner.move_buffers_to_huge_pages))
    monkeypatch.setattr(kv_pool, "huge_zeros", counted("zeros", kv_pool.huge_zeros))
    path = checkpoint("plait-tiny")
    runner = ModelRunner(ServerArgs(model_path=path, max_total_tokens=256,
                                    disable_huge_pages=disable), path)
    panels = [m.panels for m in runner.model.modules() if isinstance(m, woq.PanelLinear)]
    assert panels
    if disable:
        assert calls == {"move": 0, "zeros": 0}
        return
    assert calls["move"] == 1 and calls["zeros"] > 0
    assert all(_thp_eligible(p) for p in panels)
    assert _thp_eligible(runner.kv_pool.k_buffer[0])
