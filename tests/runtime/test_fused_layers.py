"""The decoder layers through fused_cpu.cpp (plait.kernels.fused_ops) in the real scheduler,
driven in-process: the same logits as torch's operators bit for bit, on each architecture flag
(qkv bias, q/k norms), over chunked extends, cache hits and batched decodes; greedy output
equal to transformers'."""

from __future__ import annotations

import pytest
import torch

from plait.args import ServerArgs
from plait.kernels import fused_ops as fo
from plait.models.tokenizer import load_tokenizer
from plait.runtime.scheduler import Scheduler
from plait.runtime.scheduler_process import InProcessIO
from tests.runtime.test_isolation import outputs, submit
from tests.runtime.test_parity import hf_reference, make_prompts
from tests.runtime.test_scheduler import drain

pytestmark = pytest.mark.model

KERNELS = ("rms_norm", "add_rms_norm_", "rope_store_kv", "silu_mul")


@pytest.fixture(scope="module")
def ops(fused_ops) -> fo.FusedOps:
    return fused_ops


@pytest.fixture
def calls(ops, monkeypatch) -> dict[str, int]:
    """How often each fused kernel ran (counted on the loaded FusedOps)."""
    counts = dict.fromkeys(KERNELS, 0)
    for name in KERNELS:
        fn = getattr(ops, name)

        def counted(*args, _fn=fn, _name=name):
            counts[_name] += 1
            return _fn(*args)

        monkeypatch.setattr(ops, name, counted)
    return counts


def run(path: str, prompts: list[list[int]], max_new: int, **server_args):
    """Greedy outputs by rid, and the logits of every forward in order."""
    io = InProcessIO()
    if server_args.get("num_threads"):  # what the scheduler process does with it
        torch.set_num_threads(server_args["num_threads"])
    s = Scheduler(ServerArgs(model_path=path, **server_args), path, io, load_tokenizer(path))
    logits = []
    forward = s.runner.run

    def capture(inputs, rows, argmax_vocab=None):
        out = forward(inputs, rows)  # full logits, not the logit screen's greedy picks
        logits.append(out[0].clone())
        return out

    s.runner.run = capture
    for i, p in enumerate(prompts):
        submit(io, f"r{i}", p, max_new_tokens=max_new)
    drain(s)
    return outputs(io), logits


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_fused_layers_give_torchs_logits_bit_for_bit(checkpoint, calls, name):
    from plait.kernels import woq
    from plait.kernels.cpu_attention import start_decode_kernel
    from plait.kernels.cpu_extend import start_extend_kernel

    # both runs on the same attention and linear kernels: a scheduler runs torch's operators
    # until its background load of them ends, so run alone the first run's first forwards did
    start_decode_kernel(block=True)
    start_extend_kernel(block=True)
    woq.start_linear_kernels(block=True)
    path = checkpoint(name)
    prompts = make_prompts(8, 8192, seed=2)  # shared prefixes: cache hits within the batch
    # a fixed thread count: the adaptive one may pick 1 thread for a forward in one run and 2
    # in the other, and the tiny models' small (unpacked, MKL) linears round differently
    args = dict(max_total_tokens=4096, chunked_prefill_size=32, num_threads=2)
    # silu * up in the gate_up linear's epilogue (woq.GateUpPanelLinear), then in silu_mul
    silu_out, silu_logits = run(path, prompts, 10, **args)
    assert calls["silu_mul"] == 0 or woq.linear_ops().isa != "avx512"
    fused_out, fused_logits = run(path, prompts, 10, disable_fused_silu=True, **args)
    assert calls["rms_norm"] > 0 and calls["add_rms_norm_"] > 0 and calls["silu_mul"] > 0
    assert silu_out == fused_out
    assert all(torch.equal(a, b) for a, b in zip(silu_logits, fused_logits, strict=True))
    if name == "tiny-qwen3":  # q/k norms before rotary: torch's rotary and KV store
        assert calls["rope_store_kv"] == 0
    else:
        assert calls["rope_store_kv"] > 0
    used = dict(calls)
    torch_out, torch_logits = run(path, prompts, 10, disable_cpu_fused_ops=True, **args)
    assert calls == used, "--disable-cpu-fused-ops still ran a fused kernel"
    assert fused_out == torch_out
    assert len(fused_logits) == len(torch_logits)
    for step, (a, b) in enumerate(zip(fused_logits, torch_logits)):
        assert torch.equal(a, b), f"forward {step}: logits differ by {(a - b).abs().max():.3g}"


def test_fused_layers_match_transformers(tiny_llama, calls):
    prompts = make_prompts(8, 8192, seed=3)
    ref = hf_reference(tiny_llama, prompts, 12)
    out, _ = run(tiny_llama, prompts, 12, max_total_tokens=4096)
    assert calls["rope_store_kv"] > 0
    for i, (ids, _) in enumerate(ref):
        assert out[f"r{i}"] == ids, f"prompt {i}: tokens differ"


@pytest.mark.parametrize("name, lean, quantization", [
    ("tiny-llama", True, "none"), ("tiny-qwen2", False, "none"),
    ("tiny-llama", True, "int8"), ("tiny-llama", True, "int4"),
])
def test_lean_layer_loop_gives_the_module_paths_logits(checkpoint, ops, monkeypatch, name, lean,
                                                       quantization):
    """LlamaForCausalLM._forward_lean (the kernels called in a row, no module calls) against
    the module path, bit for bit, over chunked extends, shared-prefix decodes (attention through
    the backend's forward) and plain decodes (straight to attn_cpu.cpp); fp32 panel linears and
    weight-only quantized ones. Not taken where a linear has a bias (Qwen2's qkv)."""
    from plait.kernels import woq
    from plait.kernels.cpu_attention import start_decode_kernel
    from plait.kernels.cpu_extend import start_extend_kernel
    from plait.models.llama import LlamaForCausalLM

    start_decode_kernel(block=True)
    start_extend_kernel(block=True)
    assert woq.start_linear_kernels(block=True)
    ran = []
    forward_lean = LlamaForCausalLM._forward_lean

    def counted(self, *args):
        ran.append(args[4].mode)  # meta
        return forward_lean(self, *args)

    monkeypatch.setattr(LlamaForCausalLM, "_forward_lean", counted)
    path = checkpoint(name)
    shared = make_prompts(8, 8192, seed=5)  # cache hits: shared prefixes in the decode batch
    distinct = [[(97 * i + 31 * j) % 8000 + 100 for j in range(40 + i)] for i in range(5)]
    args = dict(max_total_tokens=4096, chunked_prefill_size=64, num_threads=2,
                quantization=quantization)
    for prompts in (shared, distinct):
        lean_out, lean_logits = run(path, prompts, 10, **args)
        modes = set(ran)
        monkeypatch.setattr(LlamaForCausalLM, "use_lean_loop", False)
        ran.clear()
        module_out, module_logits = run(path, prompts, 10, **args)
        monkeypatch.setattr(LlamaForCausalLM, "use_lean_loop", True)
        assert not ran, "use_lean_loop = False still ran the lean loop"
        assert len(modes) == (2 if lean else 0), modes  # extend and decode forwards
        assert lean_out == module_out
        for step, (a, b) in enumerate(zip(lean_logits, module_logits, strict=True)):
            assert torch.equal(a, b), f"forward {step}: logits differ by {(a - b).abs().max():.3g}"


def count_cpp_loop_runs(monkeypatch) -> list[tuple[int, int]]:
    """(batch, prefix groups) of every run of the C++ decode layer loop (DecodeLayers) from
    here on, appended as they happen."""
    from plait.models.llama import LlamaForCausalLM

    runs: list[tuple[int, int]] = []
    decode_layers = LlamaForCausalLM._decode_layers

    class Counted:
        def __init__(self, decoder):
            self.decoder = decoder

        def run(self, *args):
            runs.append((args[0].shape[0], len(args[-1])))
            return self.decoder.run(*args)

    def counted(self, *args):
        decoder = decode_layers(self, *args)
        return None if decoder is None else Counted(decoder)

    monkeypatch.setattr(LlamaForCausalLM, "_decode_layers", counted)
    return runs


@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_cpp_layer_loop_gives_the_python_loops_logits(checkpoint, ops, monkeypatch, quantization):
    """fused_cpu.cpp's DecodeLayers (the lean loop as one C++ call) against _forward_lean's
    Python loop, bit for bit: decode batches run it (counted), with and without shared prefixes
    (their cascade attention: the prefix read once for its members, merged in C++); extends
    keep the Python loop, except drafts verified over a prefix that requests share and steps
    where most requests add one row (decode rows: cpu_attention.plan_rows)."""
    from plait.kernels import woq
    from plait.kernels.cpu_attention import start_decode_kernel
    from plait.kernels.cpu_extend import start_extend_kernel
    from plait.models.llama import LlamaForCausalLM

    start_decode_kernel(block=True)
    start_extend_kernel(block=True)
    assert woq.start_linear_kernels(block=True)
    runs = count_cpp_loop_runs(monkeypatch)
    path = checkpoint("tiny-llama")
    distinct = [[(97 * i + 31 * j) % 8000 + 100 for j in range(40 + i)] for i in range(5)]
    shared = make_prompts(8, 8192, seed=5)
    args = dict(max_total_tokens=4096, chunked_prefill_size=64, num_threads=2,
                quantization=quantization)
    for prompts in (distinct, shared):
        runs.clear()
        cpp_out, cpp_logits = run(path, prompts, 10, **args)
        # every decode forward (the whole batch, then what is left of it as requests end);
        # the shared prompts' with prefix groups, the distinct ones' without
        batches = [b for b, _ in runs]
        assert len(prompts) in batches, runs  # the whole batch decoding
        if prompts is distinct:  # nothing shared across requests in the decode batch
            assert dict(runs)[len(prompts)] == 0, runs
        else:  # and the verifies of drafts over the shared prefixes, as decode rows
            assert runs[0][1] > 0, runs
            assert any(b > len(prompts) for b in batches), runs
        used = len(runs)
        monkeypatch.setattr(LlamaForCausalLM, "use_cpp_layer_loop", False)
        py_out, py_logits = run(path, prompts, 10, **args)
        monkeypatch.setattr(LlamaForCausalLM, "use_cpp_layer_loop", True)
        assert len(runs) == used, "use_cpp_layer_loop = False still ran the C++ loop"
        assert cpp_out == py_out
        for step, (a, b) in enumerate(zip(cpp_logits, py_logits, strict=True)):
            assert torch.equal(a, b), f"forward {step}: logits differ by {(a - b).abs().max():.3g}"
