"""Whether every string one regex tree matches is matched by another (`includes`).

A JSON-schema string with both a `format` and a `pattern` must match both; plait writes one
regex for it, so it takes the format's regex where every string of it matches the pattern
(`{"format": "date", "pattern": "^\\d{4}-\\d{2}-\\d{2}$"}`), or the pattern where every
string of it is of the format. Deciding that needs automata: the tree (regex_syntax) becomes
a nondeterministic automaton over character sets (Thompson's construction, counted repeats
unrolled), and a search over (state of the contained one, set of states of the containing
one) looks for a string the first accepts and the second does not. Both are bounded: past
MAX_STATES states or MAX_PAIRS pairs the answer is None (undecided), and plait refuses.
"""

from __future__ import annotations

import bisect
from collections import deque

from plait.grammar.regex_syntax import Alt, Char, CharSet, Node, Repeat, Seq

MAX_STATES = 20_000
MAX_PAIRS = 50_000


class _TooBig(Exception):
    pass


class _Automaton:
    """States 0..n-1; `moves[s]`: (character set, next state); `empty[s]`: moves on no
    character. Accepts from `start` at `end`."""

    def __init__(self, node: Node) -> None:
        self.moves: list[list[tuple[CharSet, int]]] = []
        self.empty: list[list[int]] = []
        self.start = self._state()
        self.end = self._build(node, self.start)
        self._closures: dict[int, frozenset[int]] = {}

    def _state(self) -> int:
        if len(self.moves) >= MAX_STATES:
            raise _TooBig
        self.moves.append([])
        self.empty.append([])
        return len(self.moves) - 1

    def _build(self, node: Node, start: int) -> int:
        """Adds the states that match node from `start`; returns the state it ends in."""
        if isinstance(node, Char):
            end = self._state()
            self.moves[start].append((node.chars, end))
            return end
        if isinstance(node, Seq):
            for item in node.items:
                start = self._build(item, start)
            return start
        if isinstance(node, Alt):
            end = self._state()
            for option in node.options:
                self.empty[self._build(option, start)].append(end)
            return end
        assert isinstance(node, Repeat)
        for _ in range(node.lo):
            start = self._build(node.item, start)
        if node.hi is None:
            loop = self._state()
            self.empty[start].append(loop)
            self.empty[self._build(node.item, loop)].append(loop)
            return loop
        end = self._state()
        self.empty[start].append(end)
        for _ in range(node.hi - node.lo):
            start = self._build(node.item, start)
            self.empty[start].append(end)
        return end

    def closure(self, states) -> frozenset[int]:
        out: set[int] = set()
        todo = list(states)
        while todo:
            s = todo.pop()
            if s not in out:
                out.add(s)
                todo.extend(self.empty[s])
        return frozenset(out)

    def step(self, states: frozenset[int], cs: CharSet) -> dict[frozenset[int], None]:
        """The distinct state sets reached from `states` on the characters of cs (one per
        part of cs on which the moves agree; the empty set where none moves)."""
        moves = [(ranges, target) for s in states for ranges, target in self.moves[s]]
        points = sorted({p for lo, hi in cs for p in (lo, hi + 1)}
                        | {p for ranges, _ in moves for lo, hi in ranges for p in (lo, hi + 1)})
        starts = [lo for lo, _ in cs]
        reached: dict[frozenset[int], None] = {}
        for p in points[:-1]:  # each part [p, next point) lies wholly in or out of every set
            k = bisect.bisect_right(starts, p) - 1
            if k < 0 or p > cs[k][1]:
                continue  # outside cs
            targets = [t for ranges, t in moves if _member(ranges, p)]
            reached[self.closure(targets)] = None
        return reached


def _member(ranges: CharSet, code: int) -> bool:
    k = bisect.bisect_right(ranges, (code, 0x10FFFF + 1)) - 1
    return k >= 0 and ranges[k][0] <= code <= ranges[k][1]


def includes(outer: Node, inner: Node) -> bool | None:
    """True when every string `inner` matches, `outer` matches too; False when one does not;
    None when the automata or the search grow past their bounds."""
    try:
        a, b = _Automaton(inner), _Automaton(outer)
    except _TooBig:
        return None
    first = (a.start, b.closure([b.start]))
    seen = {first}
    todo = deque([first])
    while todo:
        state, states = todo.popleft()
        if state == a.end and b.end not in states:
            return False
        following = [(s, states) for s in a.empty[state]]
        for cs, target in a.moves[state]:
            following += [(target, reached) for reached in b.step(states, cs)]
        for pair in following:
            if pair not in seen:
                if len(seen) >= MAX_PAIRS:
                    return None
                seen.add(pair)
                todo.append(pair)
    return True
