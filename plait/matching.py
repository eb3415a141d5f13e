"""Sequence matching shared by every layer: the common-prefix length (radix-tree keys,
in-batch prefix sharing, program tracing, chat-template diffs) and where a stop string may
start (the scheduler's stop check and the detokenizer's trimming must agree)."""

from __future__ import annotations

from collections.abc import Sequence

_CHUNK = 64  # elements compared at a time as slices (a C-level comparison) before one by one


def common_prefix_len(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of a and b (token id lists, tuples or strings).
    Whole chunks are compared as slices first: a 1,000-token shared prefix in 7 us instead of
    27 (the scheduler compares every waiting request's prompt with the batch's)."""
    n = min(len(a), len(b))
    i = 0
    while i + _CHUNK <= n and a[i : i + _CHUNK] == b[i : i + _CHUNK]:
        i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stop_search_start(before: str, stop: str) -> int:
    """Where to look for `stop` so that only an occurrence ending after `before` (the text
    preceding the newest token) is found: one starting earlier lies wholly in older text.
    Trailing U+FFFD (an incomplete UTF-8 sequence) is not counted as text."""
    return max(0, len(before.rstrip("\ufffd")) - len(stop) + 1)
