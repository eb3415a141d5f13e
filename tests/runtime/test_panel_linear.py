"""plait's fp32 CPU linear (woq.PanelLinear, the default for float32 models on an AVX2 CPU):
the kernels against torch's linear on the same weight, every build this CPU runs, the torch
fallback that serves until the kernels are loaded, and the panel layout's round trip."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import woq

pytestmark = pytest.mark.skipif(not woq.available_isas(), reason="the kernels need AVX2 + FMA")

# row counts: one tile, its tails, several tiles of a block (even split), blocks of 64; the
# AVX-512 panel pairs in input blocks (4..127 rows) and over all inputs (128 on)
ROWS = (0, 1, 2, 3, 4, 5, 7, 9, 12, 13, 25, 32, 33, 64, 65, 96, 127, 128, 131, 200)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The FMA kernels (the AMX path for many rows, which a model runner in this process may
    have turned on, is tested in test_panel_linear_amx.py)."""
    rows = woq._amx_rows
    woq.set_fp32_amx_rows(0)
    assert woq.start_linear_kernels(block=True)
    yield
    woq.set_fp32_amx_rows(rows)


# (inputs: whole blocks of 96 of the pairs' input blocks, a partial last block, one short block;
# outputs: pairs of panels, a last odd panel, a partial panel)
@pytest.mark.parametrize("shape", [(960, 576), (13, 64), (7, 96), (200, 1536), (45, 37),
                                   (100, 250), (70, 200)])
def test_panel_linear_equals_torch_linear(shape):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(*shape, generator=gen), torch.randn(shape[0], generator=gen)
    m = woq.PanelLinear(weight, bias)
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, weight, bias),
                                   atol=1e-4, rtol=1e-4)
    x = torch.randn(2, 3, shape[1], generator=gen)  # leading dims are kept
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)
    x = torch.randn(6, 2 * shape[1], generator=gen)[:, ::2]  # a strided view
    torch.testing.assert_close(m(x), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)


def test_the_single_tile_stream_prefetch_is_a_setting_that_changes_no_result():
    """A single row tile (1-3 rows) prefetches its weight stream in software on Intel CPUs and
    with AVX2, not in the AVX-512 build on AMD (woq_cpu.cpp's g_single_tile_stream: there the
    hardware prefetchers alone stream faster); set_fp32_stream_prefetch switches it."""
    from plait.kernels.cpp_build import prefetch_flags

    ops = woq.linear_ops()
    default = ops.isa != "avx512" or bool(prefetch_flags())
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(960, 576, generator=gen)
    m = woq.PanelLinear(weight)
    xs = [torch.randn(rows, 576, generator=gen) for rows in (1, 2, 3)]
    try:
        assert ops.set_fp32_stream_prefetch(not default) == default
        other = [m(x) for x in xs]
        assert ops.set_fp32_stream_prefetch(default) == (not default)
        for x, y in zip(xs, other):
            assert torch.equal(m(x), y)
            torch.testing.assert_close(y, torch.nn.functional.linear(x, weight),
                                       atol=1e-4, rtol=1e-4)
    finally:
        ops.set_fp32_stream_prefetch(default)


@pytest.mark.parametrize("cls", ["fp32", "int8", "int4"])
def test_results_do_not_depend_on_the_threads(cls):
    """Threads claim runs of panels as they go (woq_cpu.cpp parallel_panels), so which thread
    computes a panel varies from call to call; each panel is computed whole by one thread, so
    the bits may not."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(3072, 576, generator=gen)
    m = {"fp32": woq.PanelLinear, "int8": woq.Int8Linear, "int4": woq.Int4Linear}[cls](weight)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 4, 32):
            x = torch.randn(rows, 576, generator=gen)
            torch.set_num_threads(1)
            one = m(x)
            for n in (2, 3, 4):
                torch.set_num_threads(n)
                for _ in range(3):
                    assert torch.equal(m(x), one), (rows, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif("avx512" not in woq.available_isas(), reason="the AVX-512 build's tiles")
@pytest.mark.parametrize("cls, shape", [
    ("fp32", (960, 576)), ("fp32", (100, 250)), ("fp32", (70, 200)),
    ("int8", (960, 576)), ("int8", (100, 250)), ("int4", (960, 576)), ("int4", (70, 224)),
])
def test_a_rows_result_does_not_depend_on_the_batch(cls, shape):
    """From 3 rows on, every tile of the AVX-512 build (fp32, and int8 / int4 dequantized in
    registers or into a block buffer) sums each output in one chain of FMAs over the inputs in
    order (one-panel tiles, pairs in input blocks, pairs over all inputs): a row's result is
    the same bits whatever the batch around it. (One and two rows take two chains over
    alternate inputs, or int4's folded scale: more FMAs in flight for a latency-bound tile.)"""
    gen = torch.Generator().manual_seed(5)
    make = {"fp32": woq.PanelLinear, "int8": woq.Int8Linear, "int4": woq.Int4Linear}[cls]
    m = make(torch.randn(*shape, generator=gen))
    x = torch.randn(300, shape[1], generator=gen)
    first = m(x[:3])
    for rows in (*range(4, 40), 63, 64, 65, 96, 127, 128, 129, 200, 300):
        assert torch.equal(m(x[:rows])[:3], first), rows


@pytest.mark.parametrize("width", [32, 24])
@pytest.mark.parametrize("isa", woq.available_isas())
def test_every_isa_build_equals_torch_linear(isa, width):
    """Both panel widths on every build: 24-wide tiles of 1-4 rows (even split: 5 -> 3 + 2,
    6 -> 3 + 3, 7 -> 4 + 3), their one- and two-tile prefetch paths, a partial last panel."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 96, generator=gen)
    panels = woq.to_panels_fp32(weight, width)
    ops = woq.load_kernels(isa)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 31, 32, 40, 70):
        x = torch.randn(rows, 96, generator=gen)
        torch.testing.assert_close(ops.fp32_linear(x, panels, 200), x @ weight.t(),
                                   atol=1e-4, rtol=1e-4)


def test_torch_fallback_before_the_kernels_load(monkeypatch):
    gen = torch.Generator().manual_seed(4)
    weight, bias = torch.randn(70, 64, generator=gen), torch.randn(70, generator=gen)
    m = woq.PanelLinear(weight, bias)
    x = torch.randn(9, 64, generator=gen)
    with_kernels = m(x)
    monkeypatch.setattr(woq, "_linear_ops", None)
    assert m(x[:0]).shape == (0, 70)
    fallback = m(x)
    assert fallback.shape == (9, 70) and fallback.is_contiguous()
    torch.testing.assert_close(fallback, torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fallback, with_kernels, atol=1e-4, rtol=1e-4)


def test_panel_layout_round_trip_and_padding():
    weight = torch.randn(45, 8)
    panels = woq.to_panels_fp32(weight, 32)
    assert panels.shape == (2, 8, 32)
    assert panels[0, 3, 5] == weight[5, 3] and panels[1, 2, 12] == weight[44, 2]
    assert bool((panels[1, :, 13:] == 0).all())  # the padding features
    torch.testing.assert_close(woq.from_panels_fp32(panels, 45), weight, atol=0, rtol=0)
    panels = woq.to_panels_fp32(weight, 24)
    assert panels.shape == (2, 8, 24)
    assert panels[0, 3, 5] == weight[5, 3] and panels[1, 2, 20] == weight[44, 2]
    assert bool((panels[1, :, 21:] == 0).all())
    torch.testing.assert_close(woq.from_panels_fp32(panels, 45), weight, atol=0, rtol=0)
    m = woq.PanelLinear(weight)
    assert m.panels.shape[2] == woq.fp32_panel_width()
    assert m.weight_bytes == m.panels.numel() * 4
    with pytest.raises(ValueError, match="24"):
        woq.to_panels_fp32(weight, 16)


def test_panel_width_follows_the_best_build(monkeypatch):
    monkeypatch.setattr(woq, "available_isas", lambda: ["avx2"])
    assert woq.fp32_panel_width() == 24
    monkeypatch.setattr(woq, "available_isas", lambda: ["avx512", "avx2"])
    assert woq.fp32_panel_width() == 32
    monkeypatch.setattr(woq, "available_isas", lambda: [])
    assert woq.fp32_panel_width() == 32


@pytest.mark.parametrize("width", [32, 24])
def test_kernel_rejects_mismatched_shapes(width):
    ops = woq.load_kernels()
    panels = woq.to_panels_fp32(torch.randn(40, 16), width)
    with pytest.raises(RuntimeError, match="features"):
        ops.fp32_linear(torch.randn(3, 17), panels, 40)
    with pytest.raises(RuntimeError, match="panels"):
        ops.fp32_linear(torch.randn(3, 16), panels, 70)


@pytest.mark.skipif("avx512" not in woq.available_isas(), reason="fp32_linear_silu: AVX-512")
@pytest.mark.parametrize("shape", [(3072, 576), (128, 64), (192, 100)])
def test_gate_up_with_silu_in_the_epilogue_equals_the_two_passes(fused_ops, shape):
    """GateUpPanelLinear: silu(gate) * up from the kernel's epilogue, bit for bit the plain
    product followed by fused_cpu.cpp's silu_mul (torch's), at every tile kind's row counts;
    its plain forward and dequantized weight in the gate; up order; the torch fallback."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(*shape, generator=gen) * 0.1
    plain = woq.PanelLinear(weight)
    assert woq.GateUpPanelLinear.applies(plain)
    fused = woq.GateUpPanelLinear.from_panel_linear(plain)
    assert torch.equal(fused.dequantized(), weight)
    name, _, _ = woq.kernel_entry(fused.kernel_call())
    assert name == "fp32_linear_silu"
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen) * 3
        reference = fused_ops.silu_mul(plain(x))
        assert torch.equal(fused.silu_product(x, fused_ops), reference), rows
        assert torch.equal(fused(x), plain(x)), rows
    assert not woq.GateUpPanelLinear.applies(woq.PanelLinear(torch.randn(96, 64)))  # I = 48
    assert not woq.GateUpPanelLinear.applies(woq.PanelLinear(weight, torch.zeros(shape[0])))


@pytest.mark.skipif("avx512" not in woq.available_isas(), reason="fp32_linear_silu: AVX-512")
def test_gate_up_torch_fallback_before_the_kernels_load(fused_ops, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(128, 64, generator=gen)
    fused = woq.GateUpPanelLinear(weight)
    x = torch.randn(5, 64, generator=gen)
    expected = fused_ops.silu_mul(woq.PanelLinear(weight)(x))
    monkeypatch.setattr(woq, "_linear_ops", None)
    assert fused.kernel_call() is None
    torch.testing.assert_close(fused(x), torch.nn.functional.linear(x, weight))
    torch.testing.assert_close(fused.silu_product(x, fused_ops), expected)
