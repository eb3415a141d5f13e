"""CPU speedups of the model runner: the prepacked logits GEMM and the allocator thresholds."""

from __future__ import annotations

import platform

import pytest
import torch

from plait.args import ServerArgs
from plait.runtime.cpu_tuning import (
    PackedLinear,
    pack_layer_linears,
    pack_linear,
    tune_allocator,
)
from plait.runtime.model_runner import ModelRunner


def test_packed_logits_match_matmul_for_every_batch_size():
    weight = torch.randn(1000, 64, generator=torch.Generator().manual_seed(0))
    packed = pack_linear(weight)
    assert packed is not None
    for rows in (1, 7, 64, 200):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(packed(x), x @ weight.t(), atol=1e-4, rtol=1e-4)
    # a non-contiguous input (rows gathered from the hidden states) works too
    x = torch.randn(10, 128)[:, ::2]
    torch.testing.assert_close(packed(x), x @ weight.t(), atol=1e-4, rtol=1e-4)


def test_packing_is_fp32_cpu_only():
    assert pack_linear(torch.randn(8, 4, dtype=torch.bfloat16)) is None


@pytest.mark.model
def test_runner_prepacks_linears_unless_disabled(tiny_llama, monkeypatch):
    """Default: every linear and the logits copy on plait's panel kernels (fp32, AVX2);
    --disable-cpu-linear-kernel: oneDNN's prepacked layout for the large ones;
    --disable-cpu-prepack: torch's plain weights. The logits agree across all three."""
    from plait.kernels import woq
    from plait.runtime import cpu_tuning

    # tiny-llama's projections (at most 768 x 128) are under the size that pays: lower it
    monkeypatch.setattr(cpu_tuning, "MIN_PACKED_LINEAR", 10_000)

    def runner(**kw):
        return ModelRunner(ServerArgs(model_path=tiny_llama, max_total_tokens=256, **kw),
                           tiny_llama)

    onednn, off = runner(disable_cpu_linear_kernel=True), runner(disable_cpu_prepack=True)
    assert isinstance(onednn.model.packed_lm_head, PackedLinear)
    assert getattr(off.model, "packed_lm_head", None) is None
    # the large projections are prepacked too (lm_head is not: it has its own copy)
    packed = [n for n, m in onednn.model.named_modules() if isinstance(m, PackedLinear)]
    layers = [n for n in packed if n != "packed_lm_head"]
    assert layers and all(".self_attn." in n or ".mlp." in n for n in layers)
    assert not any(isinstance(m, (PackedLinear, woq.PanelLinear)) for m in off.model.modules())
    hidden = torch.randn(5, off.config.hidden_size)
    expected = off.model.compute_logits(hidden)
    torch.testing.assert_close(onednn.model.compute_logits(hidden), expected, atol=1e-4,
                               rtol=1e-4)
    if not woq.available_isas():
        return
    panels = runner()
    assert isinstance(panels.model.packed_lm_head, woq.PanelLinear)
    assert not any(type(m) is torch.nn.Linear for m in panels.model.model.modules())
    assert any(isinstance(m, woq.PanelLinear) for m in panels.model.model.layers[0].modules())
    woq.start_linear_kernels(block=True)
    torch.testing.assert_close(panels.model.compute_logits(hidden), expected, atol=1e-4,
                               rtol=1e-4)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_allocator_thresholds_are_accepted_by_glibc():
    assert tune_allocator()


def test_packed_linear_with_bias_and_leading_dims():
    g = torch.Generator().manual_seed(1)
    weight, bias = torch.randn(600, 512, generator=g), torch.randn(600, generator=g)
    packed = pack_linear(weight, bias)
    x = torch.randn(2, 5, 512, generator=g)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight, bias),
                               atol=1e-4, rtol=1e-4)


def test_pack_layer_linears_replaces_only_large_fp32_projections():
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),  # 524k elements: packed
        torch.nn.Linear(1024, 64),  # 65k: left alone
        torch.nn.Linear(512, 1024).to(torch.bfloat16),  # not fp32: left alone
    )
    x = torch.randn(3, 512)
    expected = model[1](model[0](x))
    assert pack_layer_linears(model) == 1
    assert isinstance(model[0], PackedLinear) and type(model[1]) is torch.nn.Linear
    assert type(model[2]) is torch.nn.Linear
    torch.testing.assert_close(model[1](model[0](x)), expected, atol=1e-4, rtol=1e-4)


def test_child_env_bounds_openmp_spinning_and_keeps_user_settings():
    from plait.runtime.child_env import THREAD_WAIT_ENV, child_env

    env = child_env({"PATH": "/bin"})
    assert {k: env[k] for k in THREAD_WAIT_ENV} == THREAD_WAIT_ENV
    assert int(env["GOMP_SPINCOUNT"]) < 300_000  # below libgomp's default spin
    assert child_env({"GOMP_SPINCOUNT": "300000"})["GOMP_SPINCOUNT"] == "300000"


def test_children_start_before_the_parent_imports_torch():
    """The parent starts its children without importing torch first (1-3 s on a 2-core host,
    during which the children, which import it themselves, would not have started): checked
    in a fresh interpreter at the moment ChildProcess calls Popen."""
    import subprocess
    import sys

    code = (
        "import subprocess, sys\n"
        "seen = []\n"
        "class Stop(Exception): pass\n"
        "def popen(*a, **k):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    raise Stop\n"
        "subprocess.Popen = popen\n"
        "from plait.launch import ChildProcess\n"
        "try:\n"
        "    ChildProcess('detokenizer', 'detokenizer', {})\n"
        "except Stop:\n"
        "    pass\n"
        "print(seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[False]"


@pytest.mark.model
@pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc")
def test_launched_children_wait_with_bounded_spin(tiny_llama, monkeypatch):
    """The scheduler and detokenizer processes really start with the bounded wait (OpenMP reads
    it once at start-up, so it must be in their environment, not set later)."""
    import plait
    from plait.runtime.child_env import THREAD_WAIT_ENV

    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with plait.Engine(tiny_llama, max_total_tokens=1024) as eng:
        for name, proc in eng._children.procs.items():
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            assert env[b"GOMP_SPINCOUNT"] == THREAD_WAIT_ENV["GOMP_SPINCOUNT"].encode(), name
