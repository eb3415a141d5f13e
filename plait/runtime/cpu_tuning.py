"""CPU-only speedups the model runner applies when it runs on the CPU.

* The allocator: glibc serves every allocation over 128 KiB-32 MiB with a fresh mmap and hands
  it back on free, so each forward's large temporaries (logits, gathered K/V) page-fault their
  memory in again, every step. Raising the mmap and trim thresholds keeps freed memory in the
  heap for the next step (what vLLM-CPU gets from preloading tcmalloc). Measured here: a 35 MB
  gather 25 ms -> 6 ms, a 35 MB copy 18 ms -> 3.4 ms.
* (The two oneDNN items below are the fallback: by default the fp32 linears and the logits run
  on plait's panel kernels, plait/kernels/woq.py; these with --disable-cpu-linear-kernel and on
  tensor-parallel ranks.)
* The logits GEMM: [tokens, hidden] x [hidden, vocab] dominates a small model's step (100k
  vocabulary). A oneDNN copy of the weight prepacked in its blocked layout runs it 2-2.5x faster
  than torch.matmul on the plain weight (hidden 256, batch 32: 42 ms -> 15 ms). It costs a
  second copy of the output embedding in memory; the plain weight stays (tied embeddings need it
  for the input lookup).
* The layers' large projections likewise (hidden 768, batch 4: gate_up 2.3 -> 0.5 ms; batch 32:
  2.8 -> 1.7 ms; prefill-sized batches about even); their plain weights are dropped.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_THRESHOLD = 1 << 30
_PACK_BATCH_HINT = 64  # oneDNN's layout choice; measured fast for batches 1..200


def tune_allocator() -> bool:
    """Keep large freed blocks in the heap (glibc only; a no-op elsewhere)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, _THRESHOLD) == 1
    if not ok:
        logger.debug("mallopt refused the thresholds; allocator left as it is")
    return ok


class PackedLinear(torch.nn.Module):
    """y = x @ weight.T + bias through oneDNN, the weight prepacked once (x: [..., in])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def _packable(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
    )


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
    """A prepacked linear for an fp32 CPU weight, or None where oneDNN cannot take it
    (checked against torch's linear on a probe batch)."""
    if not _packable(weight):
        return None
    try:
        with torch.inference_mode():
            packed = PackedLinear(weight, bias)
            probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0))
            expected = torch.nn.functional.linear(probe, weight, bias)
            got = packed(probe)
    except (RuntimeError, AttributeError) as e:  # op missing from this torch build
        logger.info("oneDNN prepacked linear unavailable (%s); using torch", e)
        return None
    tol = 1e-4 * float(expected.abs().max()) + 1e-5
    if got.shape != expected.shape or float((got - expected).abs().max()) > tol:
        logger.warning("oneDNN prepacked linear disagrees with torch; not used")
        return None
    return packed


# the layers' projections gain from prepacking when they are this large (out x in elements);
# smaller ones (e.g. 256 x 256) ran slower through oneDNN than through torch here
MIN_PACKED_LINEAR = 300_000


def pack_layer_linears(model: torch.nn.Module) -> int:
    """Replace the model's large nn.Linear layers by prepacked ones (the plain weight is dropped:
    nothing else reads it). Returns how many were replaced."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            w = child.weight
            if w.numel() < MIN_PACKED_LINEAR or not _packable(w):
                continue
            packed = pack_linear(w, child.bias)
            if packed is not None:
                setattr(parent, name, packed)
                replaced += 1
    return replaced
