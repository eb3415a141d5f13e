"""fp32 linears on the CPU's AMX tiles (woq_cpu.cpp's "fp32 on AMX", `--cpu-amx-linear-rows`):
each fp32 value split exactly into three bf16 pieces and multiplied as six tile products.
Checked against float64 (no worse than the FMA kernels), exactly where every piece matters
(one-hot operands), bit for bit against itself across batches and threads, and in the fused
silu epilogue."""

from __future__ import annotations

import pytest
import torch

from plait.kernels import woq
from tests.runtime import test_parity

llama_ref = test_parity.llama_ref  # the fixture: 16 prompts, transformers' greedy outputs

pytestmark = pytest.mark.skipif(not woq.amx_capable(), reason="needs AMX-BF16 and AVX512-BF16")

# one row tile, two, their tails, a chunk of 256 rows and the next one's first rows
ROWS = (1, 2, 15, 16, 17, 31, 32, 33, 48, 64, 100, 256, 257, 300)
SHAPES = [(960, 576), (3072, 576), (576, 1536), (45, 37), (70, 200), (40, 64)]


@pytest.fixture(scope="module")
def ops():
    module = woq.load_kernels("avx512")
    yield module
    woq.set_fp32_amx_rows(0)


def _run(ops, x, panels, n, amx_rows):
    assert woq.set_fp32_amx_rows(amx_rows) == amx_rows
    return ops.fp32_linear(x, panels, n)


@pytest.mark.parametrize("shape", SHAPES)
def test_amx_is_as_accurate_as_the_fma_kernels(ops, shape):
    """Root-mean-square error against float64 over every row count: smaller than the FMA
    kernels' (about half of it at SmolLM2's shapes; equal would mean the AMX path never ran)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(*shape, generator=gen) * 0.05
    panels = woq.to_panels_fp32(weight, woq.PANEL)
    squares = {"amx": 0.0, "fma": 0.0}
    for rows in ROWS:
        x = torch.randn(rows, shape[1], generator=gen)
        exact = x.double() @ weight.double().t()
        amx = _run(ops, x, panels, shape[0], 1)
        fma = _run(ops, x, panels, shape[0], 0)
        squares["amx"] += (amx.double() - exact).square().sum().item()
        squares["fma"] += (fma.double() - exact).square().sum().item()
        torch.testing.assert_close(amx, x @ weight.t(), atol=1e-5, rtol=1e-5)
    assert squares["amx"] < squares["fma"], squares


def test_every_bit_of_both_operands_counts(ops):
    """One-hot rows pick a weight column exactly (x 1.0, plus zeros) and one-hot weights a
    row's inputs: exact only if all three bf16 pieces of the other operand are multiplied
    (random fp32 values use all 24 significant bits; bf16 alone keeps 8)."""
    gen = torch.Generator().manual_seed(1)
    n, k = 96, 160
    weight = torch.randn(n, k, generator=gen)
    picks = torch.arange(40) * 3 % k
    onehot = torch.nn.functional.one_hot(picks, k).float()
    out = _run(ops, onehot, woq.to_panels_fp32(weight, woq.PANEL), n, 1)
    assert torch.equal(out, weight[:, picks].t().contiguous())
    x = torch.randn(40, k, generator=gen)
    cols = torch.arange(n) * 7 % k
    eye = torch.nn.functional.one_hot(cols, k).float()  # output j reads input cols[j]
    out = _run(ops, x, woq.to_panels_fp32(eye, woq.PANEL), n, 1)
    assert torch.equal(out, x[:, cols])


def test_a_rows_result_does_not_depend_on_the_batch_or_the_threads(ops):
    """Each output is its row's own tile products (padding rows are zeros): the same bits in
    any batch from the threshold on, whichever thread computes its panel."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(960, 576, generator=gen)
    panels = woq.to_panels_fp32(weight, woq.PANEL)
    x = torch.randn(300, 576, generator=gen)
    first = _run(ops, x[:3], panels, 960, 1)
    for rows in (4, 16, 17, 32, 33, 64, 255, 256, 257, 300):
        assert torch.equal(ops.fp32_linear(x[:rows], panels, 960)[:3], first), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.fp32_linear(x[:64], panels, 960)
        for n in (2, 3):
            torch.set_num_threads(n)
            assert torch.equal(ops.fp32_linear(x[:64], panels, 960), one), n
    finally:
        torch.set_num_threads(threads)


def test_threshold_picks_the_path(ops):
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(64, 576, generator=gen)
    panels = woq.to_panels_fp32(weight, woq.PANEL)
    x = torch.randn(40, 576, generator=gen)
    fma = _run(ops, x, panels, 64, 0)
    amx = _run(ops, x, panels, 64, 1)
    assert not torch.equal(fma, amx)
    assert woq.set_fp32_amx_rows(33) == 33
    assert torch.equal(ops.fp32_linear(x[:32], panels, 64), fma[:32])  # below: FMA
    assert torch.equal(ops.fp32_linear(x[:33], panels, 64), amx[:33])  # from 33 rows: AMX


@pytest.mark.parametrize("rows", [1, 17, 40, 300])
def test_gate_up_silu_epilogue_on_amx(ops, fused_ops, rows):
    """fp32_linear_silu on AMX: silu(gate) * up of the AMX product, bit for bit the unfused
    path (fused_cpu.cpp's silu_mul of fp32_linear's product in the plain order)."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(2 * 1536, 576, generator=gen) * 0.05
    gate_up = woq.GateUpPanelLinear(weight)
    x = torch.randn(rows, 576, generator=gen)
    assert woq.set_fp32_amx_rows(1) == 1
    fused = ops.fp32_linear_silu(x, gate_up.panels, gate_up.out_features)
    product = ops.fp32_linear(x, gate_up.panels, gate_up.out_features)[:, gate_up.inverse]
    assert torch.equal(fused, fused_ops.silu_mul(product))


def test_rows_setting_is_checked_and_off_without_amx(monkeypatch):
    with pytest.raises(ValueError, match="fp32 AMX rows"):
        woq.set_fp32_amx_rows(-1)
    monkeypatch.setattr(woq, "amx_capable", lambda: False)
    assert woq.set_fp32_amx_rows(32) == 0


@pytest.mark.model
def test_greedy_outputs_equal_transformers_with_amx_linears(make_scheduler, llama_ref):
    """The test llama with every forward of 2+ rows (prefills; decode batches of several
    requests) on the AMX linears: transformers' greedy tokens for all 16 prompts."""
    from tests.runtime import test_bf16_linears
    from tests.runtime.test_speculative import run

    assert woq.start_linear_kernels(block=True)
    prompts, ref = llama_ref
    try:
        ids, _, _ = run(make_scheduler, 0, test_bf16_linears._requests(prompts),
                        cpu_amx_linear_rows=2, max_running_requests=8)
        assert woq._amx_rows == 2
    finally:
        woq.set_fp32_amx_rows(0)
    assert [ids[f"p{i}"] for i in range(len(ref))] == [r for r, _ in ref]


def test_the_field_is_checked():
    from plait.args import ServerArgs

    with pytest.raises(ValueError, match="cpu_amx_linear_rows: must be an integer >= 0"):
        ServerArgs(cpu_amx_linear_rows=-1)
