"""Greedy output through plait's CPU decode attention kernel (attn_cpu.cpp) == transformers.

The Engine builds or loads the kernel in a background thread and decodes on torch's path until
it is ready, so the parity tests in test_parity.py may never reach it. Here the kernel is
loaded first and the scheduler runs in this process, where every decode step must go through
it (counted), shared prefixes included (in-batch cache hits: the prefix part of the kernel):
from Python (the backend's forward) or, where the fused operators are built, from the C++
layer loop (fused_cpu.cpp's DecodeLayers, which calls the kernel's entry point directly: its
runs are counted instead)."""

from __future__ import annotations

import pytest

from plait.kernels import cpu_attention
from tests.runtime import test_parity
from tests.runtime.test_fused_layers import count_cpp_loop_runs
from tests.runtime.test_speculative import run

pytestmark = pytest.mark.model
llama_ref = test_parity.llama_ref  # the fixture: 16 prompts, transformers' greedy outputs


class _Counting:
    """The kernel module, counting its decode_attention calls."""

    def __init__(self, mod):
        self._mod, self.calls = mod, 0

    def decode_attention(self, *args):
        self.calls += 1
        return self._mod.decode_attention(*args)

    def __getattr__(self, name):
        return getattr(self._mod, name)


def test_decode_kernel_greedy_matches_transformers(make_scheduler, llama_ref, monkeypatch):
    if cpu_attention.kernel_isa() is None:
        pytest.skip("the decode kernel needs AVX2")
    assert cpu_attention.start_decode_kernel(block=True), "the decode kernel failed to build"
    counting = _Counting(cpu_attention._kernel)
    monkeypatch.setattr(cpu_attention, "_kernel", counting)
    cpp_runs = count_cpp_loop_runs(monkeypatch)
    prompts, ref = llama_ref
    reqs = [
        {
            "rid": f"p{i}",
            "input_ids": p,
            "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": test_parity.MAX_NEW},
        }
        for i, p in enumerate(prompts)
    ]
    ids, info, counters = run(make_scheduler, 0, reqs)
    decode_forwards = counters["decode_forwards"]
    assert decode_forwards > 0 and counters["decode_shared_kv_tokens"] > 0
    # each decode forward: one call per layer for the suffixes, plus one per shared prefix
    # (tiny-llama: 2 layers), from Python or inside a C++ loop run
    assert counting.calls + 2 * len(cpp_runs) >= 2 * decode_forwards
    assert not cpp_runs or any(g for _, g in cpp_runs), "the C++ loop never attended a prefix"
    for i, (ref_ids, ref_lps) in enumerate(ref):
        assert ids[f"p{i}"] == ref_ids, f"prompt {i}: tokens differ from transformers"
        got = info[f"p{i}"][2]
        assert max(abs(a - b) for a, b in zip(got, ref_lps)) < 1e-4, f"prompt {i}: logprobs"
