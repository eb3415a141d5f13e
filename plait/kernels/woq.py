"""plait's CPU linears: fp32 weights (the default fp32 CPU path) and weight-only quantized ones
(`--quantization int8|int4`), all in one kernel source (woq_cpu.cpp: one AVX-512 and one
AVX2 + FMA build picked at run time, built with torch's cpp_extension on first use and cached
per source version).

Weights are stored in panels of 32 output features, [P, K, 32] (input-major within a panel),
so that the 32 features of one input are one vector load; the GEMM is a register-tiled outer
product over them (woq_cpu.cpp). fp32 weights on an AVX2-only CPU use panels of 24 features
([P, K, 24]: a 4-row x 3-vector tile fills the 16 ymm registers and reads each panel line once
per tile): SmolLM2 batch 32 decode step 122 -> 102 ms, its linears 90 -> 70 ms, batch 8 44 ->
38 ms, batch 1 within noise (A/B in one process on the AVX2 EPYC, 2026-11-25). Small-batch decode reads every weight once per step and does
little arithmetic on it, so its time is the weights' bytes over the memory bandwidth: the
kernels prefetch the weight stream ahead of use. Measured on SmolLM2-135M's shapes (30 layers'
qkv, o, gate_up, down and the logits GEMM, each layer's weights its own so they come from
memory; A/B in one process on the 2-core AVX-512 EPYC) against oneDNN's prepacked fp32 linear
that plait used before: batch 1 1.3-1.5x, 8 1.9x, 16 1.6x, 32 1.4x, 64 1.25x, 128 1.1x,
256-512 1.03-1.06x faster (`python -m benchmarks.quantization --gemms --methods none,onednn`).

Quantized: int8 weights are a quarter of fp32's bytes, int4 an eighth; dequantized in
registers (once per panel and block of rows), the activations stay fp32. torch's own
weight-only ops (`torch._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) were
measured here first: correct but 6-20x slower than the fp32 GEMM on this AVX2 CPU, so
unusable; fbgemm's dynamic int8 linear quantizes the activations too (1-2% error per GEMM),
which is not weight-only.

Formats (per output row n, per group g of 32 inputs for int4):
  fp32: W[n, k]
  int8: W[n, k] = q[n, k] * scale[n]              q int8 in [-127, 127], absmax scaling
  int4: W[n, k] = q[n, k] * scale[n, g] + min[n, g]   q in [0, 15] (GGUF Q4_1's form)
Every batch size runs in the kernels (prefill chunks too: a row block reads a dequantized
panel from a per-thread scratch).

The fp32 linears (PanelLinear) serve from the first forward: until the kernels are built or
loaded (start_linear_kernels, a background thread; about a minute the first time, then a
load from torch's cache) they run as torch's batched matmul over the panels.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

from plait.kernels.cpp_build import BackgroundBuild

logger = logging.getLogger(__name__)

GROUP = 32  # int4 inputs per scale/min pair
PANEL = 32  # output features per panel of the kernels' weight layout
PANEL_AVX2 = 24  # fp32 panels on AVX2-only CPUs: 4 rows x 3 vectors fill the 16 registers
_SOURCE = Path(__file__).with_name("woq_cpu.cpp")
_COMMON_FLAGS = ["-O3", "-fopenmp"]
ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx2", "-mfma"], "avx2": ["-mavx2", "-mfma", "-mf16c"]}
_ext: dict[str, ModuleType] = {}


def available_isas() -> list[str]:
    """The kernel builds this CPU can run, best first (torch's own run-time CPU probe)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(capability, [])


def load_kernels(isa: str | None = None) -> ModuleType:
    """The compiled kernels for `isa` (default: the best this CPU runs), built on first use,
    then loaded from torch's extension cache. Without an `isa`, a failed AVX-512 build
    (an old compiler) falls back to the AVX2 one."""
    isas = available_isas()
    if not isas:
        raise RuntimeError(
            "quantization: the int8/int4 CPU kernels need AVX2 and FMA "
            f"(this CPU: {torch.backends.cpu.get_cpu_capability()})"
        )
    if isa is not None and isa not in isas:
        raise ValueError(f"quantization: this CPU cannot run the {isa} kernels (it runs {isas})")
    for candidate in [isa] if isa else isas:
        try:
            return _load(candidate)
        except RuntimeError as e:
            if isa or candidate == isas[-1]:
                raise
            logger.warning("quantization: %s; trying the %s kernels", e, isas[-1])
    raise AssertionError("unreachable")


def _load(isa: str) -> ModuleType:
    if isa in _ext:
        return _ext[isa]
    from plait.kernels.cpp_build import load_extension, prefetch_flags

    try:
        module = load_extension(
            f"plait_woq_cpu_{isa}", _SOURCE, _COMMON_FLAGS + ISA_FLAGS[isa] + prefetch_flags(),
            ["-fopenmp"],
        )
    except (RuntimeError, OSError, ImportError) as e:  # no compiler, no ninja, build error
        raise RuntimeError(f"building the {isa} int8/int4 CPU kernels failed: {e}") from e
    assert module.isa == isa, (module.isa, isa)
    _ext[isa] = module
    _apply_amx_rows(module)
    return module


# ----------------------------------------------------------------------------- fp32 on AMX
_amx_rows = 0  # fp32 linears of at least this many rows run on AMX tiles (0: never)


def amx_capable() -> bool:
    """Whether this CPU runs the AVX-512 build's fp32-on-AMX path (Linux's flags: AMX tiles
    with bf16, AVX512-BF16 and -BW)."""
    from plait.kernels.cpp_build import cpu_flags

    return ("avx512" in available_isas()
            and {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw"} <= cpu_flags())


def set_fp32_amx_rows(rows: int) -> int:
    """fp32 linears (fp32_linear, fp32_linear_silu) of at least `rows` rows run on the CPU's
    AMX tiles from now on, in every loaded and later loaded AVX-512 build (woq_cpu.cpp's
    "fp32 on AMX": each fp32 value split exactly into three bf16 pieces, six tile products,
    fp32's accuracy); 0: never. Returns the rows in effect in the loaded builds (0 where the
    CPU has no AMX or Linux gives the process no tile state)."""
    global _amx_rows
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"fp32 AMX rows: must be an integer >= 0, got {rows!r}")
    _amx_rows = rows if amx_capable() else 0
    applied = [_apply_amx_rows(m) for m in _ext.values()]
    return max(applied, default=_amx_rows)


def _apply_amx_rows(module: ModuleType) -> int:
    setter = getattr(module, "set_fp32_amx_rows", None)  # the AVX-512 build's
    return setter(_amx_rows) if setter is not None else 0


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = -t.shape[0] % multiple
    return torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t


# ----------------------------------------------------------------------------- fp32
def fp32_panel_width() -> int:
    """Output features per fp32 panel on this CPU: 24 where the best kernel build is AVX2 (its
    4 x 24 register tile; 32-wide panels run as two 16-wide halves there, each pass reading
    every cache line of the panel), else 32 (AVX-512: one vector pair per input)."""
    isas = available_isas()
    return PANEL_AVX2 if isas and isas[0] == "avx2" else PANEL


def to_panels_fp32(weight: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """[N, K] float -> the kernels' layout [P, K, width] (width 32 or 24, default
    fp32_panel_width()), the features zero-padded to P * width."""
    width = width or fp32_panel_width()
    if width not in (PANEL, PANEL_AVX2):
        raise ValueError(f"fp32 panels are {PANEL} or {PANEL_AVX2} features wide, not {width}")
    k = weight.shape[1]
    w = _pad_rows(weight.detach().float(), width)
    return w.reshape(-1, width, k).transpose(1, 2).contiguous()


def from_panels_fp32(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of to_panels_fp32: [N, K]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n]


# ----------------------------------------------------------------------------- int8
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale float32 [N])."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def to_panels_int8(q: torch.Tensor, scale: torch.Tensor,
                   quads: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N]) -> the kernels' layout: (q [P, K, 32], scale [P * 32]), the
    features zero-padded to P * 32. `quads` (the AVX2 build's layout, integer_dot_products): the
    inputs zero-padded to a multiple of 32 and each run of 4 transposed, [P, K/4, 128], byte
    4 j + i of run r holding input 4 r + i of feature j (its integer dot products read a
    feature's 4 inputs as one 32-bit lane)."""
    k = q.shape[1]
    panels = _pad_rows(q, PANEL).reshape(-1, PANEL, k).transpose(1, 2)  # [P, K, 32]
    if quads:
        kp = -(-k // GROUP) * GROUP
        panels = torch.nn.functional.pad(panels, (0, 0, 0, kp - k))
        panels = panels.reshape(-1, kp // 4, 4, PANEL).transpose(2, 3).reshape(-1, kp // 4, 128)
    return panels.contiguous(), _pad_rows(scale, PANEL).contiguous()


def from_panels_int8(panels: torch.Tensor, scale: torch.Tensor, n: int, k: int | None = None):
    """The inverse of to_panels_int8 (either layout; k: the inputs before padding): (q [N, K],
    scale [N])."""
    if panels.shape[2] == 128:  # runs of 4 inputs transposed
        p = panels.shape[0]
        panels = panels.reshape(p, -1, PANEL, 4).transpose(2, 3).reshape(p, -1, PANEL)
    q = panels.transpose(1, 2).reshape(-1, panels.shape[1])
    return q[:n, :k], scale[:n]


# ----------------------------------------------------------------------------- int4
def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (packed uint8 [N, K/2], scale [N, K/32], min [N, K/32]); asymmetric
    min/max rounding per group of 32 inputs, nibbles in GGUF Q4_1's order, scale and min in
    float16 as Q4_1's (a sixth fewer bytes than float32 ones: batch-1 decode reads them all;
    and a Q4_1 checkpoint's own float16 values come back exactly)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"quantization: int4 needs in_features divisible by {GROUP}, got {k}")
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if not bool(w.abs().amax() <= torch.finfo(torch.float16).max):
        raise ValueError("quantization: int4's float16 scales and mins hold weights up to 65504")
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [N, G]
    scale, lo = ((hi - lo) / 15.0).half(), lo.half()
    step = scale.float()[..., None]
    q = torch.where(step > 0, (w - lo.float()[..., None]) / step, 0.0)  # 0 in constant groups
    q = torch.round(q).clamp(0, 15).to(torch.uint8)
    packed = q[..., :16] | (q[..., 16:] << 4)  # byte j: element j (low), j + 16 (high)
    return packed.reshape(n, k // 2).contiguous(), scale.contiguous(), lo.contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Q4_1-ordered nibbles [N, K/2] -> q uint8 [N, K] (0..15)."""
    n, half = packed.shape
    p = packed.reshape(n, -1, GROUP // 2)
    return torch.cat((p & 0x0F, p >> 4), dim=-1).reshape(n, half * 2)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    q = unpack_int4(packed).float().reshape(n, -1, GROUP)  # [N, G, 32]
    return (q * scale.float()[..., None] + mins.float()[..., None]).reshape(n, half * 2)


def to_panels_int4(packed: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor,
                   quads: bool = False):
    """Q4_1 layout -> the kernels': (nibbles uint8 [P, K, 16], scale, min [P, K/32, 32]),
    byte j of input k holding feature j (low nibble) and j + 16 (high) of the panel; the
    features zero-padded to P * 32 (padding dequantizes to 0). `quads` (the AVX2 build's
    layout, integer_dot_products): the same bytes with each run of 4 inputs transposed, [P, K/4,
    64], byte 4 j + i of run r holding input 4 r + i of features j and j + 16, so that its
    integer dot products read a feature's 4 inputs as one 32-bit lane."""
    k = packed.shape[1] * 2
    q = _pad_rows(unpack_int4(packed), PANEL).reshape(-1, PANEL, k).transpose(1, 2)  # [P, K, 32]
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    if quads:
        nibbles = nibbles.reshape(-1, k // 4, 4, 16).transpose(2, 3).reshape(-1, k // 4, 64)

    def per_group(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [P, G, 32]
        return _pad_rows(t, PANEL).reshape(-1, PANEL, t.shape[1]).transpose(1, 2).contiguous()

    return nibbles.contiguous(), per_group(scale), per_group(mins)


def from_panels_int4(nibbles: torch.Tensor, scale: torch.Tensor, mins: torch.Tensor, n: int):
    """The inverse of to_panels_int4 (either layout): Q4_1 layout (packed [N, K/2], scale,
    min [N, K/32])."""
    if nibbles.shape[2] == 64:  # runs of 4 inputs transposed
        nibbles = nibbles.reshape(nibbles.shape[0], -1, 16, 4).transpose(2, 3)
        nibbles = nibbles.reshape(nibbles.shape[0], -1, 16)
    k = nibbles.shape[1]
    q = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=-1)  # [P, K, 32]
    q = q.transpose(1, 2).reshape(-1, k // GROUP, GROUP)[:n]  # [N, G, 32]
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [P, G, 32] -> [N, G]
        return t.transpose(1, 2).reshape(-1, t.shape[1])[:n]

    return packed, per_row(scale), per_row(mins)


def integer_dot_products(isa: str) -> bool:
    """Whether a kernel build's int8/int4 linears are integer dot products (AVX2: tile_int4_q8,
    tile_int8_q8, as llama.cpp's Q4_1/Q8_0 x Q8; 1.2-2x its float paths): their panels hold
    each run of 4 inputs transposed (to_panels_int8/int4 `quads`) and every row's inputs are
    rounded to int8 per group of 32 (quantize_inputs_q8). The AVX-512 build's float paths take
    the plain panels and give the dequantized weights' result to float rounding."""
    return isa == "avx2"


def quantize_inputs_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the int8/int4 kernels' integer tiles see of x [M, K]: per group of 32 inputs (the
    last zero-padded), dx = max |x| / 127 and q = round(x / dx): (q * dx as float [M, K], dx
    [M, ceil(K/32)]); their reference."""
    k = x.shape[1]
    g = torch.nn.functional.pad(x.float(), (0, -k % GROUP)).reshape(x.shape[0], -1, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    dx = amax / 127.0
    return (torch.round(g * inv) * dx).reshape(x.shape[0], -1)[:, :k], dx.squeeze(-1)


# ----------------------------------------------------------------------------- modules
class _PanelLinear(nn.Module):
    """y = x @ W.T + bias with W in the kernels' panel layout (x: [..., in] float32)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach().float().clone()

    def dequantized(self) -> torch.Tensor:  # [out, in] float32, the kernels' reference
        raise NotImplementedError

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def kernel_call(self) -> tuple | None:
        """(fn, operands): fn(x, *operands) is this linear without bias for a contiguous
        float32 x [M, in] (the model's lean layer loop calls it directly); None while no kernel
        runs it."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._linear(x.reshape(-1, self.in_features).float().contiguous())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers() if t is not self.bias)


class PanelLinear(_PanelLinear):
    """An fp32 linear on plait's kernels (the default CPU path for float32 models); torch's
    batched matmul over the same panels until start_linear_kernels' build is ready."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.register_buffer("panels", to_panels_fp32(weight), persistent=False)  # [P, K, 24|32]

    # forwards of at least bf16_rows rows run on packed_bf16 (use_bf16_from); 0: never
    bf16_rows = 0

    def dequantized(self) -> torch.Tensor:
        return from_panels_fp32(self.panels, self.out_features)

    def use_bf16_from(self, rows: int) -> None:
        """From `rows` rows on, multiply in bf16 through oneDNN (the CPU's AMX or AVX512-BF16
        units) on a bf16 copy of the weight, the rows rounded to bf16; fewer rows keep the fp32
        panels. One step's linears at SmolLM2's shapes, weights from memory, the fp32 logits
        included (benchmarks/quantization.py --gemms, Intel Xeon VM): 1.23x at 32 rows, 1.56x
        at 64, 1.80x at 128, 2.15x at 512."""
        self.bf16_rows = rows
        # in oneDNN's own layout (an opaque tensor, so not a buffer): the same results as torch's
        # linear on the bf16 weight, 1.5x faster at 64 rows (a 3072 x 576 weight)
        self.packed_bf16 = torch.ops.mkldnn._reorder_linear_weight(
            self.dequantized().bfloat16().contiguous(), rows)

    def kernel_call(self) -> tuple | None:
        ops = _linear_ops
        return None if ops is None else (ops.fp32_linear, (self.panels, self.out_features))

    def takes_bf16(self, rows: int) -> bool:
        """Whether a forward of `rows` rows multiplies in bf16 (use_bf16_from)."""
        return 0 < self.bf16_rows <= rows

    def bf16_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] (fp32 or bf16) @ W.T in bf16, left in bf16 [M, out], without bias (for a
        caller that consumes bf16: the MLP's silu * up and its down projection)."""
        return torch.ops.mkldnn._linear_pointwise(
            x.bfloat16().contiguous(), self.packed_bf16, None, "none", [], "")

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_bf16(x.shape[0]):
            return self.bf16_product(x).float()
        ops = _linear_ops
        if ops is not None:
            return ops.fp32_linear(x, self.panels, self.out_features)
        out = torch.matmul(x, self.panels)  # [P, M, width]
        out = out.transpose(0, 1).reshape(x.shape[0], self.panels.shape[0] * self.panels.shape[2])
        return out[:, : self.out_features].contiguous()


def gate_up_order(intermediate: int) -> torch.Tensor:
    """The rows of a fused [gate; up] weight in GateUpPanelLinear's panel order: per 16
    features, the 16 gate rows, then the same features' 16 up rows (a 32-feature panel: its
    first vector the gate's, its second the up's)."""
    blocks = torch.arange(intermediate).view(-1, 16)
    return torch.cat((blocks, blocks + intermediate), dim=1).reshape(-1)


class GateUpPanelLinear(PanelLinear):
    """An MLP's fused gate_up projection whose panels pair each gate feature with its up
    feature, so that fp32_linear_silu returns silu(gate) * up in one pass: the product
    [M, 2 I] is never written, and no separate silu_mul pass reads it back (SmolLM2 at batch
    32: that pass took ~1.4 ms of a decode step, mostly the product's cache lines moving
    between the cores). Bit for bit the unfused path's result (fused_cpu.cpp's silu_mul, which
    is torch's): the same panel products, then the same elementwise arithmetic. Where the
    fused kernel does not run (the AVX2 build, kernels still loading), `forward` gives the plain
    product in its usual order and `silu_product` the product through ops.silu_mul."""

    def __init__(self, weight: torch.Tensor) -> None:
        intermediate = weight.shape[0] // 2
        order = gate_up_order(intermediate)
        _PanelLinear.__init__(self, weight, None)
        self.intermediate = intermediate
        self.register_buffer("panels", to_panels_fp32(weight[order], PANEL), persistent=False)
        self.register_buffer("inverse", torch.argsort(order), persistent=False)

    @classmethod
    def applies(cls, linear: nn.Module) -> bool:
        """Whether a gate_up projection can take this form: a PanelLinear without bias in
        32-feature panels, its intermediate width a multiple of 32 (silu_mul's vector pairs:
        no scalar tail, as in torch)."""
        return (type(linear) is PanelLinear and linear.bias is None
                and linear.panels.shape[2] == PANEL and linear.out_features % 64 == 0)

    @classmethod
    def from_panel_linear(cls, linear: PanelLinear) -> GateUpPanelLinear:
        return cls(linear.dequantized())

    def dequantized(self) -> torch.Tensor:  # [2 I, in] in the plain order (gate; up)
        return from_panels_fp32(self.panels, self.out_features)[self.inverse]

    def _fused(self):
        ops = _linear_ops
        return getattr(ops, "fp32_linear_silu", None) if ops is not None else None

    def kernel_call(self) -> tuple | None:
        """fp32_linear_silu (the lean loops take its [M, I] output as the MLP's activation) where
        the loaded build has it, else fp32_linear (whose product is in the panel order: not
        usable as the plain one, so None then)."""
        fn = self._fused()
        return None if fn is None else (fn, (self.panels, self.out_features))

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_bf16(x.shape[0]):
            return self.bf16_product(x).float()
        return super()._linear(x)[:, self.inverse]  # the panels' order back to gate; up

    def silu_product(self, x: torch.Tensor, ops) -> torch.Tensor:
        """silu(gate) * up of x [T, in] -> [T, I] (ops: FusedOps, for the unfused path)."""
        fn = self._fused()
        if fn is not None and not self.takes_bf16(x.shape[0]):
            x2 = x.reshape(-1, self.in_features).float().contiguous()
            return fn(x2, self.panels, self.out_features).view(*x.shape[:-1], self.intermediate)
        return ops.silu_mul(self(x))


class _QuantizedLinear(_PanelLinear):
    """A weight-only quantized linear; `isa` picks a kernel build (default: the best this CPU
    runs), loaded (or built) here: there is no torch fallback for these formats."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, isa: str | None) -> None:
        super().__init__(weight, bias)
        self._ops = load_kernels(isa)

    @property
    def isa(self) -> str:
        return self._ops.isa


class Int8Linear(_QuantizedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        super().__init__(weight, bias, isa)
        q, scale = to_panels_int8(*quantize_int8(weight), quads=integer_dot_products(self.isa))
        self.register_buffer("qweight", q, persistent=False)  # [P, K, 32] or [P, K/4, 128]
        self.register_buffer("scale", scale, persistent=False)  # [P * 32]

    def dequantized(self) -> torch.Tensor:
        return dequantize_int8(*from_panels_int8(self.qweight, self.scale, self.out_features,
                                                 self.in_features))

    def kernel_call(self) -> tuple:
        return self._ops.int8_linear, (self.qweight, self.scale, self.out_features)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.int8_linear(x, self.qweight, self.scale, self.out_features)


class Int4Linear(_QuantizedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 isa: str | None = None) -> None:
        super().__init__(weight, bias, isa)
        nibbles, scale, mins = to_panels_int4(*quantize_int4(weight),
                                              quads=integer_dot_products(self.isa))
        self.register_buffer("qweight", nibbles, persistent=False)  # [P, K, 16] or [P, K/4, 64]
        self.register_buffer("scale", scale, persistent=False)  # [P, K/32, 32]
        self.register_buffer("mins", mins, persistent=False)

    def dequantized(self) -> torch.Tensor:
        q4_1 = from_panels_int4(self.qweight, self.scale, self.mins, self.out_features)
        return dequantize_int4(*q4_1)

    def kernel_call(self) -> tuple:
        return self._ops.int4_linear, (self.qweight, self.scale, self.mins, self.out_features)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.int4_linear(x, self.qweight, self.scale, self.mins, self.out_features)


def quantize_linears(model: nn.Module, linear_cls: type[_PanelLinear]) -> int:
    """Replace every nn.Linear under `model` by `linear_cls` (its plain weight is dropped).
    Returns how many were replaced."""
    replaced = 0
    with torch.inference_mode():
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    setattr(parent, name, linear_cls(child.weight, child.bias))
                    replaced += 1
    return replaced


def kernel_entry(call: tuple) -> tuple:
    """A linear's kernel_call (fn, operands) as (name, (address, signature), operands): the
    form fused_cpu.cpp's DecodeLayers calls it in, from the entry points of the kernel module
    that fn belongs to."""
    fn, operands = call
    name = fn.__name__
    for module in {id(m): m for m in (*_ext.values(), _linear_ops) if m is not None}.values():
        if getattr(module, name, None) is fn:
            return name, module.entry_points()[name], operands
    raise ValueError(f"{name} is not a loaded woq kernel")


# ----------------------------------------------------------------------------- background load
_linear_ops: ModuleType | None = None  # the kernels PanelLinear runs on, once loaded


def _set_linear_ops(module: ModuleType) -> None:
    global _linear_ops
    _linear_ops = module


_build = BackgroundBuild("the CPU linear kernels", load_kernels, _set_linear_ops)


def linear_ops() -> ModuleType | None:
    """The loaded kernels PanelLinear runs on (fp32_linear), or None before they load."""
    return _linear_ops


def start_linear_kernels(block: bool = False) -> bool:
    """Build or load the kernels for PanelLinear, in a background thread unless `block`.
    True when they run now."""
    if not available_isas():
        return False
    if _linear_ops is None:
        _build.start(block)
    return _linear_ops is not None
