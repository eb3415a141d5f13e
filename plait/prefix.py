"""common_prefix_len: the one helper for "how long do two sequences agree from the start"
(radix-tree key matching, in-batch prefix sharing, program tracing, chat-template diffs)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of a and b (token id lists or strings)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
