"""KV bookkeeping for the scheduler: prefix matching, slot allocation with eviction, and
handing requests' KV to the radix cache when they finish, pause or are retracted."""

from __future__ import annotations

import torch

from plait.radix_cache.kv_pool import KVPool, ReqToTokenPool
from plait.radix_cache.radix_cache import RadixCache
from plait.runtime.core import Req


class KVManager:
    def __init__(self, kv_pool: KVPool, req_to_token: ReqToTokenPool, cache: RadixCache) -> None:
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token
        self.cache = cache

    # ------------------------------------------------------------------ accounting
    @property
    def available(self) -> int:
        """Slots obtainable now: free plus evictable."""
        return self.kv_pool.free_size + self.cache.evictable_size()

    @property
    def used(self) -> int:
        return self.kv_pool.size - self.kv_pool.free_size - self.cache.evictable_size()

    def match(self, req: Req) -> int:
        """Cached prefix length for req (no side effects besides tree splits and LRU touch)."""
        kv, _ = self.cache.match_prefix(req.all_ids[: self._match_limit(req)])
        return kv.numel()

    def _match_limit(self, req: Req) -> int:
        # the last token's logits are always computed, so never take the whole sequence
        return min(req.seq_len - 1, req.input_logprob_limit() if not req.output_ids else req.seq_len - 1)

    # ------------------------------------------------------------------ lifecycle
    def admit(self, req: Req) -> bool:
        """Take a request slot, lock its cached prefix and point req_to_token at it."""
        idx = self.req_to_token.alloc()
        if idx is None:
            return False
        kv, node = self.cache.match_prefix(req.all_ids[: self._match_limit(req)])
        self.cache.inc_lock_ref(node)
        req.req_pool_idx, req.prefix_indices, req.last_node = idx, kv, node
        req.kv_len = req.alloc_len = kv.numel()
        self.req_to_token.write(idx, 0, kv)
        return True

    def alloc(self, req: Req, n: int) -> bool:
        """n new KV slots for req's next tokens (positions kv_len..kv_len+n), evicting cache
        leaves if needed. False if even eviction cannot free enough."""
        assert req.alloc_len == req.kv_len, "slots allocated twice for one forward"
        slots = self._alloc_slots(n)
        if slots is None:
            return False
        self.req_to_token.write(req.req_pool_idx, req.kv_len, slots)
        req.alloc_len = req.kv_len + n
        return True

    def commit(self, req: Req, n: int) -> None:
        """The forward computed the KV of req's next n allocated positions."""
        assert req.kv_len + n <= req.alloc_len, "committing KV that was never allocated"
        req.kv_len += n

    def free_uncommitted(self, req: Req) -> None:
        """Give back the slots allocated past kv_len (rejected draft tokens): their KV is
        garbage and the next allocation starts at kv_len again."""
        if req.alloc_len > req.kv_len:
            self.kv_pool.free(self.req_to_token.read(req.req_pool_idx, req.alloc_len, req.kv_len))
        req.alloc_len = req.kv_len

    def _alloc_slots(self, n: int) -> torch.Tensor | None:
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
        if req.alloc_len > req.kv_len:  # a forward failed: these slots hold nothing
            self.kv_pool.free(self.req_to_token.read(req.req_pool_idx, req.alloc_len, req.kv_len))
        ids = req.all_ids[: req.kv_len]
        kv = self.req_to_token.read(req.req_pool_idx, req.kv_len)
        self.cache.cache_finished_req(ids, kv, req.prefix_len, req.last_node)
        self.req_to_token.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len, req.alloc_len = None, None, 0, 0
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)

    def flush(self) -> bool:
        return self.cache.flush()
