"""`--kv-cache-dtype bfloat16`: a bf16 KV pool beside fp32 weights on the CPU.

K and V are rounded to bf16 as they are stored (the fused rotary + store, or torch's store);
q, the attention arithmetic and its output stay fp32. plait's kernels read the bf16 rows in
place (decode: attn_cpu.cpp, extend: extend_attn_cpu.cpp, the C++ layer loop); torch's path
converts what it gathers. Both must give the same greedy outputs, and the pool must be bf16.
"""

from __future__ import annotations

import pytest
import torch

import plait
from plait.args import ServerArgs
from plait.kernels import cpu_attention, cpu_extend
from plait.kernels.fused_ops import start_fused_ops
from plait.runtime.model_runner import resolve_kv_dtype
from tests.runtime import test_parity
from tests.runtime.test_decode_kernel_parity import _Counting
from tests.runtime.test_extend_kernel_parity import CountingKernel
from tests.runtime.test_fused_layers import count_cpp_loop_runs
from tests.runtime.test_speculative import run

llama_ref = test_parity.llama_ref  # the fixture: 16 prompts, transformers' greedy outputs
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_kv_dtype_resolves_or_is_refused_naming_the_field():
    assert resolve_kv_dtype("auto", torch.float32, CPU) == torch.float32
    assert resolve_kv_dtype("auto", torch.bfloat16, CUDA) == torch.bfloat16
    for name in ("bfloat16", "bf16"):
        assert resolve_kv_dtype(name, torch.float32, CPU) == torch.bfloat16
        assert resolve_kv_dtype(name, torch.bfloat16, CUDA) == torch.bfloat16  # the model's
    for dtype, device in ((torch.float32, CUDA), (torch.float16, CPU), (torch.float16, CUDA)):
        with pytest.raises(ValueError, match="^kv_cache_dtype: bf16 beside"):
            resolve_kv_dtype("bf16", dtype, device)
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of auto, bfloat16, bf16"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")


def _requests(prompts):
    return [
        {"rid": f"p{i}", "input_ids": p, "return_logprob": True,
         "sampling_params": {"temperature": 0.0, "max_new_tokens": test_parity.MAX_NEW}}
        for i, p in enumerate(prompts)
    ]


@pytest.mark.model
@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_bf16_kv_through_the_kernels_matches_torchs_path(make_scheduler, llama_ref, monkeypatch,
                                                         quantization):
    if cpu_attention.kernel_isa() is None or cpu_extend.kernel_flags() is None:
        pytest.skip("the CPU kernels need AVX2")
    assert cpu_attention.start_decode_kernel(block=True), "the decode kernel failed to build"
    assert cpu_extend.start_extend_kernel(block=True), "the extend kernel failed to build"
    assert start_fused_ops(block=True), "the fused operators failed to build"
    decode = _Counting(cpu_attention._kernel)
    extend = CountingKernel(cpu_extend._kernel)
    monkeypatch.setattr(cpu_attention, "_kernel", decode)
    monkeypatch.setattr(cpu_extend, "_kernel", extend)
    cpp_runs = count_cpp_loop_runs(monkeypatch)
    prompts, ref = llama_ref
    reqs = _requests(prompts)

    ids, info, counters = run(make_scheduler, 0, reqs, kv_cache_dtype="bfloat16",
                              quantization=quantization)
    assert counters["decode_forwards"] > 0
    assert decode.calls + len(cpp_runs) > 0 and extend.calls > 0, "a kernel was not used"
    monkeypatch.undo()
    # torch's path: gathers, converts to fp32, attends (the same bf16 values in the pool)
    torch_ids, torch_info, _ = run(
        make_scheduler, 0, reqs, kv_cache_dtype="bfloat16", quantization=quantization,
        disable_cpu_attention_kernel=True, disable_cpu_extend_kernel=True,
        disable_cpu_fused_ops=True,
    )
    # (the paths' fp32 sums differ in their last bits; where such a K or V element lies next to
    # a bf16 rounding boundary, the two round it 2^-8 apart, so logprobs agree to ~1e-4, not to
    # fp32 KV's ~1e-6)
    agree = 0
    for i, (ref_ids, _) in enumerate(ref):
        rid = f"p{i}"
        assert ids[rid] == torch_ids[rid], f"prompt {i}: the kernels and torch's path differ"
        got, want = info[rid][2], torch_info[rid][2]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-3, f"prompt {i}: logprobs"
        agree += ids[rid] == ref_ids
    # against transformers' fp32 KV: bf16's rounding may move a near tie, not the outputs
    # (int4's own rounding moves more: checked in test_quantization.py, not here)
    if quantization == "none":
        assert agree >= len(ref) * 3 // 4, f"only {agree} of {len(ref)} match fp32 KV's outputs"


@pytest.mark.model
def test_the_bf16_pool_holds_twice_the_tokens(make_scheduler):
    fp32, _ = make_scheduler(max_total_tokens=4096)
    bf16, _ = make_scheduler(max_total_tokens=4096, kv_cache_dtype="bf16")
    pool = bf16.runner.kv_pool
    assert pool.dtype == torch.bfloat16 and pool.k_buffer[0].dtype == torch.bfloat16
    assert fp32.runner.kv_pool.dtype == torch.float32
    assert 2 * bf16.runner._kv_bytes_per_token() == fp32.runner._kv_bytes_per_token()
    assert bf16.runner.model.model.embed_tokens.weight.dtype == torch.float32


@pytest.mark.model
def test_an_engine_serves_with_a_bf16_kv_cache(tiny_llama, llama_ref):
    prompts, ref = llama_ref
    with plait.Engine(tiny_llama, kv_cache_dtype="bfloat16", log_level="warning") as engine:
        outs = engine.generate(input_ids=prompts[:4], sampling_params={
            "temperature": 0.0, "max_new_tokens": test_parity.MAX_NEW})
    for o, (ref_ids, _) in zip(outs, ref):
        assert len(o["output_ids"]) == len(ref_ids)
        assert o["output_ids"][:4] == ref_ids[:4]
