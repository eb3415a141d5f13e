"""The logit screen (plait/runtime/logit_screen.py): greedy picks from a bf16 screen of the
logits GEMM plus exact dot products of its candidates must be the fp32 argmax, including
where bf16 cannot tell the top tokens apart; and the scheduler takes it only for forwards whose
every row is a plain greedy pick."""

from __future__ import annotations

import json
import time

import pytest
import torch

from plait.kernels.screen_kernel import (
    amx_capable,
    kernel_capable,
    kernel_kind,
    screen_kernel,
    start_screen_kernel,
    vector_capable,
)
from plait.messages import TokenizedGenerateReq
from plait.runtime.logit_screen import KERNEL_ROWS, LogitScreen, has_bf16_units
from tests.runtime.test_scheduler import outputs

needs_bf16 = pytest.mark.skipif(not has_bf16_units(), reason="no AMX / AVX512-BF16 on this CPU")


def _weight(vocab: int = 6000, hidden: int = 576, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=gen) * 0.05
    return w * torch.rand(vocab, 1, generator=gen).add(0.5)  # rows of different norms


def _hidden(w: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, w.shape[1], generator=gen) * 2
    h[:, :3] *= 20  # a few large activations, as real hidden states have
    return h


@pytest.fixture(scope="module")
def screen_ops(fused_ops):
    if not has_bf16_units():
        pytest.skip("no AMX / AVX512-BF16 on this CPU")
    return fused_ops


@pytest.mark.heavy
def test_the_bound_holds_and_picks_are_the_fp32_argmax(screen_ops):
    w = _weight()
    screen = LogitScreen.build(w)
    assert screen is not None and screen.bound_holds(screen.approx_onednn)
    for rows, seed in ((1, 1), (7, 2), (33, 3)):
        h = _hidden(w, rows, seed)
        approx = screen.approx(h.to(torch.bfloat16))
        exact = h.double() @ w.double().t()
        assert ((approx.double() - exact).abs() <= screen.bounds(h, approx)).all()
        row_max, argmax = screen(h, w.shape[0]).picks()
        full = h @ w.t()
        assert torch.equal(argmax, full.argmax(-1))
        torch.testing.assert_close(row_max, full.amax(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.heavy
@pytest.mark.parametrize("path", [
    pytest.param("screen_gemm", marks=pytest.mark.skipif(not amx_capable(),
                                                         reason="no AMX-BF16 on this CPU")),
    pytest.param("screen_gemm_vec", marks=pytest.mark.skipif(not vector_capable(),
                                                             reason="no AVX512-BF16 on this CPU")),
])
@pytest.mark.parametrize("vocab,hidden", [(6000, 576), (1000, 100)])
def test_each_kernel_path_keeps_the_bound(screen_ops, path, vocab, hidden):
    """screen_kernel.cpp's two GEMMs (AMX tiles; AVX512-BF16 vectors, which AMX CPUs have too):
    every value within the screen's bound of the exact product, at row counts of one tile or
    vector group, several (the vectors' groups of up to 12 rows: 17 rows as 9 + 8, 70 as six
    of 11-12), and more than one group of 32, with a vocabulary and a width that are no
    multiples of 32 (the padded tails); and no value further from oneDNN's than its rounding."""
    assert start_screen_kernel(block=True) and screen_kernel() is not None
    gemm = getattr(screen_kernel(), path)
    w = _weight(vocab, hidden, seed=6)
    screen = LogitScreen.build(w, huge_pages=True)
    assert screen.kernel_packed is not None and screen.packed is not None
    for rows, seed in ((1, 7), (17, 8), (70, 9)):
        h = _hidden(w, rows, seed)
        approx = gemm(h.to(torch.bfloat16), screen.kernel_packed, vocab)
        assert approx.shape == (rows, vocab) and approx.dtype == torch.bfloat16
        exact = h.double() @ w.double().t()
        assert ((approx.double() - exact).abs() <= screen.bounds(h, approx)).all()
        onednn = screen.approx_onednn(h.to(torch.bfloat16))
        assert ((approx.double() - onednn.double()).abs()
                <= 2.0**-7 * onednn.double().abs() + 1e-3).all()
    # a hidden row whose width does not match the packed weight's is refused, not misread
    with pytest.raises(RuntimeError, match="inputs against a packed width"):
        gemm(torch.zeros(2, hidden + 40, dtype=torch.bfloat16), screen.kernel_packed, vocab)


@pytest.mark.heavy
@pytest.mark.skipif(not kernel_capable(), reason="no AMX-BF16 or AVX512-BF16 on this CPU")
def test_the_kernel_takes_over_from_onednn_up_to_its_rows(screen_ops, monkeypatch):
    """Once built and its bound checked, `approx` runs this CPU's kernel path up to
    KERNEL_ROWS rows (oneDNN beyond), and the picks stay the fp32 argmax."""
    assert start_screen_kernel(block=True) and kernel_kind() in KERNEL_ROWS
    limit = KERNEL_ROWS[kernel_kind()]
    w = _weight(6000, 576, seed=6)
    screen = LogitScreen.build(w)
    calls = []
    for name in ("approx_kernel", "approx_onednn"):
        fn = getattr(screen, name)
        monkeypatch.setattr(screen, name, lambda x, _fn=fn, _name=name: calls.append(
            (_name, x.shape[0])) or _fn(x))
    for rows in (5, limit + 1):
        h = _hidden(w, rows, seed=10)
        _, argmax = screen(h, w.shape[0]).picks()  # the first call checks the kernel's bound
        assert torch.equal(argmax, (h @ w.t()).argmax(-1))
    assert screen._kernel_checked and screen.kernel_packed is not None
    assert ("approx_kernel", 5) in calls and ("approx_onednn", limit + 1) in calls
    assert ("approx_kernel", limit + 1) not in calls


@pytest.mark.heavy
def test_ties_bf16_cannot_resolve_go_to_the_exact_products(screen_ops):
    """Two tokens whose bf16 rows are equal (their fp32 rows differ below bf16's resolution)
    and whose logits differ by ~1e-2: the screen scores them alike, the exact products decide,
    either way round. A row of equal fp32 logits picks the first token, as argmax does."""
    w = _weight(seed=4)
    hot, twin = 1234, 4321
    h = _hidden(w, 4, seed=5)
    # the top token of row 0 by far, exact in bf16 (so a nudge of 2^-12 rounds back to it)
    w[hot] = (h[0] / h[0].norm() * 2.0).to(torch.bfloat16).float()
    nudge = torch.zeros_like(w[hot])
    nudge[3:] = torch.sign(h[0, 3:]) * w[hot, 3:].abs() * 2.0**-12  # below bf16's last bit
    w[twin] = w[hot] + nudge  # slightly larger logit on row 0
    assert torch.equal(w[hot].to(torch.bfloat16), w[twin].to(torch.bfloat16))
    w[2000] = w[hot]  # an exact copy of `hot`: a tie with it in fp32
    h[1] = h[0]
    h[1, 3:] = -h[1, 3:]  # now `hot` beats `twin`
    screen = LogitScreen.build(w)
    full = h.double() @ w.double().t()
    assert full[0, twin] - full[0, hot] > 1e-3 and full[1, hot] - full[1, twin] > 1e-3
    _, argmax = screen(h, w.shape[0]).picks()
    assert argmax[0] == twin and argmax[1] == hot  # the first of hot's tie
    assert torch.equal(argmax, (h @ w.t()).argmax(-1))


@pytest.mark.heavy
def test_valid_vocabulary_and_non_finite_rows(screen_ops):
    w = _weight(seed=6)
    screen = LogitScreen.build(w)
    h = _hidden(w, 3, seed=7)
    _, argmax = screen(h, 1000).picks()  # ids >= 1000 have no token: never picked
    assert torch.equal(argmax, (h @ w[:1000].t()).argmax(-1))
    h[1, 10] = float("nan")
    row_max, argmax = screen(h, w.shape[0]).picks()
    assert torch.isnan(row_max[1]) and argmax[1] == 0  # torch's rule: NaN first
    assert torch.isfinite(row_max[[0, 2]]).all()
    assert torch.equal(argmax[[0, 2]], (h[[0, 2]] @ w.t()).argmax(-1))


@pytest.mark.heavy
def test_picks_under_a_grammar_bitmask_match_masked_logits(screen_ops):
    """Only allowed tokens count, as after apply_bitmask on full logits: random masks, one
    allowing a single token, one allowing none (-inf, index 0: the sampler's "constraint
    allows no continuation"), one all ones, and words covering less than the vocabulary."""
    from plait.grammar.base import _apply_torch

    w = _weight(vocab=5003, seed=8)  # not a multiple of 16 or 32: scalar tails too
    screen = LogitScreen.build(w)
    h = _hidden(w, 6, seed=9)
    gen = torch.Generator().manual_seed(10)
    words = (w.shape[0] + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (6, words), generator=gen, dtype=torch.int64)
    bits = bits.to(torch.int32)
    bits[1] = 0
    bits[1, 150] = 1 << 7  # token 4807 alone
    bits[2] = 0
    bits[3] = -1
    bits[4, :10] = 0  # the best tokens are often banned here
    rows = screen(h, w.shape[0])
    row_max, argmax = rows.picks(bits)
    full = h @ w.t()
    _apply_torch(full, bits, w.shape[0])
    _, want = full.max(-1)
    assert argmax.tolist()[:2] == [want[0].item(), 4807] and argmax[2] == 0
    assert row_max[2] == float("-inf") and torch.equal(argmax, want)
    assert torch.equal(argmax[[3]], (h[[3]] @ w.t()).argmax(-1))
    short = bits[:, : words // 2].contiguous()  # tokens past 32 * words are banned
    _, argmax = rows.picks(short)
    assert (argmax[[0, 3, 4, 5]] < 32 * (words // 2)).all()
    sub = rows[[5, 0]]  # indexing keeps each row's screen values and hidden row
    assert sub.picks(bits[[5, 0]])[1].tolist() == [want[5].item(), want[0].item()]


# ------------------------------------------------------------------ in the scheduler
def _drive(s, io, reqs: list[dict]) -> dict[str, list[int]]:
    for r in reqs:
        io.inbox.put(TokenizedGenerateReq(**r))
    deadline = time.monotonic() + 120  # grammars compile in another process meanwhile
    s.step()  # takes the requests in
    while s.has_work or s.constraints.pending:
        assert time.monotonic() < deadline, "the scheduler did not go idle"
        s.step()
    return outputs(io)


class _Counting:
    def __init__(self, screen) -> None:
        self.screen, self.calls = screen, 0

    def __call__(self, hidden, valid):
        self.calls += 1
        return self.screen(hidden, valid)


@needs_bf16
@pytest.mark.parametrize("ngram", [0, 8])
def test_greedy_forwards_take_the_screen_with_the_same_tokens(make_scheduler, fused_ops, ngram):
    """Greedy requests (with n-gram drafts or without, with a grammar or without) decode
    through the screen, to the same tokens as full logits; a batch with a sampled, a logprob or a penalized request computes
    full logits, and its greedy rows are then picked from them."""
    prompt = [(7 * i) % 200 + 10 for i in range(40)] * 2  # repetitive: drafts find matches
    greedy = [
        {"rid": f"g{i}", "input_ids": prompt[i:], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}}
        for i in range(3)
    ] + [  # the grammar's mask applies to the picks
        {"rid": "re", "input_ids": prompt[4:], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 30, "regex": "([a-z]+ ){2,8}[0-9]{3}"}},
        {"rid": "js", "input_ids": prompt[6:], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 40, "json_schema": json.dumps({
                "type": "object", "properties": {"name": {"type": "string"}},
                "required": ["name"]})}},
    ]
    on, io_on = make_scheduler(speculative_ngram=ngram)
    off, io_off = make_scheduler(speculative_ngram=ngram, disable_logit_screen=True)
    assert on.runner.logit_screen is not None and off.runner.logit_screen is None
    counter = on.runner.logit_screen = _Counting(on.runner.logit_screen)
    want = _drive(off, io_off, greedy)
    assert len(want["re"]) > 3 and len(want["js"]) > 3
    assert _drive(on, io_on, greedy) == want
    assert counter.calls > 0
    others = [
        {"rid": "t", "input_ids": prompt, "sampling_params": {
            "temperature": 0.8, "seed": 3, "max_new_tokens": 40, "ignore_eos": True}},
        {"rid": "lp", "input_ids": prompt[5:], "return_logprob": True, "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True}},
        {"rid": "pen", "input_ids": prompt[9:], "sampling_params": {
            "temperature": 0.0, "max_new_tokens": 40, "ignore_eos": True,
            "repetition_penalty": 1.3}},
    ]
    for other in others:
        mixed = [dict(g, rid=g["rid"] + other["rid"]) for g in greedy] + [other]
        counter.calls = 0
        got = _drive(on, io_on, mixed)
        for g in greedy:
            assert got[g["rid"] + other["rid"]] == want[g["rid"]]
        assert counter.calls == 0  # every forward had a row that needs its logits (it outlasts)
