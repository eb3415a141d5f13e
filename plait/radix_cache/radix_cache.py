"""Radix tree over token ids whose nodes own KV slots: every shared prefix is computed once.

Token-granular (page size 1). A node's `key` is a run of token ids and `value` their KV
slots. Requests lock the path to their last matched node (lock_ref) while they use it;
unlocked leaves are evicted least-recently-used first. Sizes are kept incrementally:
  kv_pool.free_size + evictable_size() + protected_size() + (slots held by running requests)
  == kv_pool.size
With `disable=True` the same interface caches nothing (every match is empty and finished
requests give their slots straight back), so on/off comparisons use one code path.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import TYPE_CHECKING

import torch

from plait.matching import common_prefix_len

if TYPE_CHECKING:
    from plait.radix_cache.kv_pool import KVPool

_EMPTY = torch.empty((0,), dtype=torch.int64)


class TreeNode:
    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> None:
        self.id = next(TreeNode._ids)
        self.key = key  # token ids of this edge
        self.value = value  # [len(key)] int64 KV slots
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = time.monotonic()

    def __lt__(self, other: TreeNode) -> bool:  # heap order for eviction
        return self.last_access < other.last_access

    @property
    def is_leaf(self) -> bool:
        return not self.children


class RadixCache:
    def __init__(self, kv_pool: KVPool, disable: bool = False) -> None:
        self.kv_pool = kv_pool
        self.disable = disable
        self.reset()

    def reset(self) -> None:
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable = 0
        self._protected = 0

    # ------------------------------------------------------------------ queries
    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    def match_prefix(self, ids: list[int]) -> tuple[torch.Tensor, TreeNode]:
        """KV slots of the longest cached prefix of ids, and the node where it ends.

        A match that ends inside a node splits it, so the returned node covers exactly the
        matched prefix (callers lock it)."""
        if self.disable or not ids:
            return _EMPTY, self.root
        node, values, pos = self.root, [], 0
        now = time.monotonic()
        node.last_access = now
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, ids[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + n
        kv = torch.cat(values) if values else _EMPTY
        return kv, node

    # ------------------------------------------------------------------ updates
    def insert(self, ids: list[int], kv_indices: torch.Tensor) -> int:
        """Add ids -> kv_indices; returns how many leading tokens were already cached. The
        caller still owns kv_indices[:returned] (duplicates it must free); the tree now owns
        the rest."""
        if self.disable:
            return 0
        assert len(ids) == kv_indices.numel()
        node, pos = self.root, 0
        now = time.monotonic()
        while pos < len(ids):
            node.last_access = now
            child = node.children.get(ids[pos])
            if child is None:
                new = TreeNode(list(ids[pos:]), kv_indices[pos:].clone(), node)
                node.children[ids[pos]] = new
                self._evictable += len(new.key)
                return pos
            n = common_prefix_len(child.key, ids[pos:])
            if n < len(child.key):
                child = self._split(child, n)
            node, pos = child, pos + n
        node.last_access = now
        return pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut child's edge after n tokens; returns the new upper node."""
        upper = TreeNode(child.key[:n], child.value[:n], child.parent)
        upper.lock_ref = child.lock_ref
        upper.last_access = child.last_access
        child.parent.children[child.key[0]] = upper
        child.key, child.value = child.key[n:], child.value[n:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root and node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root and node is not None:
            assert node.lock_ref > 0, "dec_lock_ref below zero"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Free at least num_tokens slots from unlocked leaves (LRU first); returns freed."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [n for n in self._nodes() if n.is_leaf and n.lock_ref == 0 and n is not self.root]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            leaf = heapq.heappop(heap)
            self.kv_pool.free(leaf.value)
            freed += len(leaf.key)
            self._evictable -= len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def flush(self) -> bool:
        """Drop every cached prefix; refused (False) while any request holds a lock."""
        if self._protected:
            return False
        self.evict(self._evictable)
        self.reset()
        return True

    # ------------------------------------------------------------------ request helpers
    def cache_finished_req(
        self, ids: list[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> None:
        """A request is done with ids (KV in kv_indices, first prefix_len from the tree)."""
        if self.disable:
            self.kv_pool.free(kv_indices)
            return
        cached = self.insert(ids, kv_indices)
        self.kv_pool.free(kv_indices[prefix_len:cached])
        self.dec_lock_ref(last_node)

    def cache_unfinished_req(
        self, ids: list[int], kv_indices: torch.Tensor, prefix_len: int, last_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """Share a running request's computed tokens; returns its new (kv_indices, node),
        with the node locked in place of last_node."""
        if self.disable:
            return kv_indices, self.root
        cached = self.insert(ids, kv_indices)
        self.kv_pool.free(kv_indices[prefix_len:cached])
        new_kv, node = self.match_prefix(ids)
        assert new_kv.numel() == len(ids), "inserted prefix not found again"
        self.inc_lock_ref(node)
        self.dec_lock_ref(last_node)
        return new_kv, node

    # ------------------------------------------------------------------ checks
    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_integrity(self) -> None:
        """Assert the tree's structure and size accounting (used by tests)."""
        evictable = protected = 0
        seen_slots: set[int] = set()
        for node in self._nodes():
            if node is self.root:
                continue
            assert node.key, "empty edge"
            assert len(node.key) == node.value.numel(), "key/value length mismatch"
            assert node.parent.children.get(node.key[0]) is node, "broken parent link"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, "lock_ref below a child's"
            slots = node.value.tolist()
            assert not seen_slots.intersection(slots), "a KV slot is owned twice"
            seen_slots.update(slots)
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable, f"evictable {self._evictable} != {evictable}"
        assert protected == self._protected, f"protected {self._protected} != {protected}"
