"""RadixCache: match/insert/split/evict/lock, and a property test over random operations."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.radix_cache.kv_pool import KVPool
from plait.radix_cache.radix_cache import RadixCache


def make(size: int = 64, disable: bool = False) -> tuple[KVPool, RadixCache]:
    pool = KVPool(size, num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    return pool, RadixCache(pool, disable=disable)


def put(pool: KVPool, cache: RadixCache, ids: list[int]) -> torch.Tensor:
    """Simulate a finished request: allocate KV for ids and give it to the cache."""
    kv_prefix, node = cache.match_prefix(ids)
    cache.inc_lock_ref(node)
    new = pool.alloc(len(ids) - kv_prefix.numel())
    kv = torch.cat([kv_prefix, new])
    cache.cache_finished_req(ids, kv, kv_prefix.numel(), node)
    return kv


def accounted(pool: KVPool, cache: RadixCache) -> int:
    return pool.free_size + cache.evictable_size() + cache.protected_size()


def test_match_insert_and_split():
    pool, cache = make()
    kv = put(pool, cache, [1, 2, 3, 4])
    got, node = cache.match_prefix([1, 2, 3, 4, 5])
    assert got.tolist() == kv.tolist()
    got, node = cache.match_prefix([1, 2, 9])  # ends inside the edge: split at 2
    assert got.tolist() == kv[:2].tolist()
    assert node.key == [1, 2]
    assert sorted(len(c.key) for c in node.children.values()) == [2]
    cache.check_integrity()
    put(pool, cache, [1, 2, 7, 8])
    assert cache.evictable_size() == 6
    assert accounted(pool, cache) == pool.size
    cache.check_integrity()


def test_insert_returns_already_cached_length():
    pool, cache = make()
    put(pool, cache, [5, 6, 7])
    kv = pool.alloc(5)
    assert cache.insert([5, 6, 7, 8, 9], kv) == 3  # caller still owns kv[:3] (duplicates)
    pool.free(kv[:3])
    assert accounted(pool, cache) == pool.size
    cache.check_integrity()


def test_lock_protects_from_eviction():
    pool, cache = make()
    put(pool, cache, [1, 2, 3])
    put(pool, cache, [4, 5])
    _, node = cache.match_prefix([1, 2, 3])
    cache.inc_lock_ref(node)
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    assert cache.evict(100) == 2  # only the unlocked leaf goes
    assert cache.match_prefix([1, 2, 3])[0].numel() == 3
    assert cache.match_prefix([4, 5])[0].numel() == 0
    cache.dec_lock_ref(node)
    assert cache.evictable_size() == 3 and cache.protected_size() == 0
    cache.check_integrity()


def test_evict_is_lru_and_frees_parents():
    pool, cache = make()
    put(pool, cache, [1, 2, 3])
    put(pool, cache, [1, 2, 4])
    put(pool, cache, [9, 9])
    cache.match_prefix([9, 9])  # touch: most recent
    freed = cache.evict(2)
    assert freed >= 2
    assert cache.match_prefix([9, 9])[0].numel() == 2  # the recently used one survives
    cache.evict(100)
    assert cache.total_size() == 0 and pool.free_size == pool.size
    cache.check_integrity()


def test_disabled_cache_keeps_interface():
    pool, cache = make(disable=True)
    kv = put(pool, cache, [1, 2, 3])
    assert kv.numel() == 3
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    assert pool.free_size == pool.size
    assert cache.evict(10) == 0


def test_flush_refused_while_locked():
    pool, cache = make()
    put(pool, cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    assert not cache.flush()
    cache.dec_lock_ref(node)
    assert cache.flush()
    assert pool.free_size == pool.size


ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.lists(st.integers(0, 4), min_size=1, max_size=12)),
        st.tuples(st.just("lock"), st.lists(st.integers(0, 4), min_size=1, max_size=12)),
        st.tuples(st.just("unlock"), st.integers(0, 10)),
        st.tuples(st.just("evict"), st.integers(0, 20)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_accounting(operations):
    pool, cache = make(size=48)
    locked = []
    for op, arg in operations:
        if op == "put":
            need = len(arg) - cache.match_prefix(arg)[0].numel()
            if pool.free_size < need:
                cache.evict(need - pool.free_size)
            if pool.free_size >= need:
                put(pool, cache, arg)
        elif op == "lock":
            _, node = cache.match_prefix(arg)
            cache.inc_lock_ref(node)
            locked.append(node)
        elif op == "unlock" and locked:
            cache.dec_lock_ref(locked.pop(arg % len(locked)))
        elif op == "evict":
            cache.evict(arg)
        assert accounted(pool, cache) == pool.size
        cache.check_integrity()
    for node in locked:
        cache.dec_lock_ref(node)
    cache.evict(pool.size)
    assert pool.free_size == pool.size
    cache.check_integrity()


def test_a_pool_with_nothing_in_use_hands_out_ascending_runs_again():
    """Freed slots go back on the stack in the order they were freed (the radix cache's
    eviction order), and later allocations get them scattered; once nothing is in use the
    pool is laid out as new."""
    pool = KVPool(64, 1, 1, 4, torch.float32)
    a, b, c = pool.alloc(16), pool.alloc(16), pool.alloc(16)
    for slots in (b, a):
        pool.free(slots.flip(0))
    scattered = pool.alloc(24)  # c still in use: the freed order stands
    assert not torch.equal(scattered, torch.sort(scattered).values)
    pool.free(scattered)
    pool.free(c)
    assert pool.free_size == 64
    fresh = pool.alloc(24)
    assert torch.equal(fresh, torch.arange(41, 65))  # one ascending run, from the top


def test_a_flushed_cache_leaves_the_pool_laid_out_as_new():
    pool = KVPool(64, 1, 1, 4, torch.float32)
    cache = RadixCache(pool)
    for start in (0, 10, 20):
        ids = list(range(start, start + 8))
        kv = pool.alloc(8)
        cache.cache_finished_req(ids, kv.flip(0), 0, cache.root)
    assert cache.flush() and pool.free_size == 64
    assert torch.equal(pool.alloc(8), torch.arange(57, 65))
