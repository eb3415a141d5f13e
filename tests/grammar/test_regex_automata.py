"""regex_automata.includes: whether every string of one regex tree is matched by another,
checked against Python's re on every short string over a small alphabet, and on the pairs a
JSON schema's format and pattern make."""

from __future__ import annotations

import itertools
import re

import pytest
from hypothesis import HealthCheck, given, settings

from plait.grammar import regex_automata
from plait.grammar.formats import FORMAT_PATTERNS
from plait.grammar.regex_automata import includes
from plait.grammar.regex_syntax import normalize_regex, parse
from tests.grammar.strategies import regexes

SETTINGS = settings(
    max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
SHORT = ["".join(t) for n in range(5) for t in itertools.product("ab0 .", repeat=n)]


def matched(regex: str) -> set[str]:
    printed = normalize_regex(regex)  # the tree's language, which includes() decides on
    return {text for text in SHORT if re.fullmatch(printed, text)}


@SETTINGS
@given(regexes(), regexes())
def test_includes_agrees_with_re_on_short_strings(outer, inner):
    got = includes(parse(outer, "regex"), parse(inner, "regex"))
    assert got is not None
    missing = matched(inner) - matched(outer)
    if missing:  # a short string of inner that outer does not match: never included
        assert got is False, (outer, inner, sorted(missing)[:3])
    if got:
        assert not missing


@pytest.mark.parametrize("outer, inner, want", [
    (r"^\d{4}-\d{2}-\d{2}$", FORMAT_PATTERNS["date"], True),
    (FORMAT_PATTERNS["date"], r"^\d{4}-\d{2}-\d{2}$", False),
    (r"^\d{4}-.*$", FORMAT_PATTERNS["date-time"], True),
    (r"^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}$", FORMAT_PATTERNS["ipv4"], True),
    (FORMAT_PATTERNS["ipv4"], r"^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}$", False),  # 999.1.1.1
    (FORMAT_PATTERNS["email"], r"^[a-z]+@example\.com$", True),
    (FORMAT_PATTERNS["email"], r"^[a-z]+@[a-z]+\.com$", False),  # a 64-letter label
    (FORMAT_PATTERNS["uri"], r"^https://[a-z]+\.org/[a-z]*$", True),
    (FORMAT_PATTERNS["uri"], r"^http://[a-z][a-z0-9-]{3,30}\.herokuapp\.com/$", False),  # "abc-."
    ("a*", "(?:aa)*", True),
    ("(?:aa)*", "a*", False),
    ("(?:a|b)*c", "a*b*c", True),
])
def test_includes_on_formats_and_patterns(outer, inner, want):
    assert includes(parse(outer, "regex"), parse(inner, "regex")) is want


def test_includes_is_undecided_past_its_bounds(monkeypatch):
    monkeypatch.setattr(regex_automata, "MAX_STATES", 50)
    assert includes(parse("a{0,100}", "regex"), parse("a{3}", "regex")) is None
    monkeypatch.setattr(regex_automata, "MAX_STATES", 20_000)
    monkeypatch.setattr(regex_automata, "MAX_PAIRS", 5)
    assert includes(parse("[ab]{0,20}", "regex"), parse("a{0,20}", "regex")) is None
