"""Fused small operators of the Llama decoder layer on the CPU (fp32): fused_cpu.cpp, its
loader, and the torch references the tests compare it against.

A decode step of a small model spends milliseconds outside its matmuls and attention: per
layer some 25 small torch operators (RMSNorm, residual adds, rotary, SiLU * up, the KV stores)
and their views, each a few microseconds of dispatch over a few hundred floats. fused_cpu.cpp
does each group in one pass (see its header), with results bit-identical to these torch
references (which the model's unfused path runs). It is compiled with torch's cpp_extension in a
background thread when a model runner starts (35 s the first time on this project's busy 2-core
machine, then 0.2 s to load from torch's extension cache); until it is ready, on other CPUs or
dtypes, or with `--disable-cpu-fused-ops`, the model runs the torch operators.

torch.compile of the layer body was the other way; it was not taken for its start-up cost on
the 2-core machine (measured there, busy, on one small RMSNorm + SiLU function: importing
dynamo/inductor 1.4-1.9 s, the first compile 21 s, every later start 3.5 s more with a warm
cache), against `plait generate`'s ~10 s warm start.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from plait.kernels.cpp_build import BackgroundBuild

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("fused_cpu.cpp")
_kernel: FusedOps | None = None  # the compiled kernels, once built or loaded


# ------------------------------------------------------------------ torch references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] -> [T, N]; the mean of squares in fp32, as Hugging Face's LlamaRMSNorm."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm_reference(
    residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, its RMSNorm): the residual stream and the next sublayer's input."""
    residual = residual + delta
    return residual, rms_norm_reference(residual, weight, eps)


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary. x: [T, heads, D] (may be a strided view), cos/sin [T, 1, D/2]
    -> rotated, contiguous."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def rope_store_kv_reference(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]
    cos: torch.Tensor,  # [T, 1, D/2]
    sin: torch.Tensor,
    k_buffer: torch.Tensor,  # [slots, Hkv, D]
    v_buffer: torch.Tensor,
    loc: torch.Tensor,  # [T] slots of the new tokens
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotated q [T, H, D]; rotated k and v written to the pools at `loc`."""
    dim = k_buffer.shape[-1]
    qk = qkv[:, : (num_heads + num_kv_heads) * dim].unflatten(-1, (num_heads + num_kv_heads, dim))
    qk = rotate_reference(qk, cos, sin)
    v = qkv[:, (num_heads + num_kv_heads) * dim :].view(-1, num_kv_heads, dim)
    k_buffer[loc.long()] = qk[:, num_heads:].to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)
    return qk[:, :num_heads]


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 I] (gate ; up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ------------------------------------------------------------------ the compiled kernels
def build_flags() -> list[str]:
    """AVX-512 where torch itself runs its AVX-512 kernels, else AVX2 + FMA. No FMA
    contraction: the element-wise arithmetic must round as torch's separate operators do."""
    flags = ["-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp"]
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        flags.append("-mavx512f")
    return flags


class FusedOps:
    """The compiled kernels, with the vector widths of torch's own kernels they follow."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        # exact: both widths reproduce torch (else the results are within a rounding of it)
        self.sum_lanes, self.silu_lanes, self.exact = _torch_lanes(module)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, N] (unit column stride) -> [T, N]."""
        return self.module.rms_norm(x, weight, eps, self.sum_lanes)

    def add_rms_norm_(
        self, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += delta in place; returns its RMSNorm (add_rms_norm_reference)."""
        return self.module.add_rms_norm_(residual, delta, weight, eps, self.sum_lanes)

    def rope_store_kv(self, qkv, cos, sin, k_buffer, v_buffer, loc, num_heads: int,
                      num_kv_heads: int) -> torch.Tensor:
        """rope_store_kv_reference (fp32 rows; contiguous fp32 or bf16 pools, int32 or int64
        slots)."""
        return self.module.rope_store_kv(qkv, cos, sin, k_buffer, v_buffer, loc, num_heads,
                                         num_kv_heads)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 I] -> [T, I] (silu_mul_reference)."""
        return self.module.silu_mul(gate_up, self.silu_lanes)

    def max_argmax(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits.amax(-1), logits.argmax(-1)) of [B, V] float32 rows (unit column stride),
        with torch's NaN and first-maximum rules: what the sampler needs each step."""
        mx, idx = self.module.max_argmax(logits)
        return mx, idx

    def screen_argmax(
        self, approx: torch.Tensor, hidden: torch.Tensor, hidden_bf16: torch.Tensor,
        weight: torch.Tensor, w_norm: torch.Tensor, w_rest: torch.Tensor, g: float, c: float,
        valid: int, bitmask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact (amax, argmax) of hidden @ weight[:valid].T from its bf16 screen `approx`
        (plait/runtime/logit_screen.py), over the tokens a grammar bitmask [B, W] int32
        allows if one is given."""
        mx, idx = self.module.screen_argmax(approx, hidden, hidden_bf16, weight, w_norm, w_rest,
                                            g, c, valid, bitmask)
        return mx, idx

    def apply_bitmask_(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """logits [B, V] float32 (unit column stride) in place: -inf where the token's bit in
        bitmask [B, W] int32 is 0, and past 32 W (plait.grammar.base.apply_token_bitmask)."""
        self.module.apply_bitmask_(logits, bitmask)


def _torch_lanes(module: ModuleType) -> tuple[int, int, bool]:
    """The vector widths (8 or 16) of torch's sum and SiLU kernels on this machine.

    The fused RMSNorm sums its squares in the order of torch's sum kernel, and SiLU runs the
    blocks torch vectorizes through torch's exp and the rest through std::exp, as torch's
    scalar code: both depend on the width the torch kernel runs at, which is not always the
    CPU's (torch 2.13 here, on an AVX-512 CPU: sums 8 floats wide, SiLU 16). Each is found by
    trying both on probe rows; when neither reproduces torch exactly, 8 (the result then
    differs from torch's by a rounding)."""
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randn(3, n, generator=gen) * 4 for n in (16, 100, 576, 1000, 4098)]

    def first(matches) -> int | None:
        return next((lanes for lanes in (8, 16) if all(matches(x, lanes) for x in rows)), None)

    ones = {x.shape[1]: torch.ones(x.shape[1]) for x in rows}
    sum_lanes = first(lambda x, lanes: torch.equal(
        module.rms_norm(x, ones[x.shape[1]], 1e-6, lanes),
        rms_norm_reference(x, ones[x.shape[1]], 1e-6),
    ))
    silu_lanes = first(lambda x, lanes: torch.equal(
        module.silu_mul(x, lanes), silu_mul_reference(x)
    ))
    if sum_lanes is None or silu_lanes is None:
        logger.info("fused CPU operators: results within a rounding of torch's, not equal")
    return sum_lanes or 8, silu_lanes or 8, sum_lanes is not None and silu_lanes is not None


def _load() -> ModuleType:
    from plait.kernels.cpp_build import load_extension

    return load_extension("plait_fused_cpu", _SOURCE, build_flags(), ["-fopenmp"])


def _set_kernel(module: ModuleType) -> None:
    global _kernel
    _kernel = FusedOps(module)


_build = BackgroundBuild("the CPU fused layer operators", _load, _set_kernel)


def start_fused_ops(block: bool = False) -> bool:
    """Build or load fused_cpu.cpp, in a background thread unless `block` (the model runs
    torch's operators meanwhile). True when the kernels can be used now."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return False
    if _kernel is None:
        _build.start(block)
    return _kernel is not None


def fused_ops() -> FusedOps | None:
    """The compiled kernels, or None while they are not built (or cannot be)."""
    return _kernel
