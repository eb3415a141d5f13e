"""The logit screen's bf16 GEMM on AMX tiles (screen_amx.cpp): built where the CPU has AMX-BF16,
in a background thread like plait's other CPU kernels; the screen runs oneDNN's bf16 linear
until it is ready (plait/runtime/logit_screen.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from plait.kernels.cpp_build import BackgroundBuild, cpu_flags

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("screen_amx.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
          "-fopenmp"]
BLOCK = 32  # tokens per packed block, and inputs per tile row (32 bf16: 64 bytes)

_kernel: ModuleType | None = None


def amx_capable() -> bool:
    """Whether this CPU has the units the kernel runs on (Linux's flags)."""
    flags = cpu_flags()
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= flags


def packed_shape(vocab: int, hidden: int) -> tuple[int, int, int, int, int, int]:
    """pack_weight's layout for a [vocab, hidden] weight (both rounded up to 32)."""
    return (-(-vocab // BLOCK), -(-hidden // BLOCK), 2, 16, 16, 2)


def pack_weight(weight_bf16: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[V, K] bf16 -> the kernel's layout [V'/32, K'/32, 2, 16, 16, 2] (V', K' rounded up to 32,
    zero-padded): per block of 32 tokens and 32 inputs, two tiles (tokens 0-15, 16-31) of 16
    input pairs x 16 tokens x 2. `out`: a contiguous bf16 tensor of that many elements to
    write it to (on huge pages, say)."""
    v, k = weight_bf16.shape
    shape = packed_shape(v, k)
    vp, kp = shape[0] * BLOCK, shape[1] * BLOCK
    padded = torch.zeros(vp, kp, dtype=torch.bfloat16)
    padded[:v, :k] = weight_bf16
    blocks = padded.view(vp // BLOCK, 2, 16, kp // BLOCK, 16, 2).permute(0, 3, 1, 4, 2, 5)
    if out is None:
        return blocks.contiguous()
    packed = out.view(shape)
    packed.copy_(blocks)
    return packed


def _load() -> ModuleType:
    from plait.kernels.cpp_build import load_extension

    module = load_extension("plait_screen_amx", _SOURCE, _FLAGS, ["-fopenmp"])
    if not module.available():
        raise RuntimeError("Linux gives this process no AMX tile state")
    return module


def _set_kernel(module: ModuleType) -> None:
    global _kernel
    _kernel = module


_build = BackgroundBuild("the logit screen's AMX kernel", _load, _set_kernel)


def start_screen_kernel(block: bool = False) -> bool:
    """Build or load screen_amx.cpp where the CPU has AMX-BF16, in a background thread unless
    `block`. True when the kernel can be used now."""
    if not amx_capable():
        return False
    if _kernel is None:
        _build.start(block)
    return _kernel is not None


def screen_kernel() -> ModuleType | None:
    """The loaded module (screen_gemm), or None."""
    return _kernel
