"""Sampler: support restriction (top-k/top-p/min-p), penalties, seeds, min tokens."""

from __future__ import annotations

import torch

from plait.runtime.core import Req
from plait.runtime.sampler import Sampler, _restrict_support, argmax_suffices
from plait.sampling import SamplingParams

V = 10


def req(**sp) -> Req:
    return Req(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(**sp))


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    out = Sampler(V, (0,), 0)(logits.clone(), [req(temperature=0.0)] * 3, None)
    assert out.next_ids == logits.argmax(-1).tolist()


def test_logit_bias_is_added_to_the_logits():
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    top, second = logits[0].topk(2).indices.tolist()
    s = Sampler(V, (0,), 0)
    low = min(range(V), key=lambda t: float(logits[1, t]))
    reqs = [req(temperature=0.0, logit_bias={top: -100}), req(temperature=0.0, logit_bias={low: 100})]
    assert s(logits.clone(), reqs, None).next_ids == [second, low]
    # a bias too small to overtake changes nothing; the exact sum decides a near tie
    gap = float(logits[0, top] - logits[0, second])
    assert s(logits[:1].clone(), [req(temperature=0.0, logit_bias={second: gap * 0.9})],
             None).next_ids == [top]
    assert s(logits[:1].clone(), [req(temperature=0.0, logit_bias={second: gap * 1.1})],
             None).next_ids == [second]
    # sampled rows see it too: +100 leaves the other tokens no mass
    assert all(s(logits[1:].clone(), [req(temperature=1.0, seed=k, logit_bias={low: 100})],
                 None).next_ids == [low] for k in range(20))
    # the greedy pick then needs the biased logits: no screened rows for it
    assert argmax_suffices(req(temperature=0.0)) and not argmax_suffices(reqs[0])


def test_top_k_top_p_min_p_restrict_support():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0, 0, 0]])
    top_k = _restrict_support(probs.clone(), [req(top_k=2)])
    assert (top_k[0, 2:] == 0).all() and torch.allclose(top_k[0, :2], torch.tensor([4 / 7, 3 / 7]))
    # top_p=0.6: 0.4 < 0.6 so the token crossing the mass (0.3) is kept, 0.2 is not
    top_p = _restrict_support(probs.clone(), [req(top_p=0.6)])
    assert (top_p[0, :2] > 0).all() and (top_p[0, 2:] == 0).all()
    # min_p=0.5: keep tokens with p >= 0.5 * 0.4 = 0.2
    min_p = _restrict_support(probs.clone(), [req(min_p=0.5)])
    assert (min_p[0, :3] > 0).all() and (min_p[0, 3:] == 0).all()
    assert torch.allclose(min_p.sum(-1), torch.ones(1))


def test_sampling_only_draws_from_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    allowed = set(logits[0].topk(3).indices.tolist())
    s = Sampler(V, (), 0)
    for seed in range(50):
        r = req(temperature=1.0, top_k=3, seed=seed)
        assert s(logits.clone(), [r], None).next_ids[0] in allowed


def test_seed_is_independent_of_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    s = Sampler(V, (), 0)
    a = req(temperature=1.0, seed=42)
    alone = s(logits[:1].clone(), [a], None).next_ids[0]
    others = [req(temperature=0.7), req(temperature=1.0, seed=7), req(temperature=0.0)]
    in_batch = s(torch.cat([logits[1:], logits[:1]]).clone(), others + [a], None).next_ids[-1]
    assert alone == in_batch


def test_penalties_change_distribution_as_specified():
    s = Sampler(V, (), 0)
    logits = torch.zeros(1, V)
    logits[0, 5] = 2.0
    r = req(temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5)
    r.output_ids = [5, 5, 3]
    out = logits.clone()
    s._apply_penalties(out, 0, r)
    assert out[0, 5] == 2.0 - 2 * 1.0 - 0.5
    assert out[0, 3] == -1.5
    assert out[0, 0] == 0.0
    rep = req(temperature=0.0, repetition_penalty=2.0)
    out = torch.tensor([[4.0, -4.0, 1.0] + [0.0] * (V - 3)])
    rep.input_ids = [0, 1]
    s._apply_penalties(out, 0, rep)
    assert out[0, :3].tolist() == [2.0, -8.0, 1.0]


def test_min_new_tokens_blocks_eos_and_stop_ids():
    s = Sampler(V, (9,), 0)
    logits = torch.zeros(1, V)
    logits[0, 9] = 10.0
    logits[0, 8] = 9.0
    r = req(temperature=0.0, min_new_tokens=2, max_new_tokens=4, stop_token_ids=[8])
    assert s(logits.clone(), [r], None).next_ids[0] not in (8, 9)
    r.output_ids = [1, 2]
    assert s(logits.clone(), [r], None).next_ids[0] == 9


def test_ids_beyond_the_tokenizer_are_never_sampled():
    s = Sampler(V - 2, (), 0)
    logits = torch.zeros(1, V)
    logits[0, V - 1] = 100.0
    assert s(logits, [req(temperature=0.0)], None).next_ids[0] < V - 2


def test_argmax_rows_is_argmax_with_its_tie_breaking():
    from plait.runtime.sampler import argmax_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4096, generator=g)
    x[1, 3000] = x[1, 100] = 50.0  # a tie across chunks: the first wins
    x[2, 10] = x[2, 11] = 50.0  # a tie inside a chunk
    x[3] = float("-inf")  # a fully masked row
    x[4, ::7] = 9.0  # many ties
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    odd = torch.randn(3, 1000, generator=g)  # not a multiple of the chunk: plain argmax
    assert torch.equal(argmax_rows(odd), odd.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, ::2]), x[:, ::2].argmax(dim=-1))  # non-contiguous
