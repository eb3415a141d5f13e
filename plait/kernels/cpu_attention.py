"""Fast torch attention over the KV pool for the CPU (the `torch` backend's kernels).

`plait.kernels.torch_backend` keeps the plain references that every kernel is tested against;
these are the paths the CPU actually runs:

* extend: plait.kernels.cpu_extend (re-exported here); but an extend of a few rows per request
  over a prefix that requests share (speculative verifies in a tree) attends as decode rows,
  below (plan_rows).
* decode, "cascade": requests whose KV starts with the same pool slots (a radix-cache hit on a
  shared rubric, system prompt or tree root) are grouped once per forward; each group's shared
  prefix is read from the pool once and attended by all its queries together (n members x G
  query heads as the rows of each kv head), and each request's own suffix separately. The two
  partial results are merged with their log-sum-exps.
* decode on a CPU with AVX2 or AVX-512, fp32 queries and an fp32 or bf16 KV pool
  (`--kv-cache-dtype bfloat16`: widened to fp32 as it is read): plait's own kernel
  (attn_cpu.cpp, built for the widest of the two the CPU has) reads K/V rows in place through
  the slot lists, for the suffixes and for the shared prefixes, and merges them; no gathered
  copy. It is compiled with torch's cpp_extension in a background thread when a model runner
  starts (about a minute the first time, then loaded from torch's extension cache); until it
  is ready, and on other CPUs, dtypes or with `--disable-cpu-attention-kernel`, torch's path
  runs: a padded gather of each request's suffix (one `index_select`) and of each shared
  prefix, attended by torch's fused flash kernel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from plait.kernels.base import AttentionMetadata, ForwardMode
from plait.kernels.cpp_build import BackgroundBuild
from plait.kernels.cpu_extend import (  # noqa: F401
    KERNEL_POOL_DTYPES,
    ExtendPlan,
    extend_attention_cpu,
    plan_extend,
)

logger = logging.getLogger(__name__)

_KERNEL_SOURCE = Path(__file__).with_name("attn_cpu.cpp")
# one source, built for the widest vector ISA the CPU has (torch's own dispatch level)
_KERNEL_FLAGS = {
    "avx512": [
        "-O3",
        "-mavx512f",
        "-mavx512bw",
        "-mavx512dq",
        "-mavx512vl",
        "-mavx2",
        "-mfma",
        "-fopenmp",
    ],
    "avx2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],
}
_kernel = None  # the compiled decode kernel, once built or loaded


def kernel_isa() -> str | None:
    """The vector ISA to build the decode kernel for on this CPU (None: no kernel)."""
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(torch.backends.cpu.get_cpu_capability())


def decode_kernel_flags(isa: str) -> list[str]:
    """The compiler flags of the decode kernel for `isa` (its prefetches go to L2 on every CPU:
    attn_cpu.cpp's header)."""
    return list(_KERNEL_FLAGS[isa])


def load_decode_kernel(isa: str):
    """Build (once) or load the decode kernel compiled for `isa` ("avx512" or "avx2")."""
    from plait.kernels.cpp_build import load_extension

    return load_extension(f"plait_attn_cpu_{isa}", _KERNEL_SOURCE, decode_kernel_flags(isa),
                          ["-fopenmp"])


def _set_kernel(module) -> None:
    global _kernel
    _kernel = module


_build = BackgroundBuild(
    "the CPU decode attention kernel", lambda: load_decode_kernel(kernel_isa()), _set_kernel
)


def start_decode_kernel(block: bool = False) -> bool:
    """Build or load the decode attention kernel (AVX-512 or AVX2, as the CPU allows), in a
    background thread unless `block` (the runner starts serving on torch's path meanwhile).
    True when it can be used now."""
    if kernel_isa() is None:
        return False
    if _kernel is None:
        _build.start(block)
    return _kernel is not None


def decode_kernel_ready() -> bool:
    return _kernel is not None


def decode_kernel():
    """The loaded attn_cpu.cpp module (decode_attention, merge_prefix), or None."""
    return _kernel


# a shared prefix shorter than this is attended with the rest (the grouping costs more)
MIN_SHARED_PREFIX = 32


@dataclass
class PrefixGroup:
    members: torch.Tensor  # [n] int64, batch rows sharing the prefix
    slots: torch.Tensor  # [P] int64, the shared prefix's pool slots

    @property
    def kernel_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefix as the kernel's one sequence: slots [1, P], lens [1] (built once)."""
        cached = self.__dict__.get("_kernel_slots")
        if cached is None:
            cached = self.__dict__["_kernel_slots"] = (
                self.slots[None],
                torch.tensor([self.slots.numel()], dtype=torch.int64),
            )
        return cached


@dataclass
class DecodePlan:
    groups: list[PrefixGroup]
    suffix_slots: torch.Tensor  # [B, Ls] int64, each request's KV after its group's prefix
    suffix_valid: torch.Tensor  # [B, Ls] bool
    suffix_lens: torch.Tensor  # [B] int64, each request's suffix length (>= 1)
    masks: dict = field(default_factory=dict)  # additive padding masks by dtype, built once

    @property
    def shared_tokens(self) -> int:
        """KV rows read once per group instead of once per member (for the stats)."""
        return sum(int(g.slots.numel()) * (int(g.members.numel()) - 1) for g in self.groups)


def plan_decode(meta: AttentionMetadata, min_shared: int = MIN_SHARED_PREFIX) -> DecodePlan:
    """Group the batch by shared KV prefix (same pool slots) and index each request's suffix."""
    cached = meta.cache.get("cpu_decode_plan")
    if cached is not None:
        return cached
    plan = _plan_rows(meta, meta.req_pool_indices, meta.seq_lens_cpu, min_shared)
    meta.cache["cpu_decode_plan"] = plan
    return plan


# an extend that adds at most this many tokens to each request (a speculative verify: each
# request's pending token and its draft), and at most ROWS_MAX_TOTAL in all, may attend row by
# row, like a decode (plan_rows). The total keeps it to the shapes measured: verifies have at
# most --speculative-ngram-max-rows rows (24 by default)
ROWS_MAX_EXTEND = 16
ROWS_MAX_TOTAL = 64


def plan_rows(meta: AttentionMetadata, min_shared: int = MIN_SHARED_PREFIX) -> DecodePlan | None:
    """A decode's plan (plan_decode); for an extend, the plan of its query rows as decode rows
    when that reads less KV, else None (the extend path).

    Row r of a request whose KV held `pre` tokens is a decode row over pre + r + 1 keys (its
    own K/V and its predecessors' are stored before attention, so the slot lists alone make it
    causal). Taken when every request adds at most ROWS_MAX_EXTEND rows (ROWS_MAX_TOTAL in all)
    and some shared prefix spans two requests: the group's prefix is then read once for all
    their rows (a tree's branches verifying drafts over one root, each of 30 layers), where the
    extend kernel reads each request's whole KV. Each row reads its own suffix after the prefix
    (short, and cached after the request's first row).

    Also taken, shared or not, when at least half the requests add one row: a constrained
    batch whose few requests feed their jump-forward text while the rest decode one token
    each ride along. Those steps are a decode with a few extra rows; as decode rows they run
    in the C++ layer loop on the decode kernel's prefetching reads (SmolLM2's JSON extraction
    in-process, four runs each: its 11 such forwards 427-459 -> 394-432 ms, the batch
    1,054-1,105 -> 1,010-1,059 ms). A verify step where most requests carry drafts keeps the
    extend kernel (all of them as decode rows measured 0.96-0.98x at batch 4)."""
    if meta.mode is ForwardMode.DECODE:
        return plan_decode(meta, min_shared)
    if "cpu_rows_plan" in meta.cache:
        return meta.cache["cpu_rows_plan"]
    plan = None
    ext_lens = meta.extend_lens_cpu
    small = 0 < max(ext_lens) <= ROWS_MAX_EXTEND and sum(ext_lens) <= ROWS_MAX_TOTAL
    riders = 2 * ext_lens.count(1) >= len(ext_lens)  # most requests add one row (docstring)
    if small and (riders or (meta.batch_size > 1 and _requests_share_a_slot(meta))):
        pools, lens, owner = [], [], []
        for i, (pool, pre, ext) in enumerate(zip(
            meta.req_pool_indices.tolist(), meta.prefix_lens_cpu, meta.extend_lens_cpu
        )):
            pools += [pool] * ext
            lens += range(pre + 1, pre + ext + 1)
            owner += [i] * ext
        index = torch.tensor(pools, dtype=torch.int64, device=meta.req_pool_indices.device)
        rows = _plan_rows(meta, index, lens, min_shared)
        if riders or any(len({owner[m] for m in g.members.tolist()}) > 1 for g in rows.groups):
            plan = meta.cache["cpu_decode_plan"] = rows  # (the stats' shared_kv_tokens)
    meta.cache["cpu_rows_plan"] = plan
    return plan


def _requests_share_a_slot(meta: AttentionMetadata) -> bool:
    """Whether two requests' KV starts at the same pool slot: the only way a group of
    _plan_rows spans two requests (checked before building a plan that would be dropped:
    verify forwards of requests with nothing shared are most of them)."""
    firsts = meta.req_to_token[meta.req_pool_indices, 0].tolist()
    return len(set(firsts)) < len(firsts)


def _plan_rows(meta: AttentionMetadata, pools: torch.Tensor, seq_lens: list[int],
               min_shared: int) -> DecodePlan:
    """plan_decode for query rows whose KV is req_to_token[pools[b], :seq_lens[b]]."""
    device = meta.req_to_token.device
    bsz = len(seq_lens)
    rows = meta.req_to_token[pools, : max(seq_lens, default=0)]  # [B, L] int32
    prefix = [0] * bsz
    groups: list[PrefixGroup] = []
    by_first: dict[int, list[int]] = {}
    if bsz > 1 and rows.shape[1] > min_shared:
        for b, first in enumerate(rows[:, 0].tolist()):
            by_first.setdefault(first, []).append(b)
    for members in by_first.values():
        # the prefix stops before every member's last token (its own, new this step)
        limit = min(seq_lens[b] for b in members) - 1
        if len(members) < 2 or limit < min_shared:
            continue
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        sub = rows[idx, :limit]
        same = (sub == sub[:1]).all(dim=0)  # [limit]
        shared = limit if bool(same.all()) else int((~same).int().argmax())
        if shared < min_shared:
            continue
        groups.append(PrefixGroup(idx, sub[0, :shared].long()))
        for b in members:
            prefix[b] = shared
    suffix_lens = [s - p for s, p in zip(seq_lens, prefix)]
    width = max(suffix_lens, default=0)
    offsets = torch.tensor(prefix, dtype=torch.int64, device=device)
    pos = torch.arange(width, device=device)[None, :]
    valid = pos < torch.tensor(suffix_lens, device=device)[:, None]
    cols = (offsets[:, None] + pos).clamp_(max=max(rows.shape[1] - 1, 0))
    slots = torch.where(valid, rows.gather(1, cols).long(), 0)
    return DecodePlan(groups, slots, valid, torch.tensor(suffix_lens, dtype=torch.int64))


def decode_attention_cpu(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    use_kernel: bool = False,
) -> torch.Tensor:
    """q: [B, H, D] (one token per request) -> [B, H, D]. `use_kernel`: through attn_cpu.cpp
    when it has been built (start_decode_kernel) and the inputs suit it.

    A kv head's G query heads are attended as G query rows of that head ([B, Hkv, G, D]), so
    grouped-query attention needs no repeated K/V; K/V are strided views of one gather.
    An extend's rows go the same way when plan_rows takes them (q: [T, H, D])."""
    plan = plan_rows(meta)
    bsz, num_heads, head_dim = q.shape
    num_kv = k_buffer.shape[1]
    group = num_heads // num_kv
    qg = q.reshape(bsz, num_kv, group, head_dim)
    kernel = _kernel if use_kernel else None
    if (
        kernel is not None
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_buffer.dtype == v_buffer.dtype in KERNEL_POOL_DTYPES
        and head_dim % 8 == 0
        and k_buffer.is_contiguous()
        and v_buffer.is_contiguous()
    ):  # K/V read in place through the slot lists, prefixes included
        out, lse = kernel.decode_attention(
            qg, k_buffer, v_buffer, plan.suffix_slots, plan.suffix_lens, scaling
        )
        for g in plan.groups:
            # every member's query heads against one read of the prefix: [1, Hkv, n*G, D]
            qs = _prefix_queries(qg, g)
            p_out, p_lse = kernel.decode_attention(qs, k_buffer, v_buffer, *g.kernel_slots, scaling)
            kernel.merge_prefix(out, lse, g.members, p_out, p_lse)
        return out.reshape(bsz, num_heads, head_dim)
    width = plan.suffix_slots.shape[1]
    flat = plan.suffix_slots.reshape(-1)
    k = k_buffer.index_select(0, flat).view(bsz, width, num_kv, head_dim).transpose(1, 2)
    v = v_buffer.index_select(0, flat).view(bsz, width, num_kv, head_dim).transpose(1, 2)
    mask = _padding_mask(plan, q.dtype)  # [B, 1, 1, Ls]
    out, lse = _attend(qg, k.to(q.dtype), v.to(q.dtype), mask, scaling)  # [B, Hkv, G, D]
    for g in plan.groups:
        n = g.members.numel()
        qs = _prefix_queries(qg, g)
        kp = k_buffer.index_select(0, g.slots).to(q.dtype).transpose(0, 1)[None]  # [1, Hkv, P, D]
        vp = v_buffer.index_select(0, g.slots).to(q.dtype).transpose(0, 1)[None]
        p_out, p_lse = _attend(qs, kp, vp, None, scaling)
        p_out = p_out[0].view(num_kv, n, group, head_dim).transpose(0, 1)  # [n, Hkv, G, D]
        p_lse = p_lse[0].view(num_kv, n, group).transpose(0, 1)  # [n, Hkv, G]
        s_out, s_lse = out.index_select(0, g.members), lse.index_select(0, g.members)
        new_lse = torch.logaddexp(p_lse, s_lse)
        merged = (
            p_out.float() * torch.exp(p_lse - new_lse)[..., None]
            + s_out.float() * torch.exp(s_lse - new_lse)[..., None]
        )
        out[g.members] = merged.to(out.dtype)
    return out.reshape(bsz, num_heads, head_dim)


def _prefix_queries(qg: torch.Tensor, g: PrefixGroup) -> torch.Tensor:
    """The members' query rows per kv head, member-major: [B, Hkv, G, D] -> [1, Hkv, n*G, D]."""
    _, num_kv, group, head_dim = qg.shape
    n = g.members.numel()
    return qg.index_select(0, g.members).transpose(0, 1).reshape(1, num_kv, n * group, head_dim)


def _padding_mask(plan: DecodePlan, dtype: torch.dtype) -> torch.Tensor:
    key = ("mask", dtype)
    mask = plan.masks.get(key)
    if mask is None:
        valid = plan.suffix_valid[:, None, None, :]
        mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
        mask.masked_fill_(~valid, float("-inf"))
        plan.masks[key] = mask
    return mask


def _attend(q, k, v, mask, scaling):
    """q [B, Hkv, Lq, D] over k/v [B, Hkv, L, D] (mask: additive, broadcast to [B, Hkv, Lq, L])
    -> out [B, Hkv, Lq, D] and the log-sum-exp of the scaled scores [B, Hkv, Lq] (float32)."""
    if q.device.type == "cpu" and _FLASH_CPU is not None:
        out, lse = _FLASH_CPU(q, k, v, 0.0, False, attn_mask=mask, scale=scaling)
        return out, lse.float()
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scaling
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(q.dtype), v), lse


# torch's fused CPU attention that also returns the log-sum-exp (private, hence the fallback)
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
