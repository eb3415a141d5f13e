"""`--cpu-bf16-linear-rows N`: forwards of N rows or more run the decoder linears in bf16.

The panel linear switches at N rows to oneDNN's bf16 GEMM on a bf16 copy of its weight (rows
rounded to bf16); below N it keeps the fp32 panels. The model takes its module path for such
forwards (the lean loops call the fp32 kernels directly), and keeps the C++ decode loop below.
"""

from __future__ import annotations

import pytest
import torch

from plait.args import ServerArgs
from plait.kernels import woq
from plait.runtime import model_runner
from plait.runtime.logit_screen import has_bf16_units
from tests.runtime import test_parity
from tests.runtime.test_fused_layers import count_cpp_loop_runs
from tests.runtime.test_speculative import run

pytestmark = pytest.mark.skipif(not woq.available_isas(), reason="the kernels need AVX2 + FMA")
needs_bf16 = pytest.mark.skipif(not has_bf16_units(), reason="no AMX or AVX512-BF16 here")
llama_ref = test_parity.llama_ref  # the fixture: 16 prompts, transformers' greedy outputs


@needs_bf16
def test_the_linear_switches_to_bf16_at_its_row_count():
    assert woq.start_linear_kernels(block=True)
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(200, 96, generator=gen), torch.randn(200, generator=gen)
    m = woq.PanelLinear(weight, bias)
    m.use_bf16_from(8)
    for rows in (1, 7, 8, 9, 64):
        x = torch.randn(rows, 96, generator=gen)
        if rows < 8:  # the fp32 panels
            want = torch.nn.functional.linear(x, weight, bias)
            torch.testing.assert_close(m(x), want, atol=1e-4, rtol=1e-4)
        else:  # bf16 products of the rounded rows and weight, accumulated in fp32
            want = torch.nn.functional.linear(x.bfloat16(), weight.bfloat16()).float() + bias
            got = m(x)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert not torch.allclose(got, torch.nn.functional.linear(x, weight, bias),
                                      atol=1e-4, rtol=1e-4)  # not the fp32 result


@needs_bf16
def test_the_mlp_keeps_its_bf16_product_through_silu_into_down():
    from plait.kernels.fused_ops import start_fused_ops, fused_ops
    from plait.models.llama import MLP

    assert woq.start_linear_kernels(block=True) and start_fused_ops(block=True)
    gen = torch.Generator().manual_seed(1)
    mlp = MLP(64, 96, bias=False)
    w_gu, w_down = torch.randn(192, 64, generator=gen), torch.randn(64, 96, generator=gen)
    with torch.inference_mode():
        mlp.gate_up_proj = woq.PanelLinear(w_gu)
        mlp.down_proj = woq.PanelLinear(w_down)
        for m in (mlp.gate_up_proj, mlp.down_proj):
            m.use_bf16_from(16)
        wide, narrow = torch.randn(16, 64, generator=gen), torch.randn(15, 64, generator=gen)
        gate, up = torch.nn.functional.linear(wide.bfloat16(), w_gu.bfloat16()).split(96, -1)
        act = torch.nn.functional.silu(gate) * up  # bf16, as the chain keeps it
        want = torch.nn.functional.linear(act, w_down.bfloat16()).float()
        torch.testing.assert_close(mlp.forward_fused(wide, fused_ops()), want, atol=0, rtol=0)
        # fewer rows: the fp32 panels and the fused silu_mul
        gate, up = torch.nn.functional.linear(narrow, w_gu).split(96, -1)
        want = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w_down)
        torch.testing.assert_close(mlp.forward_fused(narrow, fused_ops()), want,
                                   atol=1e-4, rtol=1e-4)


def _requests(prompts):
    return [
        {"rid": f"p{i}", "input_ids": p,
         "sampling_params": {"temperature": 0.0, "max_new_tokens": test_parity.MAX_NEW}}
        for i, p in enumerate(prompts)
    ]


@needs_bf16
@pytest.mark.model
def test_wide_forwards_run_bf16_linears_and_decode_keeps_the_cpp_loop(
    make_scheduler, llama_ref, monkeypatch
):
    from plait.kernels.cpu_attention import start_decode_kernel
    from plait.kernels.fused_ops import start_fused_ops

    assert woq.start_linear_kernels(block=True) and start_fused_ops(block=True)
    assert start_decode_kernel(block=True)
    wide: list[int] = []
    product = woq.PanelLinear.bf16_product

    def counted(self, x):
        wide.append(x.shape[0])
        return product(self, x)

    monkeypatch.setattr(woq.PanelLinear, "bf16_product", counted)
    cpp_runs = count_cpp_loop_runs(monkeypatch)
    prompts, ref = llama_ref
    ids, _, _ = run(make_scheduler, 0, _requests(prompts), cpu_bf16_linear_rows=64,
                           max_running_requests=8)
    assert wide and min(wide) >= 64, "no forward of 64 rows took the bf16 linears"
    assert cpp_runs and max(b for b, _ in cpp_runs) < 64, "decode left the C++ loop"
    # bf16 prefill moves near ties, not most outputs (tiny-llama's random weights)
    agree = sum(ids[f"p{i}"] == ref_ids for i, (ref_ids, _) in enumerate(ref))
    assert agree >= len(ref) // 2, f"only {agree} of {len(ref)} equal fp32's"


def test_the_field_is_checked():
    with pytest.raises(ValueError, match="cpu_bf16_linear_rows: must be an integer >= 0"):
        ServerArgs(cpu_bf16_linear_rows=-1)
    with pytest.raises(ValueError, match="cpu_bf16_linear_rows: needs float32 linears"):
        ServerArgs(cpu_bf16_linear_rows=64, quantization="int4")


@pytest.mark.model
def test_it_is_refused_where_it_cannot_run(make_scheduler, monkeypatch):
    with pytest.raises(ValueError, match="cpu_bf16_linear_rows: runs on the CPU's prepacked"):
        make_scheduler(cpu_bf16_linear_rows=64, disable_cpu_prepack=True)
    with pytest.raises(ValueError, match="cpu_bf16_linear_rows: needs plait's fp32 panel"):
        make_scheduler(cpu_bf16_linear_rows=64, disable_cpu_linear_kernel=True)
    monkeypatch.setattr(model_runner, "has_bf16_units", lambda: False)
    with pytest.raises(ValueError, match="cpu_bf16_linear_rows: this CPU has no bf16 units"):
        make_scheduler(cpu_bf16_linear_rows=64)
