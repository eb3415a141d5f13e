"""plait's extend attention kernel (extend_attn_cpu.cpp) against the plain torch reference.

Pools are poisoned (plait.kernels.testing): a read outside a request's KV gives NaN. Cases
cover what the kernel's tiling has edges for: cached prefixes crossing its 128-key blocks,
several requests per call, new rows split over several tiles (more than 192 query rows),
single-token extends (speculative verification), grouped-query heads, shared prefixes (radix
hits), and q as the strided view the model passes (q and k come out of one rotated tensor).
A bf16 pool under fp32 q (`--kv-cache-dtype bfloat16`) gives bitwise the fp32 pool's result.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels import cpu_extend
from plait.kernels.cpu_extend import extend_attention_cpu, plan_extend
from plait.kernels.testing import random_attention_batch
from plait.kernels.torch_backend import extend_attention_reference, store_kv_reference

pytestmark = pytest.mark.heavy  # compiles the kernel (once per machine, then cached)

SCALE = 0.3


@pytest.fixture(scope="module")
def kernel():
    if cpu_extend.kernel_flags() is None:
        pytest.skip("the extend kernel needs AVX2")
    assert cpu_extend.start_extend_kernel(block=True), "the extend kernel failed to build"
    return cpu_extend._kernel


def _share(batch, owner: int, members: list[int], length: int) -> None:
    """Point the first `length` KV slots of each member at the owner's (a radix-cache hit)."""
    rows = batch.meta.req_to_token
    owner_row = int(batch.meta.req_pool_indices[owner])
    for m in members:
        rows[int(batch.meta.req_pool_indices[m]), :length] = rows[owner_row, :length]


def _run(kernel, batch, q=None):
    """The kernel itself (no fallback) and the reference, on the pool holding the new rows."""
    k, v = batch.k_buffer.clone(), batch.v_buffer.clone()
    store_kv_reference(k, v, batch.meta.out_cache_loc, batch.k_new, batch.v_new)
    q = batch.q if q is None else q
    table = plan_extend(batch.meta).table
    out = kernel.extend_attention(q, k, v, batch.meta.req_to_token, table, SCALE)
    return out, extend_attention_reference(batch.q, k, v, batch.meta, SCALE)


def _check(kernel, batch, q=None):
    out, expected = _run(kernel, batch, q)
    assert not out.isnan().any(), "NaN: a read outside the request's KV"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


# --- a bf16 pool (`--kv-cache-dtype bfloat16` for an fp32 model): q, math and out stay fp32 ---
# The kernel widens each bf16 K/V row to fp32 exactly and then runs the fp32 code in the same
# order, so its output equals, bit for bit, its output over an fp32 pool of the same values.
# The pools stay poisoned (NaN is NaN in bf16): a read outside a request's KV still shows.


def _pools(batch):
    """The bf16 pool holding the new rows (rounded to bf16 as they are stored) and the fp32
    pool of the same values."""
    k, v = batch.k_buffer.to(torch.bfloat16), batch.v_buffer.to(torch.bfloat16)
    store_kv_reference(k, v, batch.meta.out_cache_loc, batch.k_new, batch.v_new)
    return k, v, k.float(), v.float()


def _check_bf16_pool(kernel, batch, q=None):
    k, v, k32, v32 = _pools(batch)
    q = batch.q if q is None else q
    rows, table = batch.meta.req_to_token, plan_extend(batch.meta).table
    out = kernel.extend_attention(q, k, v, rows, table, SCALE)
    assert out.dtype == torch.float32
    assert not out.isnan().any(), "NaN: a read outside the request's KV"
    assert torch.equal(out, kernel.extend_attention(q, k32, v32, rows, table, SCALE))


# each kernel test runs on an fp32 pool (against the reference) and on a bf16 one (against the
# fp32 pool of its values)
CHECKS = {"fp32": _check, "bf16": _check_bf16_pool}


def _width_ok(head_dim: int) -> bool:
    return head_dim % cpu_extend._kernel_width == 0


CASES = {
    "ragged": ([0, 15, 16, 17], [1, 15, 16, 17]),
    "no-prefix": ([0, 0, 0], [1, 16, 33]),
    # prefixes and sequences crossing the 128-key blocks, by one and by many
    "long-prefix": ([150, 97, 0, 127, 128], [3, 1, 40, 1, 129]),
    # more new rows than one tile holds: equal tiles, the causal limit inside each
    "many-tiles": ([0, 70], [200, 131]),
    # speculative verification: a few new tokens each over long contexts
    "verify": ([300, 301, 45, 46], [1, 2, 4, 3]),
}


@pytest.mark.parametrize("pool", list(CHECKS))
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference(kernel, case, group, pool):
    prefix_lens, extend_lens = CASES[case]
    b = random_attention_batch(prefix_lens, extend_lens, 2 * group, 2, 16, seed=group)
    CHECKS[pool](kernel, b)


@pytest.mark.parametrize("pool", list(CHECKS))
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256])
def test_kernel_head_dims(kernel, head_dim, pool):
    if not _width_ok(head_dim):
        pytest.skip(f"head_dim {head_dim} is not a multiple of this build's vector width")
    b = random_attention_batch([0, 60, 200], [70, 9, 33], 9, 3, head_dim, seed=head_dim)
    CHECKS[pool](kernel, b)


@pytest.mark.parametrize("pool", list(CHECKS))
def test_kernel_over_a_shared_prefix(kernel, pool):
    # the judge's shape: requests whose KV starts with the same pool slots (a cached rubric)
    b = random_attention_batch([300, 300, 300, 280], [60, 1, 57, 9], 9, 3, 64, seed=3)
    _share(b, 0, [1, 2, 3], 250)
    CHECKS[pool](kernel, b)


@pytest.mark.parametrize("pool", list(CHECKS))
def test_kernel_reads_q_as_a_strided_view(kernel, pool):
    # the model passes q = rotated_qk[:, :H]: token stride (H + Hkv) * D, not H * D
    b = random_attention_batch([40, 0], [25, 30], 6, 2, 32, seed=4)
    qk = torch.randn(b.q.shape[0], 8, 32)
    qk[:, :6] = b.q
    q = qk[:, :6]
    assert not q.is_contiguous()
    CHECKS[pool](kernel, b, q)


def test_kernel_leaves_other_dtypes_to_torch(kernel):
    # bf16 pools (--dtype bfloat16) take torch's path, still matching the fp32 reference
    b = random_attention_batch([30, 0], [7, 20], 4, 2, 16, seed=8, dtype=torch.bfloat16)
    k, v = b.k_buffer.clone(), b.v_buffer.clone()
    store_kv_reference(k, v, b.meta.out_cache_loc, b.k_new, b.v_new)
    out = extend_attention_cpu(b.q, k, v, b.meta, SCALE, use_kernel=True)
    assert out.dtype == torch.bfloat16
    expected = extend_attention_reference(b.q.float(), k.float(), v.float(), b.meta, SCALE)
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=3e-2)


def test_the_backend_path_takes_the_kernel(kernel, monkeypatch):
    """extend_attention_cpu(use_kernel=True) runs the kernel when it is loaded (not torch's
    per-request loop) and gives the reference's result."""
    b = random_attention_batch([100, 5], [20, 30], 6, 2, 16, seed=9)
    k, v = b.k_buffer.clone(), b.v_buffer.clone()
    store_kv_reference(k, v, b.meta.out_cache_loc, b.k_new, b.v_new)
    monkeypatch.setattr(cpu_extend.F, "scaled_dot_product_attention", None)  # torch's path fails
    out = extend_attention_cpu(b.q, k, v, b.meta, SCALE, use_kernel=True)
    monkeypatch.undo()
    expected = extend_attention_reference(b.q, k, v, b.meta, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_kernel_rejects_slots_outside_the_pool(kernel):
    b = random_attention_batch([10], [5], 4, 2, 16, seed=5)
    k, v = b.k_buffer.clone(), b.v_buffer.clone()
    b.meta.req_to_token[int(b.meta.req_pool_indices[0]), 3] = k.shape[0]
    with pytest.raises(RuntimeError, match="slot out of range"):
        kernel.extend_attention(b.q, k, v, b.meta.req_to_token, plan_extend(b.meta).table, SCALE)


def test_kernel_rejects_rows_outside_q(kernel):
    b = random_attention_batch([10], [5], 4, 2, 16, seed=6)
    table = torch.tensor([[3, 10, 5, int(b.meta.req_pool_indices[0])]])  # rows 3..7 of 5
    with pytest.raises(RuntimeError, match="table row out of range"):
        kernel.extend_attention(b.q, b.k_buffer, b.v_buffer, b.meta.req_to_token, table, SCALE)


@pytest.fixture(scope="module")
def avx2(kernel):
    """The AVX2 build (8-float vectors, other block shapes), on an AVX-512 machine too."""
    from plait.kernels.cpp_build import load_extension

    if cpu_extend.kernel_flags()[1] == 8:
        return kernel  # this machine's build is the AVX2 one
    return load_extension(
        "plait_extend_attn_cpu", cpu_extend._KERNEL_SOURCE,
        ["-O3", "-mavx2", "-mfma", "-fopenmp"], ["-fopenmp"],
    )


AVX2_SHAPES = ((1, 8), (3, 24), (4, 64))  # (group, head_dim)


@pytest.mark.parametrize("pool", list(CHECKS))
def test_the_avx2_build_matches_reference(avx2, pool):
    for group, head_dim in AVX2_SHAPES:
        for prefix_lens, extend_lens in CASES.values():
            b = random_attention_batch(prefix_lens, extend_lens, 2 * group, 2, head_dim, seed=1)
            CHECKS[pool](avx2, b)


def test_kernel_rejects_mixed_or_other_pool_dtypes(kernel):
    b = random_attention_batch([10], [5], 4, 2, 16, seed=7)
    k, v, k32, v32 = _pools(b)
    rows, table = b.meta.req_to_token, plan_extend(b.meta).table
    for kb, vb in ((k, v32), (k32, v)):
        with pytest.raises(RuntimeError, match="one dtype"):
            kernel.extend_attention(b.q, kb, vb, rows, table, SCALE)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernel.extend_attention(b.q, k.half(), v.half(), rows, table, SCALE)


def test_the_backend_path_takes_the_kernel_over_a_bf16_pool(kernel, monkeypatch):
    b = random_attention_batch([100, 5], [20, 30], 6, 2, 16, seed=9)
    k, v, k32, v32 = _pools(b)
    monkeypatch.setattr(cpu_extend.F, "scaled_dot_product_attention", None)  # torch's path fails
    out = extend_attention_cpu(b.q, k, v, b.meta, SCALE, use_kernel=True)
    monkeypatch.undo()
    assert out.dtype == torch.float32
    expected = extend_attention_reference(b.q, k32, v32, b.meta, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
