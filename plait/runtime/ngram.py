"""N-gram (prompt-lookup) drafts for speculative decoding.

A request's next tokens often copy a span of its own prompt or output (extraction, quoting,
code edits). The proposer finds the latest earlier occurrence of the sequence's last n tokens
(longest n first) and proposes the k tokens that followed it; the scheduler verifies them in
one forward and keeps the prefix the model itself would have produced.

The index is incremental: each request keeps a dict per n-gram size from the n-gram to the end
of its latest occurrence that has a following token, so proposing costs O(new tokens) per step
instead of a scan of the whole sequence.
"""

from __future__ import annotations

import math


class NgramIndex:
    """One request's n-grams (sizes min_n..max_n) -> end of their latest occurrence."""

    def __init__(self, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed_end = 0  # n-grams ending at or before this (exclusive end) are indexed
        self.acceptance = 1.0  # moving average of the accepted fraction of this one's drafts
        self.last_full = False  # the last draft was accepted whole

    def draft_len(self, k: int) -> int:
        """Draft length for this request: k scaled by its recent acceptance (at least 1, so a
        request whose drafts started matching again is noticed), k itself right after a draft
        accepted whole. The average climbs back slowly after rejections (4, 5, 6, 7 of 8 while
        a loop's drafts are all kept); a whole acceptance says the text has turned predictable
        (SmolLM2 on the Xeon VM, `benchmarks.speculative --batch 1 --speculative-ngram 8`:
        extract 84.8 -> 89.3 tok/s, decode 207.7 -> 243.1; batch 4 even; the JSON extraction's
        tail 27 -> 26 forwards)."""
        if self.last_full:
            return k
        return max(1, math.ceil(k * self.acceptance))

    def record(self, proposed: int, accepted: int) -> None:
        self.acceptance = 0.7 * self.acceptance + 0.3 * (accepted / proposed)
        self.last_full = accepted == proposed

    def _update(self, ids: list[int]) -> None:
        # index the n-grams that end before the last token: each has a follower to propose,
        # and the sequence's own suffix is never matched against itself
        for end in range(self.indexed_end + 1, len(ids)):
            for n, ends in self.ends.items():
                if end >= n:
                    ends[tuple(ids[end - n : end])] = end
        self.indexed_end = max(self.indexed_end, len(ids) - 1)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """The k tokens that followed the latest earlier match of ids' longest suffix n-gram.
        A match p < k tokens before the end is a loop of period p (the sequence repeats its
        last p tokens): the draft goes on around it, as the loop would (a model repeating
        `-1-1-1` is drafted 4 tokens at a time, not the 2 that followed the match)."""
        if k <= 0:
            return []
        self._update(ids)
        for n in range(min(self.max_n, len(ids)), self.min_n - 1, -1):
            end = self.ends[n].get(tuple(ids[-n:]))
            if end is not None:
                period = len(ids) - end  # (>= k: the k tokens after the match, no wrap)
                return [ids[end + i % period] for i in range(k)]
        return []


def likely_tokens(acceptance: float, most: int, odds: float = 0.5) -> int:
    """How many leading draft tokens (at most `most`) are kept with probability >= odds, each
    token kept with probability `acceptance` (the request's recent rate) after its predecessor
    was: the largest j with acceptance ** j >= odds."""
    if acceptance >= 1.0:
        return most
    if acceptance < odds:
        return 0
    return min(most, int(math.log(odds) / math.log(acceptance) + 1e-9))


def accepted_prefix(draft: list[int], targets: list[int]) -> int:
    """How many draft tokens the model agrees with: targets[i] is the model's token after the
    sequence extended by draft[:i]."""
    n = 0
    while n < len(draft) and targets[n] == draft[n]:
        n += 1
    return n
