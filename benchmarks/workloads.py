"""Benchmark workloads as token-id inputs, generated deterministically so every engine gets
byte-identical prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    description: str

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # stay clear of the special tokens at the end of the vocabulary
    return [rng.randrange(256, vocab - 16) for _ in range(n)]


def judge(vocab: int, n: int = 64, rubric_len: int = 1000, item_len: int = 60, out: int = 8) -> Workload:
    rng = random.Random(1)
    rubric = _ids(rng, rubric_len, vocab)
    prompts = [rubric + _ids(rng, item_len + rng.randint(-5, 5), vocab) for _ in range(n)]
    return Workload("judge", prompts, out, f"{n} requests: {rubric_len}-token shared rubric + ~{item_len} unique, {out} out")


def decode(vocab: int, n: int = 32, prompt_len: int = 128, out: int = 128) -> Workload:
    rng = random.Random(2)
    prompts = [_ids(rng, prompt_len, vocab) for _ in range(n)]
    return Workload("decode", prompts, out, f"{n} requests: {prompt_len} distinct prompt tokens, {out} out")
