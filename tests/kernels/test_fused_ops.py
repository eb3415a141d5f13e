"""fused_cpu.cpp (plait.kernels.fused_ops) against its torch references.

The kernels are meant to round exactly as the torch operators they replace, so results are
compared for equality (torch.equal), not within a tolerance; the rare case where no vector
width reproduces torch's sum or SiLU on a machine (the loader then says `exact` is False) falls
back to a relative tolerance of 1e-6.
"""

from __future__ import annotations

import pytest
import torch

from plait.kernels import fused_ops as fo

pytestmark = pytest.mark.heavy  # builds a C++ extension (cached by torch after the first time)


@pytest.fixture(scope="module")
def ops(fused_ops) -> fo.FusedOps:
    return fused_ops


def _same(got: torch.Tensor, expected: torch.Tensor, exact: bool = True) -> None:
    if exact:
        assert torch.equal(got, expected), (
            f"{int((got != expected).sum())} of {got.numel()} elements differ, "
            f"max {float((got - expected).abs().max()):.3g}"
        )
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_the_probe_found_torchs_vector_widths(ops):
    # on the CPUs plait runs on (x86 with AVX2 or AVX-512) torch's sum and SiLU are reproduced
    assert ops.exact
    assert ops.sum_lanes in (8, 16) and ops.silu_lanes in (8, 16)


# widths around the vector and cascade boundaries (16 vectors per level), SmolLM2's 576 and 1536
SIZES = [1, 7, 16, 33, 100, 576, 1000, 1536, 4099]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_matches_reference(ops, n, rows):
    gen = torch.Generator().manual_seed(n * 100 + rows)
    x = torch.randn(rows, n, generator=gen) * 3
    w = torch.randn(n, generator=gen)
    _same(ops.rms_norm(x, w, 1e-5), fo.rms_norm_reference(x, w, 1e-5), ops.exact)


def test_rms_norm_of_a_strided_view(ops):
    x = torch.randn(5, 1000)[:, 100:676]  # rows 1000 floats apart
    w = torch.randn(576)
    _same(ops.rms_norm(x, w, 1e-6), fo.rms_norm_reference(x, w, 1e-6), ops.exact)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_add_rms_norm_updates_the_residual_in_place(ops, n, rows):
    gen = torch.Generator().manual_seed(n + rows)
    residual = torch.randn(rows, n, generator=gen)
    delta = torch.randn(rows, n, generator=gen)
    w = torch.randn(n, generator=gen)
    expected_residual, expected = fo.add_rms_norm_reference(residual, delta, w, 1e-5)
    stream = residual.clone()
    out = ops.add_rms_norm_(stream, delta, w, 1e-5)
    assert torch.equal(stream, expected_residual)  # an add rounds the same anywhere
    _same(out, expected, ops.exact)


@pytest.mark.parametrize("n", [1, 8, 16, 17, 33, 1536, 1003])
@pytest.mark.parametrize("rows", [1, 4, 77])
def test_silu_mul_matches_reference(ops, n, rows):
    gen = torch.Generator().manual_seed(n * 7 + rows)
    gate_up = torch.randn(rows, 2 * n, generator=gen) * 6
    got, expected = ops.silu_mul(gate_up), fo.silu_mul_reference(gate_up)
    # torch's threads may split a large tensor inside a row, moving where its scalar tail
    # starts: rows whose width is no multiple of 32 are then only within a rounding
    split = rows * n >= 32768 and n % 32
    _same(got, expected, ops.exact and not split)


def test_silu_mul_at_the_edges_of_exp(ops):
    edges = [-200.0, -104.5, -104.0, -100.0, -88.0, -87.0, -50.0, -1e-30, 0.0, 1e-30, 50.0,
             88.0, 89.0, 100.0, 100.5, float("inf"), float("-inf"), float("nan")]
    gate = torch.tensor(edges * 4)  # 72: vector blocks and the scalar tail
    gate_up = torch.cat([gate, torch.full_like(gate, 0.5)])[None]
    got, expected = ops.silu_mul(gate_up), fo.silu_mul_reference(gate_up)
    assert torch.equal(got.isnan(), expected.isnan())
    _same(torch.nan_to_num(got), torch.nan_to_num(expected), ops.exact)


def _pools(slots: int, kv_heads: int, dim: int):
    # NaN everywhere: the rows the kernel must not touch stay NaN
    return (torch.full((slots, kv_heads, dim), float("nan")),
            torch.full((slots, kv_heads, dim), float("nan")))


@pytest.mark.parametrize("dim", [6, 16, 64, 72])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("tokens", [1, 5, 300])
@pytest.mark.parametrize("loc_dtype", [torch.int32, torch.int64])
def test_rope_store_kv_matches_reference(ops, dim, heads, kv_heads, tokens, loc_dtype):
    gen = torch.Generator().manual_seed(dim + heads + tokens)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    slots = tokens + 9
    loc = torch.randperm(slots, generator=gen)[:tokens].to(loc_dtype)
    k_got, v_got = _pools(slots, kv_heads, dim)
    k_exp, v_exp = _pools(slots, kv_heads, dim)
    q = ops.rope_store_kv(qkv, cos, sin, k_got, v_got, loc, heads, kv_heads)
    q_exp = fo.rope_store_kv_reference(qkv, cos, sin, k_exp, v_exp, loc, heads, kv_heads)
    assert torch.equal(q, q_exp)
    # the pools, NaN rows included, are the same bit for bit
    for got, exp in ((k_got, k_exp), (v_got, v_exp)):
        assert torch.equal(got.nan_to_num(7.0), exp.nan_to_num(7.0))
        assert torch.equal(got.isnan(), exp.isnan())


@pytest.mark.parametrize("dim", [6, 64, 72])
@pytest.mark.parametrize("tokens", [1, 300])
def test_rope_store_kv_into_a_bf16_pool_rounds_as_torch_does(ops, dim, tokens):
    # --kv-cache-dtype bfloat16: the fp32 rows rotated as before, stored rounded to bf16 the way
    # torch's .to(torch.bfloat16) rounds (to nearest even), NaN rows untouched
    gen = torch.Generator().manual_seed(dim + tokens)
    heads, kv_heads = 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    slots = tokens + 9
    loc = torch.randperm(slots, generator=gen)[:tokens]
    k_got, v_got = (t.bfloat16() for t in _pools(slots, kv_heads, dim))
    k_exp, v_exp = (t.bfloat16() for t in _pools(slots, kv_heads, dim))
    q = ops.rope_store_kv(qkv, cos, sin, k_got, v_got, loc, heads, kv_heads)
    q_exp = fo.rope_store_kv_reference(qkv, cos, sin, k_exp, v_exp, loc, heads, kv_heads)
    assert q.dtype == torch.float32 and torch.equal(q, q_exp)
    for got, exp in ((k_got, k_exp), (v_got, v_exp)):
        assert torch.equal(got.view(torch.int16), exp.view(torch.int16))  # NaN rows included
    # the stored values are not just fp32 truncated: some round up
    k32, _ = _pools(slots, kv_heads, dim)
    fo.rope_store_kv_reference(qkv, cos, sin, k32, torch.empty_like(k32), loc, heads, kv_heads)
    truncated = (k32[loc].view(torch.int32) >> 16).to(torch.int16)
    assert not torch.equal(k_got[loc].view(torch.int16), truncated)


def test_rope_store_kv_refuses_pools_of_two_dtypes(ops):
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(2, 1, 8)
    k, v = torch.zeros(10, 1, 16, dtype=torch.bfloat16), torch.zeros(10, 1, 16)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.rope_store_kv(qkv, cos, sin, k, v, torch.tensor([1, 2]), 1, 1)
    with pytest.raises(RuntimeError, match="both float32 or both bfloat16"):
        ops.rope_store_kv(qkv, cos, sin, k.half(), v.half(), torch.tensor([1, 2]), 1, 1)


def test_rope_store_kv_rejects_slots_outside_the_pool(ops):
    qkv = torch.randn(2, 3 * 16)
    cos = sin = torch.ones(2, 1, 8)
    k, v = torch.zeros(10, 1, 16), torch.zeros(10, 1, 16)
    for bad in ([3, 10], [-1, 2]):
        with pytest.raises(RuntimeError, match="slot out of range"):
            ops.rope_store_kv(qkv, cos, sin, k, v, torch.tensor(bad), 1, 1)
    assert not k.any() and not v.any()  # nothing written before the check


@pytest.mark.parametrize(
    "call",
    [
        lambda ops: ops.rms_norm(torch.randn(2, 8, dtype=torch.float64),
                                 torch.ones(8, dtype=torch.float64), 1e-6),
        lambda ops: ops.rms_norm(torch.randn(8, 2).t(), torch.ones(8), 1e-6),  # column stride 2
        lambda ops: ops.add_rms_norm_(torch.randn(2, 8), torch.randn(3, 8), torch.ones(8), 1e-6),
        lambda ops: ops.rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6),
        lambda ops: ops.silu_mul(torch.randn(2, 7)),
    ],
    ids=["float64", "strided-columns", "shape", "weight", "odd-gate-up"],
)
def test_bad_inputs_are_refused(ops, call):
    with pytest.raises(RuntimeError):
        call(ops)


@pytest.mark.parametrize("n", [1, 7, 16, 17, 100, 1024, 49152])
def test_max_argmax_is_amax_and_argmax(ops, n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1] = 0.5  # all tied: the first index
    x[2] = float("-inf")  # nothing allowed: -inf and index 0
    x[3, n // 2] = float("inf")
    x[4, n - 1] = float("nan")  # NaN wins, at its first index, as torch
    x[5, n // 3] = float("nan")
    x[5, n - 1] = float("nan")
    x[6, : n // 2] = float("-inf")  # a bitmask's masked prefix
    x[7, n - 1] = x[7].max() + 1  # the maximum in the tail
    x[8] = torch.round(x[8])  # ties among many equal values
    for t in (x, x[:, : max(1, n - 3)], torch.empty(0, n)):  # odd widths (strided rows), none
        mx, idx = ops.max_argmax(t)
        assert idx.dtype == torch.int64 and mx.dtype == torch.float32
        assert torch.equal(idx, t.argmax(dim=-1)), (idx, t.argmax(dim=-1))
        assert torch.allclose(mx, t.amax(dim=-1), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("n,words", [(49152, 1536), (100, 4), (100, 3), (37, 2), (5, 1)])
def test_apply_bitmask_matches_the_reference(ops, n, words):
    """The in-place grammar mask: -inf exactly where the token's bit is 0 (xgrammar's layout,
    bit t % 32 of word t / 32), and past 32 * words; the rest untouched. Rows of every kind: all
    allowed (skipped words), none, random bits, one token, strided logits rows."""
    from plait.grammar.base import _apply_torch

    gen = torch.Generator().manual_seed(n + words)
    base = torch.randn(6, n + 3, generator=gen)
    x = base[:, :n]  # rows n + 3 apart
    bits = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=gen, dtype=torch.int64)
    bits = bits.to(torch.int32)
    bits[0] = -1
    bits[1] = 0
    bits[2] = 0
    bits[2, 0] = 1 << 3  # token 3 alone
    bits[3, : words // 2] = -1  # a free string's words, then random ones
    want = x.clone()
    covered = min(n, 32 * words)
    _apply_torch(want, bits, covered)
    want[:, covered:] = float("-inf")
    got_base = base.clone()
    got = got_base[:, :n]
    ops.apply_bitmask_(got, bits)
    assert torch.equal(got, want) and torch.equal(got_base[:, n:], base[:, n:])
    assert torch.isinf(got[1]).all() and torch.isfinite(got[0, :covered]).all()


def test_decode_layers_refuses_an_entry_point_of_another_signature(ops):
    """DecodeLayers calls the linear and attention kernels through exported addresses: each
    comes with its signature, and one that is not the expected one is refused by name."""
    from plait.kernels import woq
    from plait.kernels.cpu_attention import decode_kernel, start_decode_kernel

    assert start_decode_kernel(block=True) and woq.start_linear_kernels(block=True)
    linear = woq.PanelLinear(torch.randn(64, 32))
    fn, operands = linear.kernel_call()
    name, (address, signature), _ = woq.kernel_entry((fn, operands))
    assert name == "fp32_linear"
    pool = [torch.zeros(8, 1, 32)]
    attention = decode_kernel().entry_points()
    norm = torch.ones(32)

    def layers(entry):
        spec = (name, entry, operands)
        return [(0, 1, 1, spec, spec, spec, spec, norm, 1e-6, norm, 1e-6)]

    assert len(ops.module.DecodeLayers(layers((address, signature)), pool, pool, attention, 8,
                                       8)) == 1
    with pytest.raises(RuntimeError, match="entry point fp32_linear: signature"):
        ops.module.DecodeLayers(layers((address, "Tensor(Tensor x)")), pool, pool, attention, 8, 8)
    for name in ("decode_attention", "merge_prefix"):
        wrong = {**attention, name: (attention[name][0], "?")}
        with pytest.raises(RuntimeError, match=f"entry point {name}: signature"):
            ops.module.DecodeLayers(layers((address, signature)), pool, pool, wrong, 8, 8)
    with pytest.raises(ValueError, match="not a loaded woq kernel"):
        woq.kernel_entry((torch.mm, operands))
