"""The logit screen's bf16 GEMM (screen_kernel.cpp): on AMX tiles where the CPU has AMX-BF16,
else on AVX512-BF16 vector units; built in a background thread like plait's other CPU
kernels, and the screen runs oneDNN's bf16 linear until it is ready
(plait/runtime/logit_screen.py)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from plait.kernels.cpp_build import BackgroundBuild, cpu_flags

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("screen_kernel.cpp")
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512bf16", "-mamx-tile", "-mamx-bf16",
          "-fopenmp"]
BLOCK = 32  # tokens per packed block, and inputs per tile row (32 bf16: 64 bytes)

_kernel: ModuleType | None = None
_kind: str | None = None  # "amx" or "vector" once loaded


def amx_capable() -> bool:
    """Whether this CPU has the units the AMX path runs on (Linux's flags)."""
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= cpu_flags()


def vector_capable() -> bool:
    """Whether this CPU has the units the vector path runs on (Linux's flags)."""
    return {"avx512_bf16", "avx512bw"} <= cpu_flags()


def kernel_capable() -> bool:
    """Whether either path can run here."""
    return amx_capable() or vector_capable()


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

    return load_extension("plait_screen_kernel", _SOURCE, _FLAGS, ["-fopenmp"])


def _set_kernel(module: ModuleType) -> None:
    global _kernel, _kind
    if amx_capable() and module.amx_available():
        _kind = "amx"
    elif vector_capable():
        _kind = "vector"
    else:  # AMX flags but Linux gives the process no tile state, and no AVX512-BF16
        logger.warning("the logit screen's kernel: no AMX tile state here; oneDNN's GEMM stays")
        return
    _kernel = module


_build = BackgroundBuild("the logit screen's kernel", _load, _set_kernel)


def start_screen_kernel(block: bool = False) -> bool:
    """Build or load screen_kernel.cpp where the CPU has AMX-BF16 or AVX512-BF16, in a
    background thread unless `block`. True when the kernel can be used now."""
    if not kernel_capable():
        return False
    if _kernel is None:
        _build.start(block)
    return _kernel is not None


def screen_kernel() -> ModuleType | None:
    """The loaded module (screen_gemm, screen_gemm_vec), or None."""
    return _kernel


def kernel_kind() -> str | None:
    """"amx" or "vector": the path screen_gemm takes here, once the module is loaded."""
    return _kind if _kernel is not None else None


def screen_gemm(hidden_bf16: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[M, K] bf16 hidden rows x the packed weight -> [M, vocab] bf16 screen values, on this
    CPU's path (the module must be loaded)."""
    fn = _kernel.screen_gemm if _kind == "amx" else _kernel.screen_gemm_vec
    return fn(hidden_bf16, packed, vocab)
