"""Exact greedy picks without the fp32 logits GEMM: a bf16 screen, then exact dot products.

A greedy row needs only its argmax, but the fp32 logits GEMM reads the whole output embedding
every step (SmolLM2: 49,152 x 576 floats, 113 MB; ~4.4 ms of a 20 ms batch-1 step and ~6 ms
of a 54 ms batch-32 step on the Xeon VM). The screen runs the same GEMM on bf16 copies (57 MB:
plait/kernels/screen_kernel.cpp on the CPU's AMX or AVX512-BF16 units, 2.1-2.7 ms at batch
1-32 on the Xeon's AMX, 1.8-4.8 on a Zen 4's vectors; oneDNN's bf16 linear until that kernel
is built, and beyond its rows) and bounds
its error for every token; only the tokens whose upper bound reaches the best lower bound (one
to six of 49,152 on SmolLM2's own hidden states) get their exact fp32 dot product, and the
largest of those is the token. The pick is the fp32 GEMM's, not an approximation of it.

The bound, for a hidden row h and the weight row W_j of token j. Write h = hb + hl and W_j =
Wb_j + Wl_j with hb, Wb_j the bf16 roundings (both residuals exact in fp32). Then

    h . W_j = hb . Wb_j + hl . Wb_j + h . Wl_j,

and the screen's value x_j = bf16(fl(hb . Wb_j)) misses it by at most

    |hl . Wb_j| + |h . Wl_j|          <= ||hl|| ||Wb_j|| + ||h|| ||Wl_j||    (Cauchy-Schwarz)
  + the fp32 accumulation of hb . Wb_j <= gamma_H ||hb|| ||Wb_j||  (products of bf16 are exact)
  + the rounding of the sum to bf16    <= 2^-8 / (1 - 2^-8) |x_j|   (taken as 2^-7)

with gamma_H = H u / (1 - H u), u = 2^-24. The fp32 reference (the GEMM the pick must agree
with) is itself within gamma_H ||h|| ||W_j|| of the exact dot product, so both accumulation
terms enter the bound, each doubled as margin: e_j = a ||Wb_j|| + b ||Wl_j|| + 2^-7 |x_j| with
a = ||hl|| + 2 gamma_H (||hb|| + ||h||) and b = ||h|| (fused_cpu.cpp's screen_argmax). The
per-token norms are computed once, when the model loads. A probe checks the bound against the
exact products of the machine's bf16 GEMM at start-up; where it fails, or the CPU has no bf16
units (the GEMM would be emulated, slower than fp32), the logits are computed in full.

Used for a forward whose every logit row only needs its argmax (plait.runtime.sampler.
argmax_suffices: greedy, no logprobs, penalties or pending min_new_tokens); any other forward
computes the logits as before. A grammar's bitmask applies to the picks: only allowed tokens
are screened and computed, as after the mask on full logits. The bf16 GEMM runs in the
forward, the picks (microseconds a row) when the sampler has the rows' masks.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from plait.kernels.cpp_build import cpu_flags
from plait.kernels.fused_ops import fused_ops
from plait.kernels.screen_kernel import (
    kernel_capable,
    kernel_kind,
    pack_weight,
    packed_shape,
    screen_gemm,
    start_screen_kernel,
)
from plait.runtime.hugepages import huge_zeros

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64
# rows up to which screen_kernel.cpp runs the screen's GEMM (beyond, oneDNN's, whose copy
# stays). AMX: at 64 rows and more its tile products outweigh the stream it saves (weight in
# cache: plait-tiny's at 64 rows 2.41 vs 2.14 ms, 128 rows 4.61 vs 3.05; SmolLM2's cold at 128
# rows 7.07 vs 6.12), at 32 and fewer it wins either way (1.46 vs 1.85 ms hot, 2.6-2.7 vs
# 3.3-3.6 cold). AVX512-BF16 vectors (the Zen 4 EPYC VM, SmolLM2 cold): faster than oneDNN at
# every row count measured up to 96 (32 rows 4.8 vs 6.5 ms, 64 9.2 vs 10.8, 96 13.4 vs 14.8)
KERNEL_ROWS = {"amx": 32, "vector": 96}
_OUTPUT_ROUNDING = 2.0**-7  # bf16 keeps 8 bits: 2^-8 relative, doubled as margin
_NORM_SLACK = 1.0 + 1e-5  # the fp32 norms' own rounding


@dataclass
class ScreenedRows:
    """A forward's logit rows as the screen left them: the bf16 screen values and the hidden
    rows, indexed like a [rows, vocab] logits tensor (a list, a slice), so the scheduler hands
    rows around unchanged; `picks` gives each row's maximum and its first index, as
    `amax(-1)` and `argmax(-1)` of the full fp32 rows (masked by a grammar bitmask if given)."""

    screen: LogitScreen
    approx: torch.Tensor  # [N, V] bf16
    hidden: torch.Tensor  # [N, H] float32, contiguous
    hidden_bf16: torch.Tensor  # [N, H]
    valid: int  # tokens >= valid are never picked (they have no text)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.hidden.shape[0], self.screen.vocab_size)

    def __getitem__(self, key) -> ScreenedRows:
        if isinstance(key, list):
            key = torch.tensor(key, dtype=torch.long)
        return ScreenedRows(self.screen, self.approx[key], self.hidden[key].contiguous(),
                            self.hidden_bf16[key].contiguous(), self.valid)

    def picks(self, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(row maximum [N] float32, first argmax [N] int64) over the tokens the bitmask
        ([N, W] int32, the constraint tracker's) allows."""
        s = self.screen
        return fused_ops().screen_argmax(self.approx, self.hidden, self.hidden_bf16, s.weight,
                                         s.w_norm, s.w_rest, s.g, s.c, self.valid, bitmask)


def has_bf16_units() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AMX or AVX512-BF16; Linux's flags)."""
    flags = cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


class LogitScreen:
    """The bf16 copy of the output embedding, its per-token error norms, and the exact pick
    (see the module docstring). `weight` [V, H] float32 stays referenced (the exact dots)."""

    def __init__(self, weight: torch.Tensor, kernel: bool = False,
                 huge_pages: bool = False) -> None:
        self.weight = weight.detach().contiguous()
        self.vocab_size, hidden = self.weight.shape
        with torch.inference_mode():
            wb = self.weight.to(torch.bfloat16)
            wb_f = wb.float()
            self.w_norm = (wb_f.norm(dim=1) * _NORM_SLACK).contiguous()
            self.w_rest = ((self.weight - wb_f).norm(dim=1) * _NORM_SLACK).contiguous()
            del wb_f
            self.packed = torch.ops.mkldnn._reorder_linear_weight(wb, _PACK_BATCH_HINT)
            # the kernel's copy (screen_kernel.cpp), used once the kernel is built and checked
            self.kernel_packed = self._pack_kernel(wb, huge_pages) if kernel else None
        self._kernel_checked = False
        gamma = hidden * 2.0**-24 / (1 - hidden * 2.0**-24)
        self.g = 2 * gamma
        self.c = _OUTPUT_ROUNDING

    @staticmethod
    def _pack_kernel(wb: torch.Tensor, huge_pages: bool) -> torch.Tensor:
        nbytes = math.prod(packed_shape(*wb.shape)) * wb.element_size()
        arena = huge_zeros(nbytes) if huge_pages else None  # a 57 MB stream: 2 MB pages
        return pack_weight(wb, None if arena is None else arena.view(torch.bfloat16))

    @classmethod
    def build(cls, weight: torch.Tensor, kernel: bool = True,
              huge_pages: bool = False) -> LogitScreen | None:
        """The screen for an fp32 CPU weight, or None where it would not pay or not hold. On a
        CPU with AMX-BF16 or AVX512-BF16 (unless not `kernel`) the screen's GEMM moves to
        screen_kernel.cpp once that is built and checked."""
        if (
            weight.device.type != "cpu"
            or weight.dtype != torch.float32
            or not torch.backends.mkldnn.is_available()
            or not has_bf16_units()
        ):
            return None
        try:
            screen = cls(weight, kernel=kernel and kernel_capable(), huge_pages=huge_pages)
            ok = screen.bound_holds(screen.approx_onednn)
        except (RuntimeError, AttributeError) as e:  # an op this torch build lacks
            logger.info("logit screen unavailable (%s); computing full logits", e)
            return None
        if not ok:
            logger.warning("logit screen: the bf16 GEMM exceeds its error bound here; not used")
            return None
        if screen.kernel_packed is not None:
            start_screen_kernel()
        return screen

    def approx(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        """[N, H] bf16 -> [N, V] bf16 screen values: up to KERNEL_ROWS rows screen_kernel.cpp's
        once it is built and its bound checked, else oneDNN's."""
        kind = kernel_kind() if self.kernel_packed is not None else None
        if kind is not None and hidden_bf16.shape[0] <= KERNEL_ROWS[kind]:
            if not self._kernel_checked:
                self._kernel_checked = True
                if self.bound_holds(self.approx_kernel):
                    logger.info("logit screen: bf16 GEMM on %s (screen_kernel.cpp) up to %d "
                                "rows", "AMX tiles" if kind == "amx" else "AVX512-BF16 vectors",
                                KERNEL_ROWS[kind])
                else:
                    logger.warning("logit screen: the %s kernel exceeds the error bound here; "
                                   "oneDNN's GEMM stays", kind)
                    self.kernel_packed = None
                    return self.approx_onednn(hidden_bf16)
            return self.approx_kernel(hidden_bf16)
        return self.approx_onednn(hidden_bf16)

    def approx_onednn(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden_bf16, self.packed, None, "none", [], "")

    def approx_kernel(self, hidden_bf16: torch.Tensor) -> torch.Tensor:
        return screen_gemm(hidden_bf16, self.kernel_packed, self.vocab_size)

    def bounds(self, hidden: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
        """e [N, V]: the screen's error bound for each row and token (torch, for the probe
        and the tests; the kernel computes the same per element)."""
        hb = hidden.to(torch.bfloat16).float()
        h_norm = hidden.double().norm(dim=1)
        a = (hidden.double() - hb.double()).norm(dim=1) + self.g * (hb.double().norm(dim=1) + h_norm)
        return (a[:, None] * self.w_norm.double() + h_norm[:, None] * self.w_rest.double()
                + self.c * approx.double().abs())

    def bound_holds(self, gemm, rows: int = 4) -> bool:
        """The bound against `gemm` (approx_onednn or approx_kernel: this machine's bf16 GEMM)
        on probe rows (float64 products)."""
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(rows, self.weight.shape[1], generator=gen) * 3
        hidden[:, :4] *= 30  # a few large activations, as real hidden states have
        with torch.inference_mode():
            approx = gemm(hidden.to(torch.bfloat16))
            exact = hidden.double() @ self.weight.double().t()
            return bool(((approx.double() - exact).abs() <= self.bounds(hidden, approx)).all())

    def __call__(self, hidden: torch.Tensor, valid: int) -> ScreenedRows | None:
        """hidden [N, H] fp32 screened (the bf16 GEMM: the step's cost); picks come later,
        with the rows' grammar masks. None while the fused kernels are not built (the caller
        computes the logits)."""
        if fused_ops() is None:
            return None
        hidden = hidden.contiguous()
        hb = hidden.to(torch.bfloat16)
        return ScreenedRows(self, self.approx(hb), hidden, hb, valid)
