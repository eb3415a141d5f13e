"""Triton kernels over the token-granular KV pool: store K/V, extend (prefill) attention and
two-stage flash-decoding attention.

Each kernel is a private `@triton.jit` function with a public launcher that checks shapes,
dtypes, devices and strides (ValueError naming the argument) and never synchronizes with the
device. `plait.kernels.torch_backend` holds the reference each launcher is tested against.

Layout (see `plait.radix_cache.kv_pool`): k_buffer/v_buffer are [num_slots, kv_heads,
head_dim]; request i's KV position p lives in slot req_to_token[req_pool_indices[i], p].
Slots are gathered one row per token, so any slot permutation works (page size 1).

On a machine without CUDA the kernels run under Triton's interpreter: TRITON_INTERPRET=1
must be set before this module is imported (the tests do it in their conftest).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plait.kernels.base import AttentionMetadata

_LOG2E = 1.0 / math.log(2.0)  # exp(x) == exp2(x * log2(e))
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MIN_DOT = 16  # tl.dot needs every block dimension >= 16
_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions (requests go there)


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _store_kv_kernel(
    K,  # [T, kv_heads, head_dim]
    V,
    Loc,  # [T]
    KBuf,  # [num_slots, kv_heads, head_dim]
    VBuf,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + tok).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = KBuf + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = VBuf + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_d[None, :]
    tl.store(k_dst, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(VBuf.dtype.element_ty), mask=mask)


@triton.jit
def _attend_block(
    acc,  # [BLOCK_Q, BLOCK_D] fp32, un-normalized output
    m_i,  # [BLOCK_Q] fp32, running max of the log2-scaled scores
    l_i,  # [BLOCK_Q] fp32, running sum of exp2(score - m_i)
    q,  # [BLOCK_Q, BLOCK_D]
    KBuf,
    VBuf,
    tok_row,  # pointer to req_to_token[req_slot, 0]
    offs_n,  # [BLOCK_N] KV positions of this block
    mask_n,  # [BLOCK_N] positions that exist
    mask_qk,  # [BLOCK_Q, BLOCK_N] (query, key) pairs allowed
    kv_head,
    offs_d,
    mask_d,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    qk_scale,  # softmax scaling * log2(e)
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over a block of KV positions (FlashAttention-2 update)."""
    slots = tl.load(tok_row + offs_n, mask=mask_n, other=0).to(tl.int64)
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        KBuf + slots[:, None] * stride_kbs + kv_head * stride_kbh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_Q, BLOCK_N]
    qk = tl.where(mask_qk, qk, float("-inf"))
    # every caller guarantees each row has an allowed key in its first block, so m_new is finite
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        VBuf + slots[:, None] * stride_vbs + kv_head * stride_vbh + offs_d[None, :],
        mask=kv_mask,
        other=0.0,
    )  # [BLOCK_N, BLOCK_D]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_attn_kernel(
    Q,  # [T, num_heads, head_dim]
    KBuf,  # [num_slots, kv_heads, head_dim], already holding the new tokens
    VBuf,
    O,  # [T, num_heads, head_dim]
    ReqToToken,  # [max_reqs, max_context]
    ReqPoolIdx,  # [B]
    PrefixLens,  # [B]
    ExtendLens,  # [B]
    ExtendStart,  # [B]
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr,  # query heads per kv head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (query head, block of the request's new tokens, request). Heads vary fastest, so
    # the programs running together read the same K/V rows (L2 hits, not DRAM); the last
    # (longest, causally) token blocks go first so the short ones fill the tail.
    head = tl.program_id(0)
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    req = tl.program_id(2)
    ext_len = tl.load(ExtendLens + req)
    if m_start >= ext_len:
        return
    prefix_len = tl.load(PrefixLens + req)
    q_start = tl.load(ExtendStart + req)
    req_slot = tl.load(ReqPoolIdx + req).to(tl.int64)
    kv_head = head // GROUP
    tok_row = ReqToToken + req_slot * stride_r2t

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < ext_len
    mask_d = offs_d < HEAD_DIM
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # 1) the cached prefix: every new token sees all of it, only the tail block is masked
    for n_start in range(0, prefix_len, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < prefix_len
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, KBuf, VBuf, tok_row, offs_n, mask_n, mask_n[None, :], kv_head,
            offs_d, mask_d, stride_kbs, stride_kbh, stride_vbs, stride_vbh, qk_scale,
            DOT_PRECISION,
        )  # fmt: skip

    # 2) the new tokens, causally: row m (position prefix_len + m) sees keys <= its position,
    # so this query block never needs keys past its last row
    q_pos = prefix_len + offs_m
    kv_end = prefix_len + tl.minimum(m_start + BLOCK_M, ext_len)
    for n_start in range(prefix_len, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        mask_qk = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, KBuf, VBuf, tok_row, offs_n, mask_n, mask_qk, kv_head,
            offs_d, mask_d, stride_kbs, stride_kbh, stride_vbs, stride_vbh, qk_scale,
            DOT_PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(
        O + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(O.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


@triton.jit
def _split_len(seq_len, num_kv_splits, BLOCK_N: tl.constexpr):
    # KV positions per split, rounded up to whole blocks; stage 1 and stage 2 agree on it
    return tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _decode_stage1_kernel(
    Q,  # [B, num_heads, head_dim]
    KBuf,
    VBuf,
    MidO,  # [B, num_heads, num_kv_splits, head_dim] fp32, per-split normalized output
    MidLse,  # [B, num_heads, num_kv_splits] fp32, per-split log2-sum-exp2 of the scores
    ReqToToken,
    ReqPoolIdx,
    SeqLens,
    qk_scale,
    num_kv_splits,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_r2t,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,  # programs per kv head: cdiv(GROUP, BLOCK_H)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # grid: (kv head x block of its query heads, split of the KV positions, request). The
    # query heads sharing a kv head are the rows of one tl.dot, so K/V are read once; kv heads
    # vary fastest, so programs running together read neighbouring bytes of the same slots.
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    split = tl.program_id(1)
    req = tl.program_id(2)
    seq_len = tl.load(SeqLens + req)
    split_len = _split_len(seq_len, num_kv_splits, BLOCK_N)
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)
    if split_start >= split_end:
        return  # stage 2 skips the splits past the end
    req_slot = tl.load(ReqPoolIdx + req).to(tl.int64)
    tok_row = ReqToToken + req_slot * stride_r2t

    offs_g = (tl.program_id(0) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    hd_mask = mask_h[:, None] & mask_d[None, :]
    q = tl.load(
        Q + req.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hd_mask,
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for n_start in range(split_start, split_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, KBuf, VBuf, tok_row, offs_n, mask_n, mask_n[None, :], kv_head,
            offs_d, mask_d, stride_kbs, stride_kbh, stride_vbs, stride_vbh, qk_scale,
            DOT_PRECISION,
        )  # fmt: skip

    mid = req.to(tl.int64) * stride_mob + heads[:, None] * stride_moh + split * stride_mos
    tl.store(MidO + mid + offs_d[None, :], acc / l_i[:, None], mask=hd_mask)
    lse = req.to(tl.int64) * stride_mlb + heads * stride_mlh + split
    tl.store(MidLse + lse, m_i + tl.log2(l_i), mask=mask_h)


@triton.jit
def _decode_stage2_kernel(
    MidO,
    MidLse,
    O,  # [B, num_heads, head_dim]
    SeqLens,
    num_kv_splits,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # next_power_of_2(num_kv_splits)
    BLOCK_N: tl.constexpr,  # stage 1's block, for the split boundaries
):
    # grid: (request, query head); merges the splits' partial softmaxes
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(SeqLens + req)
    used_splits = tl.cdiv(seq_len, _split_len(seq_len, num_kv_splits, BLOCK_N))
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < used_splits
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(
        MidLse + req * stride_mlb + head * stride_mlh + offs_s, mask=mask_s, other=float("-inf")
    )  # [BLOCK_S]
    part = tl.load(
        MidO
        + req * stride_mob
        + head * stride_moh
        + offs_s[:, None] * stride_mos
        + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    weight = tl.exp2(lse - tl.max(lse, 0))  # unused splits get exp2(-inf) = 0
    out = tl.sum(weight[:, None] * part, 0) / tl.sum(weight, 0)
    tl.store(
        O + req * stride_ob + head * stride_oh + offs_d, out.to(O.dtype.element_ty), mask=mask_d
    )


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class ExtendConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    block_n: int
    block_h: int
    num_warps: int
    num_stages: int


def _block_d(head_dim: int) -> int:
    return max(_MIN_DOT, triton.next_power_of_2(head_dim))


def _dot_precision(dtype: torch.dtype) -> str:
    # tf32 would cost fp32 callers ~3 decimal digits; half types ignore the setting
    return "ieee" if dtype == torch.float32 else "tf32"


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """CUDA compute capability, or None where the kernels run under the interpreter."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


# GPU block sizes: chosen offline for sm_90 (tests/kernels/hopper_compile.py) as the largest
# tiles that compile without register spills and with pipelined (cp.async) K/V loads. fp32 is
# a correctness path (CPU tests, debugging), kept small rather than fast.
def extend_config(
    head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> ExtendConfig:
    if capability is None:  # the interpreter: fewer, larger blocks run faster
        return ExtendConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if capability < (8, 0):
        return ExtendConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:  # exact fp32 dots run on FMA units, hungry for registers
        return ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=2)
    if _block_d(head_dim) > 128:
        return ExtendConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)
    return ExtendConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def decode_config(
    group: int, head_dim: int, dtype: torch.dtype, capability: tuple[int, int] | None
) -> DecodeConfig:
    # query heads of one kv head fill the rows of one dot (padded to 16), at most 64 per program
    block_h = min(64, max(_MIN_DOT, triton.next_power_of_2(group)))
    if capability is None:
        return DecodeConfig(block_n=32, block_h=block_h, num_warps=4, num_stages=1)
    stages = 3 if capability >= (8, 0) else 1
    if dtype == torch.float32:
        block_n = 16
    else:
        block_n = 32 if _block_d(head_dim) > 128 else 64
    return DecodeConfig(block_n=block_n, block_h=block_h, num_warps=4, num_stages=stages)


# Compile-time parameters of each kernel launch (constexprs, num_warps, num_stages), one
# function per kernel so that the launchers and the offline sm_90 compile check agree.


def store_kv_params(num_kv_heads: int, head_dim: int) -> dict:
    return {
        "NUM_KV_HEADS": num_kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_H": triton.next_power_of_2(num_kv_heads),
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "num_warps": 4 if num_kv_heads * head_dim >= 1024 else 1,
    }


def extend_params(group: int, head_dim: int, dtype: torch.dtype, config: ExtendConfig) -> dict:
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_D": _block_d(head_dim),
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "DOT_PRECISION": _dot_precision(dtype),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def decode_stage1_params(
    group: int, head_dim: int, dtype: torch.dtype, config: DecodeConfig
) -> dict:
    return {
        "GROUP": group,
        "HEAD_BLOCKS": triton.cdiv(group, config.block_h),
        "HEAD_DIM": head_dim,
        "BLOCK_D": _block_d(head_dim),
        "BLOCK_H": config.block_h,
        "BLOCK_N": config.block_n,
        "DOT_PRECISION": _dot_precision(dtype),
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def decode_stage2_params(head_dim: int, num_kv_splits: int, config: DecodeConfig) -> dict:
    return {
        "HEAD_DIM": head_dim,
        "BLOCK_D": triton.next_power_of_2(head_dim),
        "BLOCK_S": triton.next_power_of_2(num_kv_splits),
        "BLOCK_N": config.block_n,
        "num_warps": 4 if head_dim >= 128 else 1,
    }


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


MAX_KV_SPLITS = 64
# Stage 1 should launch several waves of programs: about five fit on an SM at once (39 KiB of
# shared memory each on sm_90), and with ~3 waves or more the last, partial wave costs little.
_PROGRAMS_PER_SM = 16
_MIN_SPLIT_BLOCKS = 2  # shorter splits spend more on the prologue and stage 2 than they save


def default_num_kv_splits(
    batch_size: int,
    num_heads: int,
    num_kv_heads: int,
    max_seq_len: int,
    device: torch.device,
    config: DecodeConfig | None = None,
) -> int:
    """Enough KV splits that stage 1 launches ~16 programs per SM, but no split shorter than
    two blocks. A heuristic, not a measurement: `TritonAttnBackend(num_kv_splits=...)` fixes
    it. Depends only on CPU-side sizes (no device sync)."""
    group = num_heads // num_kv_heads
    config = config or decode_config(group, 0, torch.bfloat16, device_capability(device))
    max_useful = triton.cdiv(max_seq_len, _MIN_SPLIT_BLOCKS * config.block_n)
    max_useful = max(1, min(MAX_KV_SPLITS, max_useful))
    if device.type != "cuda":
        return min(4, max_useful)
    programs = max(1, batch_size * num_kv_heads * triton.cdiv(group, config.block_h))
    return max(1, min(max_useful, triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), programs)))


def decode_workspace(
    batch_size: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage-1 outputs: per-split output [B, H, S, D] and log2-sum-exp2 [B, H, S], fp32.
    Shared by all layers of one forward (the layers run one after another)."""
    mid_o = torch.empty(
        (batch_size, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
    )
    mid_lse = torch.empty(
        (batch_size, num_heads, num_kv_splits), dtype=torch.float32, device=device
    )
    return mid_o, mid_lse


# ---------------------------------------------------------------------------------------------
# argument checks (shape/dtype/device/stride only: reading values would sync with the device)


def _interpreted() -> bool:
    return not isinstance(_store_kv_kernel, triton.runtime.jit.JITFunction)


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (like the other inputs)")
    if device.type != "cuda" and not _interpreted():
        raise ValueError(
            f"{name} is on {device}: compiled Triton kernels need CUDA tensors; on CPU set "
            "TRITON_INTERPRET=1 before importing plait.kernels.triton_ops"
        )


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected float16, bfloat16 or float32")


def _check_index(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, expected int32 or int64")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimension(s), got shape {tuple(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def _check_rows(name: str, t: torch.Tensor, heads: int | None, head_dim: int) -> None:
    # [rows, heads, head_dim] with any row/head strides but unit stride along head_dim
    if t.dim() != 3:
        raise ValueError(f"{name} must be [rows, heads, head_dim], got shape {tuple(t.shape)}")
    if heads is not None and t.shape[1] != heads:
        raise ValueError(f"{name} has {t.shape[1]} heads, expected {heads}")
    if t.shape[2] != head_dim:
        raise ValueError(f"{name} has head_dim {t.shape[2]}, expected {head_dim}")
    if t.stride(2) != 1:
        raise ValueError(f"{name} must be contiguous in head_dim (stride(2) == 1)")


def _check_kv_buffers(k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> None:
    _check_float("k_buffer", k_buffer)
    if k_buffer.dim() != 3:
        raise ValueError(
            f"k_buffer must be [num_slots, kv_heads, head_dim], got {tuple(k_buffer.shape)}"
        )
    if v_buffer.shape != k_buffer.shape or v_buffer.dtype != k_buffer.dtype:
        raise ValueError(
            f"v_buffer {tuple(v_buffer.shape)} {v_buffer.dtype} must match k_buffer "
            f"{tuple(k_buffer.shape)} {k_buffer.dtype}"
        )
    _check_rows("k_buffer", k_buffer, None, k_buffer.shape[2])
    _check_rows("v_buffer", v_buffer, None, k_buffer.shape[2])
    _check_device("v_buffer", v_buffer, k_buffer.device)


def _check_attention_inputs(
    q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, meta: AttentionMetadata
) -> int:
    """Common checks of q, the pool and the per-request metadata; returns the GQA group."""
    _check_kv_buffers(k_buffer, v_buffer)
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    _check_rows("q", q, None, head_dim)
    if q.dtype != k_buffer.dtype:
        raise ValueError(f"q has dtype {q.dtype} but the KV pool holds {k_buffer.dtype}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(
            f"q has {q.shape[1]} heads, not a multiple of the pool's {num_kv_heads} kv heads"
        )
    device = q.device
    _check_device("q", q, device)
    _check_device("k_buffer", k_buffer, device)
    return q.shape[1] // num_kv_heads


@dataclass(frozen=True)
class _MetaFacts:
    max_extend_len: int
    one_token_each: bool  # a valid decode batch


def _check_meta(meta: AttentionMetadata, device: torch.device) -> _MetaFacts:
    # every layer of a forward shares `meta`: check it once (O(batch) Python per layer adds up)
    key = ("triton_ops.checked", device)
    facts = meta.cache.get(key)
    if facts is not None:
        return facts
    batch = meta.batch_size
    if batch > _MAX_GRID_YZ:
        raise ValueError(f"a batch of {batch} requests exceeds the kernels' {_MAX_GRID_YZ}")
    _check_index("meta.req_to_token", meta.req_to_token, 2)
    _check_device("meta.req_to_token", meta.req_to_token, device)
    for name in ("req_pool_indices", "seq_lens", "prefix_lens", "extend_lens", "extend_start_loc"):
        t = getattr(meta, name)
        _check_index(f"meta.{name}", t, 1)
        _check_device(f"meta.{name}", t, device)
        if t.shape[0] != batch:
            raise ValueError(f"meta.{name} has {t.shape[0]} entries for a batch of {batch}")
    if len(meta.prefix_lens_cpu) != batch or len(meta.extend_lens_cpu) != batch:
        raise ValueError("meta.prefix_lens_cpu/extend_lens_cpu must have one entry per request")
    for i, (seq, pre, ext) in enumerate(
        zip(meta.seq_lens_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu)
    ):
        if pre < 0 or ext < 0 or seq != pre + ext:
            raise ValueError(
                f"request {i}: seq_len ({seq}) must equal prefix_len ({pre}) + extend_len ({ext})"
            )
    if meta.max_seq_len > meta.req_to_token.shape[1]:
        raise ValueError(
            f"a request has {meta.max_seq_len} KV positions but req_to_token has only "
            f"{meta.req_to_token.shape[1]} columns"
        )
    if sum(meta.extend_lens_cpu) != meta.num_tokens:
        raise ValueError(
            f"meta.extend_lens_cpu sums to {sum(meta.extend_lens_cpu)} but meta.out_cache_loc "
            f"has {meta.num_tokens} slots"
        )
    facts = meta.cache[key] = _MetaFacts(
        max_extend_len=max(meta.extend_lens_cpu, default=0),
        one_token_each=all(e == 1 for e in meta.extend_lens_cpu),
    )
    return facts


def _check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(
            f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if out.stride(2) != 1:
        raise ValueError("out must be contiguous in head_dim (stride(2) == 1)")
    return out


def _check_block(name: str, value: int) -> None:
    if value < _MIN_DOT or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {_MIN_DOT}, got {value}")


# ---------------------------------------------------------------------------------------------
# launchers


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k_buffer[loc[t]] = k[t] and v_buffer[loc[t]] = v[t] (cast to the pool's dtype).

    k_buffer/v_buffer: [num_slots, kv_heads, head_dim]; loc: [T] int32/int64 slots (distinct,
    in range: not checked, that would sync); k/v: [T, kv_heads, head_dim], any row/head strides.
    """
    _check_kv_buffers(k_buffer, v_buffer)
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    _check_index("loc", loc, 1)
    num_tokens = loc.shape[0]
    for name, t in (("k", k), ("v", v)):
        _check_float(name, t)
        _check_rows(name, t, num_kv_heads, head_dim)
        if t.shape[0] != num_tokens:
            raise ValueError(f"{name} has {t.shape[0]} rows but loc has {num_tokens} slots")
    device = k_buffer.device
    for name, t in (("k_buffer", k_buffer), ("loc", loc), ("k", k), ("v", v)):
        _check_device(name, t, device)
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k, v, loc, k_buffer, v_buffer,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        **store_kv_params(num_kv_heads, head_dim),
    )  # fmt: skip


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    *,
    out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached prefix and themselves.

    q: [T, num_heads, head_dim] (rows grouped by request as meta.extend_start_loc says);
    the pool must already hold the new tokens' K/V (call store_kv first). Returns `out` (or a
    new [T, num_heads, head_dim] tensor): softmax(q k^T * scaling) v over positions
    0..prefix_len + r for the request's r-th new token.
    """
    group = _check_attention_inputs(q, k_buffer, v_buffer, meta)
    facts = _check_meta(meta, q.device)
    if meta.num_tokens != q.shape[0]:
        raise ValueError(
            f"q has {q.shape[0]} rows but the batch has {meta.num_tokens} new tokens "
            "(meta.out_cache_loc)"
        )
    out = _check_out(out, q)
    head_dim = q.shape[2]
    config = config or extend_config(head_dim, q.dtype, device_capability(q.device))
    _check_block("block_m", config.block_m)
    _check_block("block_n", config.block_n)
    if facts.max_extend_len == 0:
        return out
    grid = (q.shape[1], triton.cdiv(facts.max_extend_len, config.block_m), meta.batch_size)
    _extend_attn_kernel[grid](
        q, k_buffer, v_buffer, out,
        meta.req_to_token, meta.req_pool_indices, meta.prefix_lens, meta.extend_lens,
        meta.extend_start_loc,
        scaling * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        meta.req_to_token.stride(0),
        **extend_params(group, head_dim, q.dtype, config),
    )  # fmt: skip
    return out


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    meta: AttentionMetadata,
    scaling: float,
    num_kv_splits: int | None = None,
    *,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Flash-decoding: one query token per request attends over all its KV positions.

    q: [B, num_heads, head_dim], row i for request i. Stage 1 splits each request's KV
    positions into `num_kv_splits` block-aligned ranges and computes a partial softmax per
    (request, kv head, split), the query heads of a kv head together; stage 2 merges the
    splits. num_kv_splits=None picks one from the batch shape (default_num_kv_splits);
    `workspace` (from decode_workspace) lets all layers of a forward share one allocation.
    """
    group = _check_attention_inputs(q, k_buffer, v_buffer, meta)
    facts = _check_meta(meta, q.device)
    batch, num_heads, head_dim = q.shape
    if batch != meta.batch_size:
        raise ValueError(f"q has {batch} rows for a decode batch of {meta.batch_size} requests")
    if not facts.one_token_each:
        raise ValueError("decode needs extend_len == 1 for every request (one new token each)")
    out = _check_out(out, q)
    config = config or decode_config(group, head_dim, q.dtype, device_capability(q.device))
    _check_block("block_n", config.block_n)
    _check_block("block_h", config.block_h)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(
            batch, num_heads, k_buffer.shape[1], meta.max_seq_len, q.device, config
        )
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    if workspace is None:
        workspace = decode_workspace(batch, num_heads, head_dim, num_kv_splits, q.device)
    mid_o, mid_lse = workspace
    if (
        mid_o.shape != (batch, num_heads, num_kv_splits, head_dim)
        or mid_lse.shape != (batch, num_heads, num_kv_splits)
        or mid_o.dtype != torch.float32
        or mid_lse.dtype != torch.float32
        or mid_o.stride(3) != 1
        or mid_lse.stride(2) != 1
    ):
        raise ValueError(
            f"workspace must be decode_workspace({batch}, {num_heads}, {head_dim}, "
            f"{num_kv_splits}): fp32 [B, H, S, D] and [B, H, S], got "
            f"{tuple(mid_o.shape)} {mid_o.dtype} and {tuple(mid_lse.shape)} {mid_lse.dtype}"
        )
    _check_device("workspace", mid_o, q.device)
    _check_device("workspace", mid_lse, q.device)
    if batch == 0:
        return out
    grid1 = (k_buffer.shape[1] * triton.cdiv(group, config.block_h), num_kv_splits, batch)
    _decode_stage1_kernel[grid1](
        q, k_buffer, v_buffer, mid_o, mid_lse,
        meta.req_to_token, meta.req_pool_indices, meta.seq_lens,
        scaling * _LOG2E, num_kv_splits,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        meta.req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        **decode_stage1_params(group, head_dim, q.dtype, config),
    )  # fmt: skip
    _decode_stage2_kernel[(batch, num_heads)](
        mid_o, mid_lse, out, meta.seq_lens, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        **decode_stage2_params(head_dim, num_kv_splits, config),
    )  # fmt: skip
    return out


__all__ = [
    "MAX_KV_SPLITS",
    "DecodeConfig",
    "ExtendConfig",
    "decode_attention",
    "decode_config",
    "decode_workspace",
    "default_num_kv_splits",
    "device_capability",
    "extend_attention",
    "extend_config",
    "store_kv",
]
