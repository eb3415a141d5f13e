"""The llama.cpp peer's prefill plan (benchmarks/peers.py): a trie of the prompts in which every
token of every prompt is evaluated exactly once in its own sequence or inherited from a sequence
that evaluated that very prefix at an earlier level. Replaying the plan must rebuild each
prompt; this runs without llama.cpp (the plan is pure Python)."""

import random

from benchmarks.peers import LlamaCppPeer


def replay(prompts):
    levels = LlamaCppPeer.plan(prompts)
    seqs: dict[int, list[int]] = {}
    evaluated = 0
    for level in levels:
        before = {s: list(t) for s, t in seqs.items()}  # copies read the previous levels
        for seq, a, e, src in level:
            if src is not None and src != seq:
                assert len(before[src]) >= a and before[src][:a] == prompts[src][:a]
                seqs[seq] = list(before[src][:a])
            else:
                seqs.setdefault(seq, [])
            assert len(seqs[seq]) == a, "a segment starts where its sequence ends"
            seqs[seq] += prompts[seq][a:e]
            evaluated += e - a
    for i, p in enumerate(prompts):
        assert seqs[i] == p
    return evaluated


def test_shared_rubric_evaluated_once():
    rng = random.Random(0)
    rubric = [rng.randrange(100, 1000) for _ in range(300)]
    prompts = [rubric + [rng.randrange(100, 1000) for _ in range(rng.randint(5, 9))]
               for _ in range(16)]
    evaluated = replay(prompts)
    assert evaluated == len(rubric) + sum(len(p) - len(rubric) for p in prompts)


def test_tree_branches_duplicates_and_prefixes():
    rng = random.Random(1)
    root = [rng.randrange(100, 1000) for _ in range(50)]
    branches = [root + [rng.randrange(100, 1000) for _ in range(10)] for _ in range(3)]
    forks = [b + [rng.randrange(100, 1000) for _ in range(4)] for b in branches for _ in range(3)]
    prompts = forks + [list(forks[0]), root[:20] + [1, 2], root[:51], [7]]
    evaluated = replay(prompts)
    assert evaluated < sum(len(p) for p in prompts) // 3  # the shared parts once


def test_disjoint_prompts_are_all_leaves():
    prompts = [[i, i + 1, i + 2] for i in range(0, 30, 3)]
    assert LlamaCppPeer.plan(prompts) == [[(i, 0, 3, None) for i in range(10)]]
