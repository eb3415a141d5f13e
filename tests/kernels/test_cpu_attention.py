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
    ROWS_MAX_EXTEND,
    ROWS_MAX_TOTAL,
    decode_attention_cpu,
    extend_attention_cpu,
    plan_decode,
    plan_extend,
    plan_rows,
)
from plait.kernels.testing import random_attention_batch
from plait.kernels.torch_backend import (
    decode_attention_reference,
    extend_attention_reference,
    store_kv_reference,
)
from plait.radix_cache.kv_pool import KVPool

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


def _verify_batch(group: int = 2, head_dim: int = 16, seed: int = 30):
    """A speculative verify over a tree: requests 0-2 share a 100-token root, each adding its
    pending token and a draft (ragged); request 3 shares nothing."""
    b = random_attention_batch([120, 130, 125, 60], [4, 1, 9, 3], 2 * group, 2, head_dim,
                               seed=seed)
    _share(b, 0, [1, 2], 100)
    return b


def test_verify_rows_over_a_shared_prefix_are_planned_as_decode_rows():
    b = _verify_batch()
    plan = plan_rows(b.meta)
    assert plan is not None and plan is plan_rows(b.meta)
    # rows 0-3 (request 0), 4 (1), 5-13 (2): one group reading the root once; the rows of
    # request 3 (14-16) share only their own request's prefix, a group of their own
    found = sorted((g.members.tolist(), g.slots.numel()) for g in plan.groups)
    assert found == [(list(range(14)), 100), ([14, 15, 16], 60)]
    # row r of a request sees its prefix and its first r + 1 new tokens: suffix after the root
    assert plan.suffix_lens.tolist() == [21, 22, 23, 24, 31, *range(26, 35), 1, 2, 3]


def test_extends_without_a_prefix_across_requests_keep_the_extend_path():
    b = random_attention_batch([120, 130], [4, 2], 4, 2, 16, seed=31)  # nothing shared
    assert plan_rows(b.meta) is None
    b = random_attention_batch([120, 130], [4, ROWS_MAX_EXTEND + 1], 4, 2, 16, seed=32)
    _share(b, 0, [1], 100)  # shared, but a request adds too many rows (a prefill)
    assert plan_rows(b.meta) is None
    b = random_attention_batch([120], [4], 4, 2, 16, seed=33)  # one request
    assert plan_rows(b.meta) is None
    n = ROWS_MAX_TOTAL // ROWS_MAX_EXTEND + 1  # too many rows in all
    b = random_attention_batch([100] * n, [ROWS_MAX_EXTEND] * n, 4, 2, 16, seed=34)
    _share(b, 0, list(range(1, n)), 80)
    assert plan_rows(b.meta) is None


@pytest.mark.parametrize("group", [1, 3])
def test_verify_rows_match_the_extend_reference(group):
    b = _verify_batch(group, seed=34 + group)
    _check(decode_attention_cpu, extend_attention_reference, b)


def test_the_backend_attends_verify_rows_as_decode_rows():
    from plait.kernels.torch_backend import TorchAttnBackend

    b = _verify_batch(2, seed=40)
    backend = TorchAttnBackend(4, 2, 16, SCALE)
    backend.prepare(b.meta)
    assert "cpu_extend_plan" not in b.meta.cache  # the extend path was not planned

    class Pool:
        k_buffer, v_buffer = [b.k_buffer.clone()], [b.v_buffer.clone()]

    out = backend.forward(b.q, b.k_new, b.v_new, 0, Pool, b.meta)
    k, v = _stored(b)
    torch.testing.assert_close(out, extend_attention_reference(b.q, k, v, b.meta, SCALE),
                               atol=2e-5, rtol=2e-5)
    assert backend.shared_kv_tokens(b.meta) == 100 * 13 + 60 * 2


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


# ------------------------------------------------------- attn_cpu.cpp (AVX-512 / AVX2 decode)
def _isas() -> list[str]:
    cap = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": ["avx512", "avx2"], "AVX2": ["avx2"]}.get(cap, [])


@pytest.fixture(scope="module")
def decode_kernel():
    import plait.kernels.cpu_attention as cpu

    if cpu.kernel_isa() is None:
        pytest.skip("the decode kernel needs AVX2")
    assert cpu.start_decode_kernel(block=True), "the decode kernel failed to build"
    return cpu


@pytest.fixture(scope="module", params=_isas() or ["none"])
def isa_kernel(request):
    """The kernel built for each vector ISA this CPU runs (both on an AVX-512 machine)."""
    if request.param == "none":
        pytest.skip("the decode kernel needs AVX2")
    from plait.kernels.cpu_attention import load_decode_kernel

    mod = load_decode_kernel(request.param)
    assert mod.isa == request.param
    return mod


def _kernel_decode(q, k, v, meta, scale):
    # the conditions under which decode_attention_cpu takes the kernel (else it falls back)
    assert k.is_contiguous() and k.dtype == q.dtype == torch.float32
    return decode_attention_cpu(q, k, v, meta, scale, use_kernel=True)


def _poisoned_pool(rows: list[torch.Tensor], kv_heads: int, head_dim: int, seed: int):
    """K/V buffers where the rows listed hold random values and every other row NaN."""
    gen = torch.Generator().manual_seed(seed)
    size = int(max(int(r.max()) for r in rows)) + 2
    k = torch.full((size, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    used = torch.cat(rows).unique()
    k[used] = torch.randn(len(used), kv_heads, head_dim, generator=gen)
    v[used] = torch.randn(len(used), kv_heads, head_dim, generator=gen)
    return k, v


def _reference(q, k, v, rows, scale):
    """float64 attention of q [B, Hkv, R, D] over each sequence's rows: (out, lse)."""
    outs, lses = [], []
    for b, slots in enumerate(rows):
        kb, vb = k[slots].double().transpose(0, 1), v[slots].double().transpose(0, 1)
        s = torch.einsum("hrd,hld->hrl", q[b].double(), kb) * scale  # [Hkv, R, L]
        outs.append(torch.einsum("hrl,hld->hrd", s.softmax(-1), vb).float())
        lses.append(torch.logsumexp(s, -1).float())
    return torch.stack(outs), torch.stack(lses)


def _slot_table(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's slots [B, W] (padding past lens: slot 0) and lens [B] for `rows`."""
    width = max(len(r) for r in rows)
    slots = torch.zeros(len(rows), width + 3, dtype=torch.int64)
    for b, r in enumerate(rows):
        slots[b, : len(r)] = r
    return slots, torch.tensor([len(r) for r in rows], dtype=torch.int64)


def _run_kernel(mod, q, k, v, rows, scale=0.3):
    out, lse = mod.decode_attention(q, k, v, *_slot_table(rows), scale)
    expected, expected_lse = _reference(q, k, v, rows, scale)
    assert not out.isnan().any(), "NaN: a read outside the sequence's rows"
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=2e-5)


def _allocator_rows(layout: str, batch: int, prompt: int, context: int) -> list[torch.Tensor]:
    """Each request's slots as KVPool hands them out: a prompt alloc, then one alloc(1) per
    request per decode step (decode tokens `batch` slots apart); "served": from a free stack
    that earlier requests of other lengths left mixed up."""
    pool = KVPool(4 * batch * context + 64, 0, 1, 8, torch.float32)
    if layout == "served":
        live = [pool.alloc(n) for n in (37, 5, 120, 64, 9, 200, 77)]
        for i in (3, 0, 5, 2, 6, 1, 4):
            pool.free(live[i][torch.randperm(len(live[i]), generator=torch.Generator().manual_seed(i))])
    rows = [[pool.alloc(prompt)] for _ in range(batch)]
    for _ in range(context - prompt):
        for r in rows:
            r.append(pool.alloc(1))
    return [torch.cat(r) for r in rows]


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["scheduler", "served"])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_decode_kernel_on_the_allocators_slot_layouts(isa_kernel, layout, batch):
    # SmolLM2's shapes: 3 kv heads x 3 query heads, head_dim 64; prompts of 40, 130 decoded
    rows = _allocator_rows(layout, batch, 40, 170)
    k, v = _poisoned_pool(rows, 3, 64, seed=batch)
    q = torch.randn(batch, 3, 3, 64, generator=torch.Generator().manual_seed(batch))
    _run_kernel(isa_kernel, q, k, v, rows, scale=0.125)


@pytest.mark.heavy
@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 63, 64, 65, 129, 1000, 3001])
def test_decode_kernel_splits_one_long_sequence(isa_kernel, length):
    # batch 1: the keys are split into chunks for both threads and merged by log-sum-exp
    rows = [torch.randperm(length + 50, generator=torch.Generator().manual_seed(length))[:length]
            * 2 + 1]  # every row followed by a NaN row: a read past a row's end shows
    k, v = _poisoned_pool(rows, 2, 64, seed=length)
    q = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(length))
    _run_kernel(isa_kernel, q, k, v, rows)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "kv_heads,rows_per_head,head_dim",
    [(3, 3, 64), (1, 8, 128), (2, 4, 72), (4, 1, 16), (2, 2, 8), (2, 3, 136), (3, 5, 24)],
)
def test_decode_kernel_gqa_shapes_and_head_dims(isa_kernel, kv_heads, rows_per_head, head_dim):
    # head_dim not a multiple of 16 (72, 136, 24, 8): AVX-512's masked last vector
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, 7, 16, 33, 300]
    rows = [torch.randperm(400, generator=gen)[:n] * 2 + 1 for n in lens]
    k, v = _poisoned_pool(rows, kv_heads, head_dim, seed=head_dim)
    q = torch.randn(len(lens), kv_heads, rows_per_head, head_dim, generator=gen)
    _run_kernel(isa_kernel, q, k, v, rows)


@pytest.mark.heavy
@pytest.mark.parametrize(
    "rows_per_head,head_dim", [(23, 64), (24, 64), (27, 72), (29, 64), (36, 64), (40, 16)]
)
def test_decode_kernel_many_query_rows(isa_kernel, rows_per_head, head_dim):
    # from 24 rows per kv head the scores are a small GEMM over the block's K transposed, 8 rows
    # a tile and the rest (3, 5, 4 here) in one tile of their own
    gen = torch.Generator().manual_seed(rows_per_head)
    rows = [torch.randperm(600, generator=gen)[:n] * 2 + 1 for n in (1, 17, 300)]
    k, v = _poisoned_pool(rows, 2, head_dim, seed=rows_per_head)
    q = torch.randn(3, 2, rows_per_head, head_dim, generator=gen)
    _run_kernel(isa_kernel, q, k, v, rows)


@pytest.mark.heavy
@pytest.mark.parametrize("rows_per_head", [32, 64, 100])
@pytest.mark.parametrize("keys", [300, 1100])
def test_decode_kernel_rows_in_the_lanes(isa_kernel, rows_per_head, keys):
    # from 32 rows per kv head the rows go in the vector lanes: one sequence's 300 keys are one
    # chunk (2 heads: 2 items for 2 threads, so the rows split in runs of row vectors too),
    # 1100 three chunks merged; 100 rows end in a partial row vector
    gen = torch.Generator().manual_seed(rows_per_head + keys)
    rows = [torch.randperm(2 * keys, generator=gen)[:keys] * 2 + 1]
    k, v = _poisoned_pool(rows, 2, 64, seed=keys)
    q = torch.randn(1, 2, rows_per_head, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            _run_kernel(isa_kernel, q, k, v, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.heavy
def test_decode_kernel_many_query_rows_and_merge(isa_kernel):
    # a shared prefix: 64 members x 3 query heads = 192 rows per kv head over 1000 keys, then
    # merged into the members' suffix results as decode_attention_cpu does
    gen = torch.Generator().manual_seed(7)
    n, g, d = 64, 3, 64
    prefix = torch.randperm(3000, generator=gen)[:1000] * 2 + 1
    suffixes = [torch.arange(6001 + 40 * i, 6001 + 40 * i + 2 * (i % 7 + 1), 2) for i in range(n)]
    k, v = _poisoned_pool([prefix, *suffixes], 3, d, seed=7)
    q = torch.randn(n, 3, g, d, generator=gen)
    _run_kernel(isa_kernel, q.transpose(0, 1).reshape(1, 3, n * g, d), k, v, [prefix])
    lens = torch.tensor([len(s) for s in suffixes])
    slots = torch.nn.utils.rnn.pad_sequence(suffixes, batch_first=True)
    out, lse = isa_kernel.decode_attention(q, k, v, slots, lens, 0.3)
    p_out, p_lse = isa_kernel.decode_attention(
        q.transpose(0, 1).reshape(1, 3, n * g, d), k, v, prefix[None], torch.tensor([1000]), 0.3
    )
    members = torch.arange(n)
    isa_kernel.merge_prefix(out, lse, members, p_out, p_lse)
    expected, expected_lse = _reference(q, k, v, [torch.cat([prefix, s]) for s in suffixes], 0.3)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse, expected_lse, atol=2e-5, rtol=2e-5)


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
    # the suffixes and the groups' prefixes both through the kernel, merged by lse
    lens = [60, 70, 40, 120, 101, 150, 80, 90]
    b = random_attention_batch(lens, [1] * len(lens), 2 * group, 2, 64,
                               mode=ForwardMode.DECODE, seed=20 + group)
    _share(b, 0, [1, 2], 40)  # member 2: its whole cached KV is the prefix (suffix length 1)
    _share(b, 3, [4, 5], 100)
    assert len(plan_decode(b.meta).groups) == 2
    _check(_kernel_decode, decode_attention_reference, b)


@pytest.mark.heavy
@pytest.mark.parametrize("group", [1, 3])
def test_decode_kernel_attends_verify_rows(decode_kernel, group):
    b = _verify_batch(group, head_dim=64, seed=50 + group)
    _check(_kernel_decode, extend_attention_reference, b)


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
    isa = decode_kernel.kernel_isa()
    cflags, ldflags = decode_kernel.decode_kernel_flags(isa), ["-fopenmp"]
    name = extension_name(f"plait_attn_cpu_{isa}", source.read_text(), cflags, ldflags)
    (build_directory(name) / "lock").touch()
    loaded = []
    t = threading.Thread(target=lambda: loaded.append(load_extension(
        f"plait_attn_cpu_{isa}", source, cflags, ldflags)), daemon=True)
    t.start()
    t.join(timeout=120)
    assert loaded and hasattr(loaded[0], "decode_attention"), "load waited on the stale lock"


@pytest.mark.heavy
def test_decode_kernel_result_does_not_depend_on_threads_or_batch(isa_kernel):
    # the scheduler changes torch's thread count with the host's load (thread_tuner.py): a
    # request's attention must come out bit for bit the same on 1 or 2 threads, alone or in a
    # batch, or its greedy tokens could change with the machine's load
    gen = torch.Generator().manual_seed(11)
    lens = [1, 70, 280, 1000]
    rows = [torch.randperm(3000, generator=gen)[:n] * 2 + 1 for n in lens]
    k, v = _poisoned_pool(rows, 3, 64, seed=11)
    q = torch.randn(len(lens), 3, 3, 64, generator=gen)
    slots = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
    lens_t = torch.tensor(lens)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(isa_kernel.decode_attention(q, k, v, slots, lens_t, 0.3))
            alone = isa_kernel.decode_attention(q[3:], k, v, slots[3:], lens_t[3:], 0.3)
            assert torch.equal(alone[0], results[-1][0][3:]), "batch changed the result"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


# ----------------------------------- a bfloat16 KV pool for fp32 models (--kv-cache-dtype)
@pytest.mark.heavy
@pytest.mark.parametrize(
    "kv_heads,rows_per_head,head_dim,lens",
    [
        (3, 3, 64, [1, 7, 16, 33, 280]),  # SmolLM2's decode rows (GQA)
        (2, 4, 40, [1, 17, 300]),  # AVX-512: the rows end in a half vector
        (2, 1, 72, [5, 130]),
        (2, 27, 72, [1, 17, 300]),  # from 24 rows a kv head: K transposed, scores as a GEMM
        (2, 64, 64, [300]),  # from 32 rows a kv head: the rows in the lanes
        (1, 100, 40, [1100]),  # ... over three chunks, a partial row vector, a short row
        (2, 4, 64, [3001]),  # one long sequence split into chunks, merged
    ],
    ids=["smollm2", "tail-40", "tail-72", "gemm", "lanes", "lanes-chunks", "long"],
)
def test_decode_kernel_reads_a_bf16_pool_exactly(isa_kernel, kv_heads, rows_per_head, head_dim,
                                                 lens):
    # bf16 -> fp32 is exact and the arithmetic is the same: the results over a bf16 pool are
    # those over an fp32 pool of the same values, bit for bit. Every used row is followed by a
    # NaN row (and padding slot 0 is NaN): a read past a row's end or a short row shows
    gen = torch.Generator().manual_seed(head_dim + rows_per_head)
    rows = [torch.randperm(max(lens) + 50, generator=gen)[:n] * 2 + 1 for n in lens]
    k, v = _poisoned_pool(rows, kv_heads, head_dim, seed=head_dim)
    k, v = k.bfloat16(), v.bfloat16()
    q = torch.randn(len(lens), kv_heads, rows_per_head, head_dim, generator=gen)
    slots, lens_t = _slot_table(rows)
    out, lse = isa_kernel.decode_attention(q, k, v, slots, lens_t, 0.3)
    assert out.dtype == lse.dtype == torch.float32
    assert not out.isnan().any(), "NaN: a read outside the sequence's rows"
    expected, expected_lse = isa_kernel.decode_attention(q, k.float(), v.float(), slots, lens_t,
                                                         0.3)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    _run_kernel(isa_kernel, q, k.float(), v.float(), rows)  # (and that is the attention)


@pytest.mark.heavy
def test_decode_kernel_rejects_mixed_or_other_pool_dtypes(isa_kernel):
    q = torch.randn(1, 2, 2, 16)
    k = torch.randn(10, 2, 16)
    slots, lens = torch.tensor([[3, 4]]), torch.tensor([2])
    with pytest.raises(RuntimeError, match="one dtype"):
        isa_kernel.decode_attention(q, k.bfloat16(), k, slots, lens, 0.25)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        isa_kernel.decode_attention(q, k.half(), k.half(), slots, lens, 0.25)


@pytest.mark.heavy
def test_decode_attention_cpu_takes_the_kernel_over_a_bf16_pool(decode_kernel, monkeypatch):
    # an fp32 model's queries over a bf16 pool, shared prefixes included: the kernel (torch's
    # path would fail), matching the fp32 reference over the pool's values
    lens = [60, 70, 40, 120, 101, 150, 80, 90]
    b = random_attention_batch(lens, [1] * len(lens), 9, 3, 64, mode=ForwardMode.DECODE,
                               seed=60)
    _share(b, 0, [1, 2], 40)
    _share(b, 3, [4, 5], 100)
    k, v = (x.bfloat16() for x in _stored(b))

    def fail(*args, **kwargs):
        raise AssertionError("torch's path ran, not the kernel")

    monkeypatch.setattr(decode_kernel, "_attend", fail)
    out = decode_attention_cpu(b.q, k, v, b.meta, SCALE, use_kernel=True)
    monkeypatch.undo()
    assert out.dtype == torch.float32 and not out.isnan().any()
    expected = decode_attention_reference(b.q, k.float(), v.float(), b.meta, SCALE)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
