"""Model-free building blocks for the fast unit tests: a character tokenizer and a real
KVManager (KVPool + ReqToTokenPool + RadixCache) of a given size, no model weights."""

from __future__ import annotations

import torch

from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool
from plait.radix_cache.radix_cache import RadixCache
from plait.runtime.core import Req
from plait.runtime.kv_manager import KVManager
from plait.sampling import SamplingParams


class CharTokenizer:
    """Token id = code point: decode is exact and every character is one token, so a test
    states its token sequence as a string."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def make_kv(size: int = 64, max_reqs: int = 4, max_context: int = 64, cache: bool = True,
            run: int = 0) -> KVManager:
    """run=0 (nothing set aside): a test counts exact slots; the runs have tests of their own."""
    pool = KVPool(size, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return KVManager(pool, ReqToTokenPool(max_reqs, max_context), RadixCache(pool, disable=not cache),
                     run=run)


def make_req(rid: str, prompt: list[int], priority: int = 0, **sampling) -> Req:
    return Req(rid=rid, input_ids=list(prompt), sampling=SamplingParams(**sampling),
               priority=priority)
