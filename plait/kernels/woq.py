"""Weight-only quantized linears for the CPU (`--quantization int8|int4`).

Small-batch decode reads every weight once per step and does little arithmetic on it, so its
time is the weights' bytes over the memory bandwidth: int8 weights are a quarter of fp32's
bytes, int4 an eighth. The GEMMs run in plait's own kernel (woq_cpu.cpp, AVX2 + FMA, built with
torch's cpp_extension on first use and cached per source version): weights are converted to fp32 in registers, the
activations stay fp32. torch's own weight-only ops (`torch._weight_int8pack_mm`,
`aten._weight_int4pack_mm_for_cpu`) were measured here first: correct but 6-20x slower than
the fp32 GEMM on this AVX2 CPU, so unusable; fbgemm's dynamic int8 linear quantizes the
activations too (1-2% error per GEMM), which is not weight-only.

Formats (per output row n, per group g of 32 inputs for int4):
  int8: W[n, k] = q[n, k] * scale[n]              q int8 in [-127, 127], absmax scaling
  int4: W[n, k] = q[n, k] * scale[n, g] + min[n, g]   q in [0, 15] (GGUF Q4_1's form)
Batches above LARGE_BATCH rows (prefill chunks) dequantize the weight to fp32 for that call and
use torch's GEMM, which tiles large problems better than the small-batch kernel.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

logger = logging.getLogger(__name__)

GROUP = 32  # int4 inputs per scale/min pair
LARGE_BATCH = 64
_SOURCE = Path(__file__).with_name("woq_cpu.cpp")
_ext = None


def load_kernels():
    """The compiled kernels (built on first use, then loaded from torch's extension cache)."""
    global _ext
    if _ext is not None:
        return _ext
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        raise RuntimeError(
            f"quantization: the int8/int4 CPU kernels need AVX2 and FMA (this CPU: {capability})"
        )
    from plait.kernels.cpp_build import load_extension

    try:
        _ext = load_extension(
            "plait_woq_cpu", _SOURCE, ["-O3", "-mavx2", "-mfma", "-fopenmp"], ["-fopenmp"]
        )
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, no ninja, build error
        raise RuntimeError(f"quantization: building the CPU kernels failed: {e}") from e
    return _ext


# ----------------------------------------------------------------------------- int8
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale float32 [N])."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


# ----------------------------------------------------------------------------- int4
def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2], scale [N, K/32], min [N, K/32]); asymmetric
    min/max rounding per group of 32 inputs, nibbles in GGUF Q4_1's order."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"quantization: int4 needs in_features divisible by {GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scale = ((hi - lo) / 15.0).clamp(min=1e-12)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low), j + 16 (high)
    return packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous()


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    p = packed.reshape(n, -1, GROUP // 2)
    q = torch.cat((p & 0x0F, p >> 4), dim=-1).float()  # [N, G, 32]
    return (q * scale[..., None] + mins[..., None]).reshape(n, half * 2)


# ----------------------------------------------------------------------------- modules
class _QuantizedLinear(nn.Module):
    """y = x @ W.T + bias with W stored quantized (x: [..., in] float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().clone()

    def dequantized(self) -> torch.Tensor:  # [out, in] float32
        raise NotImplementedError

    def _small_batch(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.shape[0] > LARGE_BATCH:
            out = nn.functional.linear(flat.float(), self.dequantized(), self.bias)
        else:
            out = self._small_batch(flat.float().contiguous())
            if self.bias is not None:
                out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not self.bias)


class Int8Linear(_QuantizedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self._ops = load_kernels()

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale)

    def _small_batch(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.int8_linear(x, self.qweight, self.scale)


class Int4Linear(_QuantizedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        packed, scale, mins = quantize_int4(weight)
        self.register_buffer("qweight", packed, persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("mins", mins, persistent=False)
        self._ops = load_kernels()

    def dequantized(self) -> torch.Tensor:
        return dequantize_int4(self.qweight, self.scale, self.mins)

    def _small_batch(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.int4_linear(x, self.qweight, self.scale, self.mins)


def quantize_linears(model: nn.Module, linear_cls: type[_QuantizedLinear]) -> int:
    """Replace every nn.Linear under `model` by `linear_cls` (its fp32 weight is dropped).
    Returns how many were replaced."""
    replaced = 0
    with torch.inference_mode():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, linear_cls(child.weight, child.bias))
                    replaced += 1
    return replaced
