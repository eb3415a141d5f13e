"""Triton kernels and attention backends against the torch reference (plait.kernels.torch_backend).

Without CUDA the kernels run under Triton's interpreter on CPU tensors in fp32 (conftest.py
sets TRITON_INTERPRET=1), with 16-wide blocks so that lengths 15/16/17 straddle block edges.
With CUDA the same checks run compiled on the device in fp32, fp16 and bf16 (`gpu` marker).
Every pool slot that no request owns holds NaN and every output is NaN-filled before a run, so a
stray read or an unwritten element fails the comparison. The interpreter also runs one fp16
case; bf16 is GPU-only because the interpreter's tl.dot reads bf16 operands as raw integer bits
(triton 3.9: a 16x16 bf16 dot is off by ~1e10 there).
"""

from __future__ import annotations

import os
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from plait.kernels import triton_ops as ops
from plait.kernels.base import AttentionMetadata, ForwardMode, create_attention_backend
from plait.kernels.testing import AttentionBatch, make_metadata, random_attention_batch
from plait.kernels.torch_backend import (
    TorchAttnBackend,
    decode_attention_reference,
    extend_attention_reference,
    store_kv_reference,
)
from plait.kernels.triton_backend import TritonAttnBackend
from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool

# without CUDA the kernels run under Triton's interpreter (and one test compiles for Hopper)
pytestmark = pytest.mark.heavy

HAS_CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")]


@dataclass(frozen=True)
class Target:
    device: str
    dtype: torch.dtype
    atol: float
    rtol: float
    small_blocks: bool  # 16-wide blocks (the interpreter) or the launcher's GPU defaults

    def extend_config(self) -> ops.ExtendConfig | None:
        return ops.ExtendConfig(16, 16, 4, 1) if self.small_blocks else None

    def decode_config(self, group: int) -> ops.DecodeConfig | None:
        return ops.DecodeConfig(16, 16, 4, 1) if self.small_blocks else None


# fp32 runs everywhere: interpreted on CPU, compiled on a GPU (where the dot runs in ieee fp32)
FP32 = Target("cuda" if HAS_CUDA else "cpu", torch.float32, 1e-4, 1e-4, not HAS_CUDA)
TARGETS = [
    pytest.param(FP32, id="fp32"),
    pytest.param(Target("cuda", torch.float16, 4e-3, 4e-3, False), id="gpu-fp16", marks=gpu),
    pytest.param(Target("cuda", torch.bfloat16, 3e-2, 3e-2, False), id="gpu-bf16", marks=gpu),
]

# (prefix_lens, extend_lens): block-edge lengths 1/15/16/17 (CPU blocks are 16), a batch with
# no cached prefix, a long prefix (several blocks), and for the GPU's 64/128 blocks 63..129
EXTEND_CASES = {
    "ragged": ([0, 15, 16, 17], [1, 15, 16, 17]),
    "no-prefix": ([0, 0, 0], [1, 16, 33]),
    "long-prefix": ([150, 97], [3, 1]),
}
GPU_EXTEND_CASES = {
    "gpu-edges": ([0, 63, 64, 65, 127], [129, 128, 127, 65, 64]),
    "gpu-long-prefix": ([3000, 1], [200, 1000]),
}
DECODE_SEQ_LENS = [1, 15, 16, 17, 33, 150]
GPU_DECODE_SEQ_LENS = [1, 63, 64, 65, 127, 128, 129, 4097, 300]


def _batch(target: Target, prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim, **kw):
    return random_attention_batch(
        prefix_lens,
        extend_lens,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype=target.dtype,
        device=target.device,
        **kw,
    )


def _nan_like(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan"))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, target: Target) -> None:
    assert not actual.isnan().any(), "NaN in the output: an unwritten element or a stray read"
    torch.testing.assert_close(actual.float(), expected.float(), atol=target.atol, rtol=target.rtol)


def _stored_pool(b: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    k_buffer, v_buffer = b.k_buffer.clone(), b.v_buffer.clone()
    store_kv_reference(k_buffer, v_buffer, b.meta.out_cache_loc, b.k_new, b.v_new)
    return k_buffer, v_buffer


def _reference(fn, b: AttentionBatch, k_buffer, v_buffer, scaling: float) -> torch.Tensor:
    # computed in fp32 from the same (rounded) inputs: the oracle for every dtype
    return fn(b.q.float(), k_buffer.float(), v_buffer.float(), b.meta, scaling)


def _qkv_views(b: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q/k/v as the model passes them: views into one fused projection (row stride > H*D)."""
    t, h, d = b.q.shape
    hkv = b.k_new.shape[1]
    fused = torch.cat([b.q.reshape(t, -1), b.k_new.reshape(t, -1), b.v_new.reshape(t, -1)], dim=1)
    q, k, v = fused.split([h * d, hkv * d, hkv * d], dim=1)
    return q.view(t, h, d), k.view(t, hkv, d), v.view(t, hkv, d)


# ---------------------------------------------------------------------------------------------
# the interpreter really runs


@pytest.mark.skipif(HAS_CUDA, reason="with CUDA the kernels are compiled")
def test_kernels_run_under_the_interpreter_on_cpu_tensors():
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(ops._extend_attn_kernel, InterpretedFunction)
    b = random_attention_batch([0], [3], 2, 1, 16)
    k_buffer, v_buffer = b.k_buffer.clone(), b.v_buffer.clone()
    ops.store_kv(k_buffer, v_buffer, b.meta.out_cache_loc, b.k_new, b.v_new)
    assert k_buffer.device.type == "cpu"
    torch.testing.assert_close(k_buffer[b.meta.out_cache_loc], b.k_new)


@pytest.mark.skipif(HAS_CUDA, reason="the gpu-fp16 cases cover this on a GPU")
def test_fp16_under_the_interpreter():
    half = Target("cpu", torch.float16, 4e-3, 4e-3, True)
    b = _batch(half, [0, 17], [16, 3], 4, 2, 16, seed=11)
    k_buffer, v_buffer = _stored_pool(b)
    out = ops.extend_attention(
        b.q, k_buffer, v_buffer, b.meta, 0.3, out=_nan_like(b.q), config=half.extend_config()
    )
    _assert_close(out, _reference(extend_attention_reference, b, k_buffer, v_buffer, 0.3), half)
    b = _decode_batch(half, [1, 17, 40], 4, 2, 16, seed=12)
    k_buffer, v_buffer = _stored_pool(b)
    out = _run_decode(half, b, k_buffer, v_buffer, 0.3, 2, half.decode_config(2))
    _assert_close(out, _reference(decode_attention_reference, b, k_buffer, v_buffer, 0.3), half)


def test_kernels_compile_for_hopper_without_a_gpu():
    """Interpreter-valid code can still fail to compile; build every kernel for sm_90."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    root = Path(__file__).parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(script)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all kernels compiled for sm_90" in result.stdout


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("target", TARGETS)
def test_store_kv_writes_only_its_slots(target):
    b = _batch(target, [4, 0, 9], [5, 17, 1], 4, 2, 16, seed=1)
    k_buffer, v_buffer = b.k_buffer.clone(), b.v_buffer.clone()
    _, k_new, v_new = _qkv_views(b)  # strided rows, as the model passes them
    loc = b.meta.out_cache_loc.to(torch.int32)
    ops.store_kv(k_buffer, v_buffer, loc, k_new, v_new)
    k_expected, v_expected = _stored_pool(b)
    # bit-exact everywhere: new rows copied, every other slot (NaN or data) untouched
    torch.testing.assert_close(k_buffer, k_expected, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_buffer, v_expected, atol=0, rtol=0, equal_nan=True)


def test_store_kv_casts_to_the_pool_dtype_and_accepts_no_tokens():
    b = _batch(FP32, [2], [6], 2, 2, 16, seed=2)
    k_buffer = b.k_buffer.to(torch.float16)
    v_buffer = b.v_buffer.to(torch.float16)
    ops.store_kv(k_buffer, v_buffer, b.meta.out_cache_loc, b.k_new, b.v_new)
    torch.testing.assert_close(k_buffer[b.meta.out_cache_loc], b.k_new.half(), atol=0, rtol=0)
    torch.testing.assert_close(v_buffer[b.meta.out_cache_loc], b.v_new.half(), atol=0, rtol=0)
    before = k_buffer.clone()
    empty = b.k_new[:0]
    ops.store_kv(k_buffer, v_buffer, b.meta.out_cache_loc[:0], empty, empty)
    torch.testing.assert_close(k_buffer, before, atol=0, rtol=0, equal_nan=True)


def _store_args(**override):
    b = _batch(FP32, [0], [3], 2, 2, 16)
    args = {
        "k_buffer": b.k_buffer,
        "v_buffer": b.v_buffer,
        "loc": b.meta.out_cache_loc,
        "k": b.k_new,
        "v": b.v_new,
    }
    args.update({k: f(args) for k, f in override.items()})
    return args


@pytest.mark.parametrize(
    "override, message",
    [
        ({"loc": lambda a: a["loc"].float()}, "loc has dtype"),
        ({"loc": lambda a: a["loc"][:2]}, "k has 3 rows but loc has 2"),
        ({"k": lambda a: a["k"][:, :1]}, "k has 1 heads, expected 2"),
        ({"v": lambda a: a["v"][..., :8]}, "v has head_dim 8, expected 16"),
        ({"k": lambda a: a["k"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous"),
        ({"v_buffer": lambda a: a["v_buffer"][:-1]}, "must match k_buffer"),
        ({"k": lambda a: a["k"].int()}, "k has dtype torch.int32"),
    ],
)
def test_store_kv_rejects_bad_arguments(override, message):
    with pytest.raises(ValueError, match=message):
        ops.store_kv(**_store_args(**override))


# ---------------------------------------------------------------------------------------------
# extend attention


def _extend_cases(target: Target):
    cases = dict(EXTEND_CASES)
    if not target.small_blocks:
        cases.update(GPU_EXTEND_CASES)
    return cases


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_extend_attention_matches_reference(target, group):
    num_kv_heads, head_dim, scaling = 2, 16, 0.3
    for seed, (name, (prefix_lens, extend_lens)) in enumerate(_extend_cases(target).items()):
        b = _batch(target, prefix_lens, extend_lens, num_kv_heads * group, num_kv_heads,
                   head_dim, seed=seed)  # fmt: skip
        k_buffer, v_buffer = _stored_pool(b)
        out = ops.extend_attention(
            b.q, k_buffer, v_buffer, b.meta, scaling, out=_nan_like(b.q),
            config=target.extend_config(),
        )  # fmt: skip
        expected = _reference(extend_attention_reference, b, k_buffer, v_buffer, scaling)
        try:
            _assert_close(out, expected, target)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}") from None


@pytest.mark.parametrize("target", TARGETS)
def test_extend_attention_odd_head_dim_unequal_blocks_strided_q(target):
    # head_dim 24 pads to a 32-wide block; block_m != block_n; q is a view of a fused qkv
    b = _batch(target, [5, 40], [21, 2], 6, 2, 24, seed=7)
    k_buffer, v_buffer = _stored_pool(b)
    q, _, _ = _qkv_views(b)
    config = ops.ExtendConfig(16, 32, 4, 1) if target.small_blocks else None
    out = ops.extend_attention(
        q, k_buffer, v_buffer, b.meta, 0.2, out=_nan_like(b.q), config=config
    )
    expected = _reference(extend_attention_reference, b, k_buffer, v_buffer, 0.2)
    _assert_close(out, expected, target)


def _extend_args(**override):
    b = _batch(FP32, [2, 0], [3, 4], 4, 2, 16)
    k_buffer, v_buffer = _stored_pool(b)
    args = {"q": b.q, "k_buffer": k_buffer, "v_buffer": v_buffer, "meta": b.meta, "scaling": 0.5}
    args.update({k: f(args) for k, f in override.items()})
    return args


def _meta_with(meta: AttentionMetadata, **fields) -> AttentionMetadata:
    return AttentionMetadata(**{**meta.__dict__, "cache": {}, **fields})


@pytest.mark.parametrize(
    "override, message",
    [
        ({"q": lambda a: a["q"][:, :3]}, "not a multiple of the pool's 2 kv heads"),
        ({"q": lambda a: a["q"].double()}, "q has dtype torch.float64"),
        ({"q": lambda a: a["q"][:5]}, "q has 5 rows but the batch has 7 new tokens"),
        ({"q": lambda a: a["q"][..., :8]}, "q has head_dim 8, expected 16"),
        (
            {"meta": lambda a: _meta_with(a["meta"], seq_lens_cpu=[5, 5])},
            r"request 1: seq_len \(5\) must equal prefix_len \(0\) \+ extend_len \(4\)",
        ),
        (
            {"meta": lambda a: _meta_with(a["meta"], seq_lens=a["meta"].seq_lens.float())},
            "meta.seq_lens has dtype",
        ),
        (
            {"meta": lambda a: _meta_with(a["meta"], prefix_lens=a["meta"].prefix_lens[:1])},
            "meta.prefix_lens has 1 entries for a batch of 2",
        ),
        (
            {"meta": lambda a: _meta_with(a["meta"], req_to_token=a["meta"].req_to_token[:, :4])},
            "req_to_token has only 4 columns",
        ),
        (
            {"meta": lambda a: _meta_with(a["meta"], out_cache_loc=a["meta"].out_cache_loc[:6])},
            "meta.extend_lens_cpu sums to 7 but meta.out_cache_loc has 6 slots",
        ),
        ({"out": lambda a: a["q"][:, :, :8]}, "out must be"),
        ({"config": lambda a: ops.ExtendConfig(24, 16, 4, 1)}, "block_m must be a power of two"),
    ],
)
def test_extend_attention_rejects_bad_arguments(override, message):
    with pytest.raises(ValueError, match=message):
        ops.extend_attention(**_extend_args(**override))


# ---------------------------------------------------------------------------------------------
# decode attention


def _decode_batch(target: Target, seq_lens, num_heads, num_kv_heads, head_dim, seed=0):
    prefix_lens = [s - 1 for s in seq_lens]
    return _batch(target, prefix_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim,
                  mode=ForwardMode.DECODE, seed=seed)  # fmt: skip


def _run_decode(target: Target, b: AttentionBatch, k_buffer, v_buffer, scaling, splits, config):
    num_heads, head_dim = b.q.shape[1], b.q.shape[2]
    if splits is None:  # what the launcher would pick, so the workspace can be poisoned too
        splits = ops.default_num_kv_splits(
            b.meta.batch_size, num_heads, k_buffer.shape[1], b.meta.max_seq_len,
            b.q.device, config,
        )  # fmt: skip
    workspace = tuple(
        t.fill_(float("nan"))
        for t in ops.decode_workspace(b.meta.batch_size, num_heads, head_dim, splits, b.q.device)
    )
    return ops.decode_attention(
        b.q, k_buffer, v_buffer, b.meta, scaling, splits, out=_nan_like(b.q),
        workspace=workspace, config=config,
    )  # fmt: skip


@pytest.mark.parametrize("splits", [1, 3, None, 16], ids=lambda s: f"splits={s}")
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("target", TARGETS)
def test_decode_attention_matches_reference(target, group, splits):
    # 16 splits exceed the blocks of most requests: their trailing splits are empty
    num_kv_heads, head_dim, scaling = 2, 16, 0.3
    seq_lens = DECODE_SEQ_LENS if target.small_blocks else GPU_DECODE_SEQ_LENS
    b = _decode_batch(target, seq_lens, num_kv_heads * group, num_kv_heads, head_dim, seed=group)
    k_buffer, v_buffer = _stored_pool(b)
    out = _run_decode(target, b, k_buffer, v_buffer, scaling, splits, target.decode_config(group))
    expected = _reference(decode_attention_reference, b, k_buffer, v_buffer, scaling)
    _assert_close(out, expected, target)


@pytest.mark.parametrize("target", TARGETS)
def test_decode_attention_query_heads_over_several_programs(target):
    # 32 query heads on one kv head with 16-row head blocks: two programs per kv head
    b = _decode_batch(target, [40, 3], 32, 1, 16, seed=3)
    k_buffer, v_buffer = _stored_pool(b)
    config = (
        ops.DecodeConfig(16, 16, 4, 1) if target.small_blocks else ops.DecodeConfig(64, 16, 4, 3)
    )
    out = _run_decode(target, b, k_buffer, v_buffer, 0.25, 2, config)
    expected = _reference(decode_attention_reference, b, k_buffer, v_buffer, 0.25)
    _assert_close(out, expected, target)


@pytest.mark.parametrize("target", TARGETS)
def test_decode_attention_odd_head_dim_and_strided_q(target):
    b = _decode_batch(target, [20, 1, 50], 4, 2, 24, seed=4)
    k_buffer, v_buffer = _stored_pool(b)
    q, _, _ = _qkv_views(b)
    b.q = q
    out = _run_decode(target, b, k_buffer, v_buffer, 0.2, 2, target.decode_config(2))
    expected = _reference(decode_attention_reference, b, k_buffer, v_buffer, 0.2)
    _assert_close(out, expected, target)


def _decode_args(**override):
    b = _batch(FP32, [2, 0], [1, 1], 4, 2, 16, mode=ForwardMode.DECODE)
    k_buffer, v_buffer = _stored_pool(b)
    args = {"q": b.q, "k_buffer": k_buffer, "v_buffer": v_buffer, "meta": b.meta, "scaling": 0.5}
    args.update({k: f(args) for k, f in override.items()})
    return args


@pytest.mark.parametrize(
    "override, message",
    [
        ({"q": lambda a: a["q"][:1]}, "q has 1 rows for a decode batch of 2"),
        ({"num_kv_splits": lambda a: 0}, "num_kv_splits must be >= 1"),
        (
            {"workspace": lambda a: ops.decode_workspace(2, 4, 16, 3, a["q"].device)},
            "workspace must be",
        ),
        ({"k_buffer": lambda a: a["k_buffer"].half()}, "must match k_buffer"),
        ({"config": lambda a: ops.DecodeConfig(16, 8, 4, 1)}, "block_h must be a power of two"),
    ],
)
def test_decode_attention_rejects_bad_arguments(override, message):
    args = _decode_args(**override)
    if "workspace" in args:
        args["num_kv_splits"] = 2
    with pytest.raises(ValueError, match=message):
        ops.decode_attention(**args)


def test_decode_attention_rejects_a_request_without_its_new_token():
    b = _batch(FP32, [0, 3], [2, 1], 2, 2, 16)  # an extend batch
    with pytest.raises(ValueError, match="extend_len == 1 for every request"):
        ops.decode_attention(b.q[:2], b.k_buffer, b.v_buffer, b.meta, 0.5)


def test_empty_batches_launch_nothing():
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        b = _batch(FP32, [], [], 4, 2, 16, mode=mode)
        attention = ops.decode_attention if mode is ForwardMode.DECODE else ops.extend_attention
        out = attention(b.q, b.k_buffer, b.v_buffer, b.meta, 0.5)
        assert out.shape == (0, 4, 16)
        ops.store_kv(b.k_buffer, b.v_buffer, b.meta.out_cache_loc, b.k_new, b.v_new)


def test_default_num_kv_splits_stays_within_the_sequence():
    cpu = torch.device("cpu")
    assert ops.default_num_kv_splits(1, 8, 8, 1, cpu) == 1
    assert 1 <= ops.default_num_kv_splits(64, 32, 8, 4096, cpu) <= ops.MAX_KV_SPLITS


# ---------------------------------------------------------------------------------------------
# the Triton backend through a real KVPool, as the model runner drives it


class _Session:
    """Requests living in a KVPool/ReqToTokenPool, with forwards for one backend."""

    def __init__(self, target: Target, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16):
        self.target = target
        self.pool = KVPool(96, num_layers, num_kv_heads, head_dim, target.dtype, target.device)
        # scatter the free slots: hand out every slot, free them in a random order
        order = torch.randperm(96, generator=torch.Generator().manual_seed(0))
        self.pool.free(self.pool.alloc(96)[order])
        self.req_pool = ReqToTokenPool(6, 64, target.device)
        self.req_slots: list[int] = []
        self.lens: list[int] = []
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.gen = torch.Generator().manual_seed(1)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.target.device, self.target.dtype)

    def add_request(self, shared_prefix_of: int | None = None, prefix_len: int = 0) -> int:
        slot = self.req_pool.alloc()
        if shared_prefix_of is not None:  # a radix-cache hit: reuse another request's slots
            src = self.req_slots[shared_prefix_of]
            self.req_pool.write(slot, 0, self.req_pool.read(src, prefix_len))
        self.req_slots.append(slot)
        self.lens.append(prefix_len if shared_prefix_of is not None else 0)
        return len(self.req_slots) - 1

    def step_meta(self, mode: ForwardMode, extend_lens: list[int]) -> AttentionMetadata:
        locs = []
        for i, ext in enumerate(extend_lens):
            new = self.pool.alloc(ext)
            self.req_pool.write(self.req_slots[i], self.lens[i], new)
            locs.append(new)
        meta = make_metadata(
            mode,
            list(self.lens),
            extend_lens,
            self.req_pool.req_to_token,
            torch.tensor(self.req_slots),
            torch.cat(locs),
        )
        self.lens = [p + e for p, e in zip(self.lens, extend_lens)]
        return meta

    def qkv(self, num_tokens: int):
        return (
            self.randn(num_tokens, self.num_heads, self.head_dim),
            self.randn(num_tokens, self.num_kv_heads, self.head_dim),
            self.randn(num_tokens, self.num_kv_heads, self.head_dim),
        )


@pytest.mark.parametrize("target", TARGETS)
def test_triton_backend_matches_torch_backend_over_prefill_and_decode(target):
    session = _Session(target)
    ref_pool = KVPool(96, 2, 2, 16, target.dtype, target.device)
    triton_backend = TritonAttnBackend(4, 2, 16, 0.25)
    torch_backend = TorchAttnBackend(4, 2, 16, 0.25)
    for _ in range(3):
        session.add_request()
    steps = [(ForwardMode.EXTEND, [5, 17, 1])]
    steps += [(ForwardMode.DECODE, [1, 1, 1])] * 2
    steps += [("share", None), (ForwardMode.EXTEND, [0, 0, 0, 4])]  # request 3 reuses 1's prefix
    steps += [(ForwardMode.DECODE, [1, 1, 1, 1])]
    for mode, extend_lens in steps:
        if mode == "share":
            session.add_request(shared_prefix_of=1, prefix_len=12)
            continue
        if mode is ForwardMode.EXTEND and 0 in extend_lens:  # only the new request prefills
            keep = [i for i, e in enumerate(extend_lens) if e]
            meta = _extend_only(session, keep, [extend_lens[i] for i in keep])
        else:
            meta = session.step_meta(mode, extend_lens)
        triton_backend.prepare(meta)
        ref_meta = _meta_with(meta)
        for layer in range(2):
            q, k, v = session.qkv(meta.num_tokens)
            out = triton_backend.forward(q, k, v, layer, session.pool, meta)
            expected = torch_backend.forward(q, k, v, layer, ref_pool, ref_meta)
            _assert_close(out, expected, target)
            torch.testing.assert_close(session.pool.k_buffer[layer], ref_pool.k_buffer[layer])
            torch.testing.assert_close(session.pool.v_buffer[layer], ref_pool.v_buffer[layer])


def _extend_only(session: _Session, keep: list[int], extend_lens: list[int]) -> AttentionMetadata:
    """Metadata for a prefill of only the requests in `keep` (the others are not scheduled)."""
    all_slots, all_lens = session.req_slots, session.lens
    session.req_slots = [all_slots[i] for i in keep]
    session.lens = [all_lens[i] for i in keep]
    meta = session.step_meta(ForwardMode.EXTEND, extend_lens)
    for i, new_len in zip(keep, session.lens):
        all_lens[i] = new_len
    session.req_slots, session.lens = all_slots, all_lens
    return meta


def test_triton_backend_prepares_one_decode_plan_for_all_layers():
    session = _Session(FP32)
    backend = create_attention_backend("triton", 4, 2, 16, 0.25)
    assert isinstance(backend, TritonAttnBackend)
    session.add_request()
    session.add_request()
    session.step_meta(ForwardMode.EXTEND, [3, 20])  # KV positions only; no forward needed
    meta = session.step_meta(ForwardMode.DECODE, [1, 1])
    backend.prepare(meta)
    (plan,) = [v for v in meta.cache.values() if hasattr(v, "workspace")]
    for layer in range(2):
        backend.forward(*session.qkv(2), layer, session.pool, meta)
    (same,) = [v for v in meta.cache.values() if hasattr(v, "workspace")]
    assert same is plan
    assert plan.workspace[0].shape == (2, 4, plan.num_kv_splits, 16)


def test_triton_backend_fixed_num_kv_splits():
    backend = TritonAttnBackend(4, 2, 16, 0.25, num_kv_splits=3)
    session = _Session(FP32)
    session.add_request()
    session.step_meta(ForwardMode.EXTEND, [40])
    meta = session.step_meta(ForwardMode.DECODE, [1])
    backend.prepare(meta)
    (plan,) = [v for v in meta.cache.values() if hasattr(v, "workspace")]
    assert plan.num_kv_splits == 3
    with pytest.raises(ValueError, match="num_kv_splits must be >= 1"):
        TritonAttnBackend(4, 2, 16, 0.25, num_kv_splits=0)


# ---------------------------------------------------------------------------------------------
# flash-attn backend (flash-attn is not installed here: a fake module checks the plumbing)


def test_flashattn_backend_without_flash_attn_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` fail
    from plait.kernels.flashattn_backend import FlashAttnBackend

    with pytest.raises(ImportError, match="pip install flash-attn.*'triton' or 'torch'"):
        FlashAttnBackend(4, 2, 16, 0.25)


def test_flashattn_backend_refuses_flash_attn_without_bottom_right_causal(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn("2.0.9"))
    from plait.kernels.flashattn_backend import FlashAttnBackend

    with pytest.raises(ImportError, match=">= 2.1"):
        FlashAttnBackend(4, 2, 16, 0.25)


def _fake_flash_attn(version: str) -> types.ModuleType:
    """flash_attn_varlen_func's contract in torch: packed sequences, GQA, causal mask aligned
    to the bottom right of each (q_len x k_len) block."""

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal):
        assert causal and q.shape[0] == int(cu_q[-1]) and k.shape[0] == int(cu_k[-1])
        out = torch.empty_like(q)
        group = q.shape[1] // k.shape[1]
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            assert qe - qs <= max_q and ke - ks <= max_k
            mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool).tril(
                diagonal=(ke - ks) - (qe - qs)
            )
            out[qs:qe] = torch.nn.functional.scaled_dot_product_attention(
                q[qs:qe].transpose(0, 1),
                k[ks:ke].transpose(0, 1).repeat_interleave(group, 0),
                v[ks:ke].transpose(0, 1).repeat_interleave(group, 0),
                attn_mask=mask,
                scale=softmax_scale,
            ).transpose(0, 1)
        return out

    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_varlen_func = flash_attn_varlen_func
    return module


def test_flashattn_backend_gathers_the_pool_for_varlen_attention(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn("2.6.3"))
    backend = create_attention_backend("flashattn", 4, 2, 16, 0.25)
    torch_backend = TorchAttnBackend(4, 2, 16, 0.25)
    session = _Session(Target("cpu", torch.float32, 1e-5, 1e-5, True))
    ref_pool = KVPool(96, 2, 2, 16, torch.float32)
    for _ in range(3):
        session.add_request()
    for mode, lens in [(ForwardMode.EXTEND, [5, 17, 1]), (ForwardMode.DECODE, [1, 1, 1])]:
        meta = session.step_meta(mode, lens)
        backend.prepare(meta)
        ref_meta = _meta_with(meta)
        for layer in range(2):
            q, k, v = session.qkv(meta.num_tokens)
            out = backend.forward(q, k, v, layer, session.pool, meta)
            expected = torch_backend.forward(q, k, v, layer, ref_pool, ref_meta)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
