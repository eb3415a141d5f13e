"""Random walks through a Matcher: the test oracle's source of outputs.

Each step samples uniformly among the allowed tokens of one of three groups, itself picked
uniformly among the non-empty ones: EOS, tokens made only of JSON punctuation, any token. Pure
uniform sampling over ~8k tokens would almost never close a string (1 token in 8000), so no
walk would finish and the validity check would be vacuous; the groups keep every allowed token
reachable while letting walks terminate. Outputs are the exact bytes of the tokens (no
detokenizer clean-up), which is what a grammar constrains.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from plait.grammar.base import Matcher, allocate_token_bitmask

_SHIFTS = torch.arange(32, dtype=torch.int32)


def allowed_ids(matcher: Matcher, vocab_size: int) -> torch.Tensor:
    """bool [vocab_size] of the tokens the matcher allows now."""
    mask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(mask, 0)
    return ((mask[0][:, None] >> _SHIFTS) & 1).bool().reshape(-1)[:vocab_size]


@dataclass
class Walk:
    tokens: list[int]
    text: str
    terminated: bool
    stuck: bool = False


class Walker:
    def __init__(self, spelled: list[bytes | None], vocab_size: int, eos_ids: list[int]) -> None:
        self.spelled = spelled
        self.vocab_size = vocab_size
        self.eos = torch.zeros(vocab_size, dtype=torch.bool)
        self.eos[eos_ids] = True
        self.punct = torch.zeros(vocab_size, dtype=torch.bool)
        for i, b in enumerate(spelled):
            self.punct[i] = bool(b) and all(c in b'"{}[],: ' for c in b)

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.spelled[t] or b"" for t in tokens).decode("utf-8")

    def walk(self, matcher: Matcher, seed: int, max_steps: int = 200) -> Walk:
        rng = random.Random(seed)
        tokens: list[int] = []
        for _ in range(max_steps):
            allowed = allowed_ids(matcher, self.vocab_size)
            groups = [g for g in (allowed & self.eos, allowed & self.punct, allowed) if g.any()]
            if not groups:
                return Walk(tokens, "", terminated=False, stuck=True)
            token = rng.choice(rng.choice(groups).nonzero().flatten().tolist())
            assert matcher.accept_token(token), f"allowed token {token} was rejected"
            if matcher.is_terminated():
                return Walk(tokens, self.text(tokens), terminated=True)
            tokens.append(token)
        return Walk(tokens, "", terminated=False)
