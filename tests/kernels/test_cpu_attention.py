"""The CPU attention paths (plait.kernels.cpu_attention) against the plain torch references.

Pools are poisoned (plait.kernels.testing): a read outside a request's KV gives NaN. Shared
prefixes are made the way the radix cache makes them: several requests' req->token rows point
at the same pool slots for their first tokens.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels.base import ForwardMode
from plait.kernels.cpu_attention import (
    MIN_SHARED_PREFIX,
    decode_attention_cpu,
    extend_attention_cpu,
    plan_decode,
    plan_extend,
)
from plait.kernels.testing import random_attention_batch
from plait.kernels.torch_backend import (
    decode_attention_reference,
    extend_attention_reference,
    store_kv_reference,
)

SCALE = 0.3


def _share(batch, owner: int, members: list[int], length: int) -> None:
    """Point the first `length` KV slots of each member at the owner's (a radix-cache hit)."""
    rows = batch.meta.req_to_token
    owner_row = int(batch.meta.req_pool_indices[owner])
    for m in members:
        rows[int(batch.meta.req_pool_indices[m]), :length] = rows[owner_row, :length]


def _stored(batch):
    k, v = batch.k_buffer.clone(), batch.v_buffer.clone()
    store_kv_reference(k, v, batch.meta.out_cache_loc, batch.k_new, batch.v_new)
    return k, v


def _check(fn, ref, batch):
    k, v = _stored(batch)
    out = fn(batch.q, k, v, batch.meta, SCALE)
    expected = ref(batch.q, k, v, batch.meta, SCALE)
    assert not out.isnan().any(), "NaN: a read outside the request's KV"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize(
    "prefix_lens,extend_lens",
    [
        ([0, 15, 16, 17], [1, 15, 16, 17]),
        ([0, 0, 0], [1, 16, 33]),
        ([150, 97, 0], [3, 1, 40]),
    ],
    ids=["ragged", "no-prefix", "long-prefix"],
)
def test_extend_matches_reference(prefix_lens, extend_lens, group):
    b = random_attention_batch(prefix_lens, extend_lens, 2 * group, 2, 16, seed=group)
    _check(extend_attention_cpu, extend_attention_reference, b)


def test_extend_over_a_shared_prefix_matches_reference():
    b = random_attention_batch([100, 100, 100], [5, 1, 9], 4, 2, 16, seed=3)
    _share(b, 0, [1, 2], 80)
    _check(extend_attention_cpu, extend_attention_reference, b)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_without_sharing_matches_reference(group):
    lens = [0, 14, 15, 16, 32, 149]
    b = random_attention_batch(lens, [1] * len(lens), 2 * group, 2, 16,
                               mode=ForwardMode.DECODE, seed=group)
    assert plan_decode(b.meta).groups == []
    _check(decode_attention_cpu, decode_attention_reference, b)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_decode_with_shared_prefixes_matches_reference(group):
    # two groups (prefixes 40 and 100), one member whose whole cached KV is the prefix, a
    # request with a short shared prefix (not grouped) and one alone
    lens = [60, 70, 40, 120, 101, 150, 80, 90]
    b = random_attention_batch(lens, [1] * len(lens), 2 * group, 2, 16,
                               mode=ForwardMode.DECODE, seed=10 + group)
    _share(b, 0, [1, 2], 40)
    _share(b, 3, [4, 5], 100)
    _share(b, 6, [7], MIN_SHARED_PREFIX - 1)
    plan = plan_decode(b.meta)
    found = sorted((sorted(g.members.tolist()), g.slots.numel()) for g in plan.groups)
    assert found == [([0, 1, 2], 40), ([3, 4, 5], 100)]
    _check(decode_attention_cpu, decode_attention_reference, b)


def test_decode_finds_the_first_difference_not_the_shortest_member():
    # members share 50 slots although the shortest has 90 cached: the prefix is 50
    b = random_attention_batch([90, 200], [1, 1], 4, 2, 8, mode=ForwardMode.DECODE, seed=5)
    _share(b, 0, [1], 50)
    (g,) = plan_decode(b.meta).groups
    assert g.slots.numel() == 50
    _check(decode_attention_cpu, decode_attention_reference, b)


def test_plans_are_built_once_per_forward():
    b = random_attention_batch([64, 64], [1, 1], 4, 2, 8, mode=ForwardMode.DECODE)
    _share(b, 0, [1], 64)
    assert plan_decode(b.meta) is plan_decode(b.meta)
    e = random_attention_batch([0, 20], [5, 3], 4, 2, 8)
    plan = plan_extend(e.meta)
    assert plan is plan_extend(e.meta)
    assert [(start, ext) for start, ext, _, _ in plan.requests] == [(0, 5), (5, 3)]
    assert plan.requests[0][3] is None and plan.requests[1][3].shape == (3, 23)


def test_decode_without_the_fused_cpu_kernel_matches_reference(monkeypatch):
    # the portable path (torch builds without the private fused op, or non-CPU tensors)
    import plait.kernels.cpu_attention as cpu

    monkeypatch.setattr(cpu, "_FLASH_CPU", None)
    lens = [60, 70, 40, 15]
    b = random_attention_batch(lens, [1] * 4, 4, 2, 16, mode=ForwardMode.DECODE, seed=7)
    _share(b, 0, [1, 2], 40)
    _check(decode_attention_cpu, decode_attention_reference, b)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 3e-2), (torch.float16, 4e-3)])
def test_half_precision_pools_match_the_fp32_reference(dtype, tol):
    # `--dtype bfloat16` on a CPU: the fused kernels, the additive mask and the merge in bf16
    d = random_attention_batch([60, 70, 40, 15], [1] * 4, 4, 2, 16, mode=ForwardMode.DECODE,
                               seed=7, dtype=dtype)
    _share(d, 0, [1, 2], 40)
    e = random_attention_batch([0, 30, 5], [7, 3, 20], 4, 2, 16, seed=8, dtype=dtype)
    for fn, ref, b in ((decode_attention_cpu, decode_attention_reference, d),
                       (extend_attention_cpu, extend_attention_reference, e)):
        k, v = _stored(b)
        out = fn(b.q, k, v, b.meta, SCALE)
        assert out.dtype == dtype
        expected = ref(b.q.float(), k.float(), v.float(), b.meta, SCALE)
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


# ---------------------------------------------------------------- attn_cpu.cpp (AVX2 decode)
@pytest.fixture(scope="module")
def decode_kernel():
    import plait.kernels.cpu_attention as cpu

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("the decode kernel needs AVX2")
    assert cpu.start_decode_kernel(block=True), "the decode kernel failed to build"
    return cpu


def _kernel_decode(q, k, v, meta, scale):
    # the conditions under which decode_attention_cpu takes the kernel (else it falls back)
    assert k.is_contiguous() and k.dtype == q.dtype == torch.float32
    return decode_attention_cpu(q, k, v, meta, scale, use_kernel=True)


@pytest.mark.heavy
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [16, 64, 72])
def test_decode_kernel_without_sharing_matches_reference(decode_kernel, group, head_dim):
    lens = [0, 1, 14, 15, 16, 32, 149]  # ragged: every tail length mod 8
    b = random_attention_batch(lens, [1] * len(lens), 3 * group, 3, head_dim,
                               mode=ForwardMode.DECODE, seed=group + head_dim)
    _check(_kernel_decode, decode_attention_reference, b)


@pytest.mark.heavy
@pytest.mark.parametrize("group", [1, 3])
def test_decode_kernel_with_shared_prefixes_matches_reference(decode_kernel, group):
    # the suffixes go through the kernel, the groups' prefixes through flash; merged by lse
    lens = [60, 70, 40, 120, 101, 150, 80, 90]
    b = random_attention_batch(lens, [1] * len(lens), 2 * group, 2, 64,
                               mode=ForwardMode.DECODE, seed=20 + group)
    _share(b, 0, [1, 2], 40)  # member 2: its whole cached KV is the prefix (suffix length 1)
    _share(b, 3, [4, 5], 100)
    assert len(plan_decode(b.meta).groups) == 2
    _check(_kernel_decode, decode_attention_reference, b)


@pytest.mark.heavy
def test_decode_kernel_rejects_slots_outside_the_pool(decode_kernel):
    q = torch.randn(1, 2, 2, 16)
    k = v = torch.randn(10, 2, 16)
    with pytest.raises(RuntimeError, match="slot out of range"):
        decode_kernel._kernel.decode_attention(
            q, k, v, torch.tensor([[3, 10]]), torch.tensor([2]), 0.25
        )


@pytest.mark.heavy
def test_a_lock_left_by_a_killed_build_does_not_block_loading(decode_kernel):
    """torch's build lock file, left behind by a process killed mid-build, would make every
    later load wait forever; load_extension removes it under its own flock."""
    import threading

    from plait.kernels.cpp_build import build_directory, extension_name, load_extension

    source = decode_kernel._KERNEL_SOURCE
    cflags, ldflags = ["-O3", "-mavx2", "-mfma", "-fopenmp"], ["-fopenmp"]
    name = extension_name("plait_attn_cpu", source.read_text(), cflags, ldflags)
    (build_directory(name) / "lock").touch()
    loaded = []
    t = threading.Thread(target=lambda: loaded.append(load_extension(
        "plait_attn_cpu", source, cflags, ldflags)), daemon=True)
    t.start()
    t.join(timeout=120)
    assert loaded and hasattr(loaded[0], "decode_attention"), "load waited on the stale lock"
