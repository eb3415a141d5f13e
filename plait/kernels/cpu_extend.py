"""Extend (prefill) attention over the KV pool on the CPU (the `torch` backend's extend path).

Two paths, the same contract as `torch_backend.extend_attention_reference`:

* plait's kernel (extend_attn_cpu.cpp): one call per layer for the whole batch; K/V rows are
  read in place through each request's slot list and the grouped-query heads of a kv head
  share each K/V row. Built with torch's cpp_extension (AVX-512 or AVX2 code, whichever the
  CPU runs) in a background thread when a model runner starts, then loaded from torch's
  extension cache; fp32 q (the CPU default) over an fp32 or a bf16 pool (`--kv-cache-dtype
  bfloat16`: its rows are widened to fp32 exactly, the math and the output stay fp32).
* torch's: per request, index_select the KV out of the pool and one fused
  `scaled_dot_product_attention` with `enable_gqa` (`is_causal` when nothing is cached, an
  explicit [E, S] mask otherwise). It runs until the kernel is ready, for other dtypes (a
  bf16 model's q), on CPUs without AVX2 and with `--disable-cpu-extend-kernel`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from plait.kernels.base import AttentionMetadata
from plait.kernels.cpp_build import BackgroundBuild

logger = logging.getLogger(__name__)

_KERNEL_SOURCE = Path(__file__).with_name("extend_attn_cpu.cpp")
_kernel = None  # the compiled extend kernel, once built or loaded
_kernel_width = 0  # floats per vector of the build (head_dim must be a multiple)


def kernel_flags() -> tuple[list[str], int] | None:
    """Compiler flags for this CPU and the vector width they give, or None (no AVX2)."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        isa = ["-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw", "-mfma"]
        return ["-O3", *isa, "-fopenmp"], 16
    if cap == "AVX2":
        return ["-O3", "-mavx2", "-mfma", "-fopenmp"], 8
    return None


def _load_kernel():
    from plait.kernels.cpp_build import load_extension

    flags, width = kernel_flags()
    return load_extension("plait_extend_attn_cpu", _KERNEL_SOURCE, flags, ["-fopenmp"]), width


def _set_kernel(loaded) -> None:
    global _kernel, _kernel_width
    _kernel_width = loaded[1]
    _kernel = loaded[0]


_build = BackgroundBuild("the CPU extend attention kernel", _load_kernel, _set_kernel)


def start_extend_kernel(block: bool = False) -> bool:
    """Build or load the extend attention kernel, in a background thread unless `block` (the
    runner serves on torch's path meanwhile). True when it can be used now."""
    if kernel_flags() is None:
        return False
    if _kernel is None:
        _build.start(block)
    return _kernel is not None


def extend_kernel_ready() -> bool:
    return _kernel is not None


@dataclass
class ExtendPlan:
    """The requests of an extend batch that have new tokens, built once per forward."""

    # [n, 4] int64: (first row in q, prefix length, new tokens, req pool index)
    table: torch.Tensor
    meta: AttentionMetadata = field(repr=False)

    @functools.cached_property
    def requests(self) -> list[tuple[int, int, torch.Tensor, torch.Tensor | None]]:
        """torch's path, per request: (first row in q, new tokens, its KV slots [S] int64,
        the mask [E, S] or None when nothing is cached)."""
        rows = self.meta.req_to_token
        out = []
        for start, pre, ext, pool in self.table.tolist():
            mask = None
            if pre:  # row r sits at position pre + r and sees keys 0..pre + r
                mask = torch.ones(ext, pre + ext, dtype=torch.bool, device=rows.device).tril_(pre)
            out.append((start, ext, rows[pool, : pre + ext].long(), mask))
        return out


def plan_extend(meta: AttentionMetadata) -> ExtendPlan:
    cached = meta.cache.get("cpu_extend_plan")
    if cached is not None:
        return cached
    pools = meta.req_pool_indices.tolist()
    table, start = [], 0
    for i in range(meta.batch_size):
        ext, pre = meta.extend_lens_cpu[i], meta.prefix_lens_cpu[i]
        if ext:
            table.append((start, pre, ext, pools[i]))
        start += ext
    plan = ExtendPlan(torch.tensor(table, dtype=torch.int64).reshape(-1, 4), meta)
    meta.cache["cpu_extend_plan"] = plan
    return plan


# the KV pool dtypes plait's CPU attention kernels read beside fp32 q (decode and extend)
KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16)


def _kernel_suits(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, meta: AttentionMetadata
) -> bool:
    return (
        _kernel is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_buffer.dtype == v_buffer.dtype
        and k_buffer.dtype in KERNEL_POOL_DTYPES
        and q.stride(2) == 1
        and k_buffer.is_contiguous()
        and v_buffer.is_contiguous()
        and q.shape[2] % _kernel_width == 0
        and meta.req_to_token.dtype == torch.int32
    )


def extend_attention_cpu(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    use_kernel: bool = False,
) -> torch.Tensor:
    """q: [T, H, D] -> [T, H, D]; K/V read from the pool (already holding the new tokens).
    `use_kernel`: through extend_attn_cpu.cpp when it has been built and the inputs suit it."""
    plan = plan_extend(meta)
    if use_kernel and _kernel_suits(q, k_buffer, v_buffer, meta):
        return _kernel.extend_attention(
            q, k_buffer, v_buffer, meta.req_to_token, plan.table, scaling
        )
    out = torch.empty_like(q)
    gqa = q.shape[1] != k_buffer.shape[1]
    for start, ext, slots, mask in plan.requests:
        k = k_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, S, D]
        v = v_buffer.index_select(0, slots).to(q.dtype).transpose(0, 1)[None]
        qi = q[start : start + ext].transpose(0, 1)[None]  # [1, H, E, D]
        # nothing cached: square, and the top-left causal mask is the right one
        o = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=gqa
        )
        out[start : start + ext] = o[0].transpose(0, 1)
    return out
