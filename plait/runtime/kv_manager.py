"""KV bookkeeping for the scheduler: prefix matching, slot allocation with eviction, and
handing requests' KV to the radix cache when they finish, pause or are retracted."""

from __future__ import annotations

import torch

from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool
from plait.radix_cache.radix_cache import RadixCache
from plait.runtime.core import Req


class KVManager:
    """Slots for requests' KV, in runs: a request that allocates takes up to `run` slots more
    than it needs now when the pool has them free, set aside for its next tokens (positions
    [alloc_len, reserved_len) of its req_to_token row), so that its decode tokens sit in
    adjacent slots. Without runs, each decode step gave the batch's requests consecutive slots
    in turn, one request's tokens B slots apart: the decode attention kernel then reads one
    scattered 768-byte row per token (SmolLM2), which the hardware prefetcher cannot follow
    (benchmarks/decode_attention.py: batch 32 x 256 tokens, 20.9 ms a step on contiguous
    slots, 26.1 on the scheduler's old layout, 36.5 on a turned-over pool; AVX2 EPYC).
    Set-aside slots never cost an allocation: they are taken only from free slots (no eviction
    for them), count as available, and are taken back from their holders before an allocation
    would fail (reclaim)."""

    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, cache: RadixCache,
                 run: int = 16) -> None:
        if run < 0:
            raise ValueError(f"run: must be >= 0, got {run}")
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.cache = cache
        self.run = run
        self.reserved = 0  # slots set aside, over all holders
        self._holders: dict[int, Req] = {}  # id(req) -> a request with set-aside slots

    # ------------------------------------------------------------------ accounting
    @property
    def available(self) -> int:
        """Slots obtainable now: free, evictable, or set aside (reclaimable)."""
        return self.kv_pool.free_size + self.cache.evictable_size() + self.reserved

    @property
    def used(self) -> int:
        return self.kv_pool.size - self.available

    def match(self, req: Req) -> int:
        """Cached prefix length for req (no side effects besides tree splits and LRU touch)."""
        kv, _ = self.cache.match_prefix(req.all_ids[: self._match_limit(req)])
        return kv.numel()

    def _match_limit(self, req: Req) -> int:
        # the last token's logits are always computed, so never take the whole sequence
        limit = min(req.seq_len - 1, req.input_logprob_limit() if not req.output_ids else req.seq_len - 1)
        if req.missing_output_logprobs:  # (retracted) the rows predicting them are computed
            limit = min(limit, req.seq_len - req.missing_output_logprobs - 1)
        return limit

    # ------------------------------------------------------------------ lifecycle
    def admit(self, req: Req) -> bool:
        """Take a request slot, lock its cached prefix and point req_to_token at it."""
        idx = self.req_to_token.alloc()
        if idx is None:
            return False
        kv, node = self.cache.match_prefix(req.all_ids[: self._match_limit(req)])
        self.cache.inc_lock_ref(node)
        req.req_pool_idx, req.prefix_indices, req.last_node = idx, kv, node
        req.kv_len = req.alloc_len = req.reserved_len = kv.numel()
        self.req_to_token.write(idx, 0, kv)
        return True

    def alloc(self, req: Req, n: int) -> bool:
        """n new KV slots for req's next tokens (positions kv_len..kv_len+n): its set-aside
        slots first, then free ones (taking back other requests' set-aside slots, then evicting
        cache leaves, if needed), and, when the pool has them free, up to `run` more set aside
        in the same allocation (adjacent when the pool's free stack is). False if even that
        cannot free enough."""
        assert req.alloc_len == req.kv_len, "slots allocated twice for one forward"
        have = self._set_aside(req)
        take = min(have, n)
        need = n - take
        room = self.req_to_token.max_context - (req.kv_len + n)  # the row's end
        extra = max(0, min(self.run, req.remaining_new_tokens, room)) if need else 0
        if self.kv_pool.free_size < need + extra:
            extra = 0  # set aside only free slots
        if need:
            slots = self._alloc_slots(need + extra, req)
            if slots is None:
                return False
            self.req_to_token.write(req.req_pool_idx, req.kv_len + have, slots)
            req.reserved_len = req.kv_len + n + extra  # have == take here
        req.alloc_len = req.kv_len + n
        self.reserved += extra - take
        self._track(req)
        return True

    def commit(self, req: Req, n: int) -> None:
        """The forward computed the KV of req's next n allocated positions."""
        assert req.kv_len + n <= req.alloc_len, "committing KV that was never allocated"
        req.kv_len += n

    def free_uncommitted(self, req: Req) -> None:
        """The slots allocated past kv_len (rejected draft tokens) hold garbage KV: they are set
        aside again for the request's next tokens (the next allocation starts at kv_len)."""
        self.reserved += req.alloc_len - req.kv_len
        req.alloc_len = req.kv_len
        self._track(req)

    def _set_aside(self, req: Req) -> int:
        return max(0, req.reserved_len - req.alloc_len)

    def _track(self, req: Req) -> None:
        if self._set_aside(req):
            self._holders[id(req)] = req
        else:
            self._holders.pop(id(req), None)

    def _give_back(self, req: Req) -> None:
        """req's set-aside slots back to the pool."""
        n = self._set_aside(req)
        if n:
            self.kv_pool.free(self.req_to_token.read(req.req_pool_idx, req.reserved_len,
                                                     req.alloc_len))
            self.reserved -= n
        req.reserved_len = req.alloc_len
        self._holders.pop(id(req), None)

    def _alloc_slots(self, n: int, req: Req) -> torch.Tensor | None:
        """n free slots: taking back the other requests' set-aside slots before evicting
        cached prefixes (a cache hit is worth more than adjacent slots)."""
        if self.kv_pool.free_size < n:
            for holder in [h for h in self._holders.values() if h is not req]:
                self._give_back(holder)
                if self.kv_pool.free_size >= n:
                    break
        if self.kv_pool.free_size < n:
            self.cache.evict(n - self.kv_pool.free_size)
        return self.kv_pool.alloc(n)

    def cache_prefilled(self, req: Req) -> None:
        """After an extend: share the computed tokens through the tree while req runs on."""
        ids = req.all_ids[: req.kv_len]
        kv = self.req_to_token.read(req.req_pool_idx, req.kv_len)
        new_kv, node = self.cache.cache_unfinished_req(ids, kv, req.prefix_len, req.last_node)
        self.req_to_token.write(req.req_pool_idx, 0, new_kv)
        req.prefix_indices, req.last_node = new_kv, node

    def release(self, req: Req) -> None:
        """Req is finished, aborted or retracted: its computed KV goes to the cache (or back to
        the pool when the cache is off) and its request slot is freed."""
        if req.req_pool_idx is None:
            return
        self._give_back(req)
        if req.alloc_len > req.kv_len:  # a forward failed: these slots hold nothing
            self.kv_pool.free(self.req_to_token.read(req.req_pool_idx, req.alloc_len, req.kv_len))
        ids = req.all_ids[: req.kv_len]
        kv = self.req_to_token.read(req.req_pool_idx, req.kv_len)
        self.cache.cache_finished_req(ids, kv, req.prefix_len, req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node = None, None
        req.kv_len = req.alloc_len = req.reserved_len = 0
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)

    def flush(self) -> bool:
        return self.cache.flush()
