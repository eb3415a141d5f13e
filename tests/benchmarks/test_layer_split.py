"""benchmarks/layer_split.py on a tiny checkpoint: the C++ decode layer loop's per-kernel
clock (DecodeLayers.set_timing / timings) fills every kernel's time, within the forward's."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


def test_layer_split_times_every_kernel_of_the_cpp_loop(checkpoint, fused_ops):
    from benchmarks.layer_split import split
    from plait.models.llama import LlamaForCausalLM

    row = split(checkpoint("tiny-llama"), batch=2, context=40, steps=3, quantization="none")
    kernels = row["kernels_s"]
    assert set(kernels) == {"qkv_proj", "rope_store_kv", "attention", "o_proj", "add_rms_norm",
                            "gate_up_proj", "silu_mul", "down_proj"}
    assert all(t > 0 for t in kernels.values()), kernels
    assert 0 < row["layers_s"] < row["forward_s"] < row["step_s"]
    assert LlamaForCausalLM.use_cpp_layer_loop  # (the loop the split needs is the default)


def test_decode_layers_clock_is_off_until_asked(checkpoint, fused_ops):
    """Timing off (the default): the clock adds nothing, timings stay zero."""
    from benchmarks.engine import build_cpu_kernels
    from benchmarks.profile_steps import InProcess

    build_cpu_kernels()
    ip = InProcess(checkpoint("tiny-llama"))
    ip.submit([[300 + i for i in range(20)]], {"max_new_tokens": 8, "temperature": 0.0,
                                                "ignore_eos": True})
    for _ in range(6):
        ip.sched.step()
    decoder = ip.sched.runner.model._decoder[1]
    assert set(decoder.timings().values()) == {0.0}
