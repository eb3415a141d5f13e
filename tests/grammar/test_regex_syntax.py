"""The portable regex printer: what it prints matches only what the source regex matches
(checked with Python's re on strings hypothesis draws from the printed regex), JSON-string
mode yields valid JSON string contents, and unsupported features are refused by name."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plait.grammar.base import GrammarError
from plait.grammar.formats import FORMAT_PATTERNS
from plait.grammar.regex_syntax import (
    Alt,
    Char,
    Node,
    Seq,
    choices_regex,
    fold_length,
    json_key_regex,
    json_string_regex,
    length_range,
    normalize_regex,
    parse,
)
from tests.grammar.strategies import regexes

SETTINGS = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)


def sample(node: Node, rng: random.Random) -> str:
    """A random string of the tree's language (repeats capped at lo + 3)."""
    if isinstance(node, Char):
        lo, hi = rng.choice(node.chars)
        return chr(rng.randint(lo, hi))
    if isinstance(node, Seq):
        return "".join(sample(item, rng) for item in node.items)
    if isinstance(node, Alt):
        return sample(rng.choice(node.options), rng)
    top = node.lo + 3 if node.hi is None else min(node.hi, node.lo + 3)
    return "".join(sample(node.item, rng) for _ in range(rng.randint(node.lo, top)))


@SETTINGS
@given(regexes(), st.integers(0, 2**32))
def test_printed_regex_is_sound(source, seed):
    printed = normalize_regex(source)
    tree = parse(printed, "regex")  # the printed text, read back by Python's parser
    rng = random.Random(seed)
    for _ in range(10):
        text = sample(tree, rng)
        assert re.fullmatch(source, text), (source, printed, text)


@SETTINGS
@given(regexes(), st.integers(0, 3), st.none() | st.integers(0, 8), st.integers(0, 2**32))
def test_json_string_regex_gives_valid_json_strings(source, low, high, seed):
    high = None if high is None else max(low, high)
    try:
        printed = json_string_regex(source, low, high)
    except GrammarError:
        return  # lengths that do not combine with this pattern are refused, by design
    tree = parse(printed, "regex")
    rng = random.Random(seed)
    for _ in range(10):
        raw = sample(tree, rng)
        value = json.loads(f'"{raw}"')
        assert re.search(source, value), (source, printed, raw)
        assert low <= len(value) and (high is None or len(value) <= high)


@pytest.mark.parametrize("fmt", sorted(FORMAT_PATTERNS))
def test_formats_pass_jsonschema_format_checker(fmt):
    from jsonschema import Draft202012Validator

    checker = Draft202012Validator.FORMAT_CHECKER
    tree = parse(json_string_regex(FORMAT_PATTERNS[fmt]), "regex")
    rng = random.Random(0)
    for _ in range(300):
        value = json.loads(f'"{sample(tree, rng)}"')
        assert checker.conforms(value, fmt), (fmt, value)


def test_json_mode_escapes_what_json_must_escape():
    printed = json_string_regex('^a"b\\\\c\\n$')
    assert re.fullmatch(printed, 'a\\"b\\\\c\\n')
    assert not re.fullmatch(printed, 'a"b\\c\n')


def test_class_escapes_mean_the_same_in_python_and_ecma():
    assert normalize_regex(r"\d") == "[0-9]"
    assert re.fullmatch(normalize_regex(r"\D"), "a")
    assert not re.fullmatch(normalize_regex(r"\D"), "\u0663")  # Arabic-Indic 3: a Python \d


def test_lengths_fold_into_one_variable_part():
    assert json_string_regex(r"^ab[0-9]*c$", 5, 6) == "ab[0-9]{2,3}c"
    assert json_string_regex(r"^[a-z]+$", 0, 3) == "[a-z]{1,3}"
    with pytest.raises(GrammarError, match="cannot be satisfied"):
        json_string_regex(r"^\d{4}$", 0, 3)
    with pytest.raises(GrammarError, match="cannot be satisfied"):
        json_string_regex(r"^(ab)+$", 3, 3)


def test_lengths_are_shared_among_several_variable_parts():
    """Several parts vary: each gets a share of the lengths (a subset of the strings of an
    allowed length, never one outside them); the split is even where the parts have room."""
    assert json_string_regex(r"^a+b+$", 0, 3) == "a{1,2}b{1}"
    assert json_string_regex(r"^a+b+$", 5, 8) == "a{3,5}b{2,3}"
    assert json_string_regex(r"^(?:x[0-9]+)*$", 10, 12) == "x[0-9]{4,5}x[0-9]{4,5}"  # spelled out
    assert json_string_regex(r"^[A-Z]{2}-[0-9]+-[a-z]+$", 0, 20) == "[A-Z]{2}\\-[0-9]{1,8}\\-[a-z]{1,8}"


@pytest.mark.parametrize("fmt, low, high", [
    ("email", 0, 100), ("email", 12, 40), ("uri", 0, 2048), ("uri", 20, 60),
    ("date-time", 0, 30), ("hostname", 0, 20), ("ipv6", 0, 30), ("duration", 0, 12),
    ("json-pointer", 3, 16), ("uri-reference", 0, 40),
])
def test_formats_with_lengths_stay_in_the_format_and_the_lengths(fmt, low, high):
    """A format's regex has several variable parts: with minLength/maxLength every sampled
    value still passes jsonschema's format checker and has an allowed length, and the lengths
    reached span most of the range (the split leaves little of the budget unused)."""
    from jsonschema import Draft202012Validator

    checker = Draft202012Validator.FORMAT_CHECKER
    lo, hi = length_range(fold_length(parse(FORMAT_PATTERNS[fmt], "regex"), low, high, "$"))
    natural = length_range(parse(FORMAT_PATTERNS[fmt], "regex"))
    least, most = max(low, natural[0]), min(high, natural[1] or high)
    assert least <= lo <= least + 2 and 0.8 * most <= hi <= high, (lo, hi)
    tree = parse(json_string_regex(FORMAT_PATTERNS[fmt], low, high), "regex")
    rng = random.Random(0)
    for _ in range(300):
        value = json.loads(f'"{sample(tree, rng)}"')
        assert checker.conforms(value, fmt), (fmt, value)
        assert low <= len(value) <= high, (fmt, value)


def test_choices_are_exact_and_escaped():
    printed = choices_regex(["a.b", "(x)", 'q"\\'])
    for option in ["a.b", "(x)", 'q"\\']:
        assert re.fullmatch(printed, option)
    assert not re.fullmatch(printed, "axb")


@pytest.mark.parametrize(
    ("pattern", "feature"),
    [
        (r"(?=a)a", "look-ahead"),
        (r"(?<!a)b", "look-ahead/look-behind"),
        (r"(a)\1", "back-reference"),
        (r"a\bb", "word boundary"),
        (r"(?i)a", "ignore-case"),
        (r"a^b", "anchor"),
        (r"a++", "possessive"),
        (r"(?(1)a|b)", "invalid regular expression|conditional"),
        (r"[", "invalid regular expression"),
        (r"\p{L}", "invalid regular expression"),
    ],
)
def test_unsupported_features_are_named(pattern, feature):
    with pytest.raises(GrammarError, match=feature) as info:
        normalize_regex(pattern)
    assert info.value.param == "regex"


def test_edge_anchors_and_named_groups_are_accepted():
    assert normalize_regex(r"^(?:a|b)$") == "[a-b]"
    assert re.fullmatch(normalize_regex(r"(?<year>\d{4})"), "2024")  # ECMA named group


def test_uri_hosts_have_no_counted_label_repetition():
    """xgrammar caches no token mask for a counted repetition: a uri's host labels are plain
    stars (RFC 3986's reg-name has no label limit; formats.py), hostname keeps its 63."""
    uri = FORMAT_PATTERNS["uri"]
    assert "{0,61}" not in uri and "{0,2}" not in uri
    assert re.fullmatch(uri, "https://" + "a" * 100 + ".example.org:8080/x?y=1")
    assert not re.fullmatch(FORMAT_PATTERNS["hostname"], "a" * 64)


@pytest.mark.parametrize(("pattern", "names"), [
    ("^[ab]*$", ["", "a", "ab", "bab"]),
    ("^[ab]+$", ["b", "ba", "/"]),  # "/" is no key of the pattern: nothing to take out
    (".*", ["ab", "a/b", "a"]),
])
def test_key_regex_leaves_out_exactly_the_declared_names(pattern, names):
    key = json_key_regex(pattern, names)
    words = [""] + ["".join(p) for n in range(1, 5) for p in __import__("itertools").product(
        "ab/", repeat=n)]
    for word in words:
        expected = re.fullmatch(pattern.strip("^$"), word) is not None and word not in names
        assert (re.fullmatch(key, word) is not None) == expected, (pattern, names, word, key)


def test_key_regex_refuses_patterns_it_cannot_complement():
    assert json_key_regex("^x[0-9]+$", ["x1"]) is None


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
@pytest.mark.parametrize(("pattern", "text"), [
    ("a\t1", "a\t1"),  # a control character printed before a hex digit
    ("[\x01a]+", "aa"),
    ("[&b]+", "&b"),  # class characters escaped against set operations
    ("[~a]+", "a~"),
])
def test_printed_escapes_mean_the_same_character_to_each_backend(backends, tokenizer,
                                                                 backend_name, pattern, text):
    assert re.fullmatch(pattern, text)
    matcher = backends[backend_name].compile("regex", pattern).matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(matcher.accept_token(i) for i in ids) and matcher.can_terminate(), (
        normalize_regex(pattern))


@pytest.mark.parametrize("pattern", [
    r"^(?!@@)[\w@]+$", r"^(?![0-9])[a-z0-9]{2,5}$", r"^(?!-)[a-z-]*$", r"^(?!ab)[abc]{0,3}$",
    r"\A(?!a[0-9])[a-c0-9]{1,}$",
])
def test_a_leading_negative_look_ahead_is_spelled_exactly(pattern):
    """`^(?!prefix)` before one class repeated: the printed regex matches exactly the strings
    the pattern matches (every string of up to 5 characters over a small alphabet)."""
    printed = normalize_regex(pattern)
    whole = pattern.replace("$", r"\Z")  # Python's $ also takes a final newline: not in the alphabet
    for n in range(6):
        for chars_ in itertools.product("ab@c0-9", repeat=n):
            text = "".join(chars_)
            assert bool(re.fullmatch(whole, text)) == bool(re.fullmatch(printed, text)), (
                pattern, printed, text)


@pytest.mark.parametrize("pattern", [r"^(?!a+)[ab]*$", r"^(?!a)(?:ab)*$", r"^x(?!a)[ab]*$"])
def test_other_negative_look_aheads_are_refused(pattern):
    with pytest.raises(GrammarError, match="look-ahead"):
        normalize_regex(pattern)


@pytest.mark.parametrize("pattern", [
    r"(ab ){2,}", r"(?:a|b c){0,3}", r"(a(b c){2}){1,3}", r"(?:ab|c){3}b", r"(a b?){2,4}c",
])
def test_small_counted_groups_are_spelled_out_in_the_same_language(pattern):
    """xgrammar masks a counted repetition of a group without its token cache; the printed
    regex spells small counts out (no `){n}`, `){n,m}` left) and matches exactly the same
    strings: every string over the pattern's alphabet up to 9 characters is checked."""
    out = normalize_regex(pattern)
    assert not re.search(r"\)\{\d", out), out
    for n in range(10):
        for chars_ in itertools.product("abc ", repeat=n):
            s = "".join(chars_)
            assert bool(re.fullmatch(pattern, s)) == bool(re.fullmatch(out, s)), (s, out)


def test_large_counted_groups_are_spelled_in_part():
    """Spelling out is bounded (compile time grows with the text): past SPELL_COPIES copies, or
    SPELL_LEAVES character sets in all, the first copies are spelled and the rest stay counted
    after them, in the same language."""
    cases = {r"(ab){100}": "(?:ab){36}", r"(ab){3,70}": "(?:ab){0,6}", r"(ab){70,}": "(?:ab){6,}"}
    for pattern, rest in cases.items():
        out = normalize_regex(pattern)
        assert out.count(rest) == 1 and len(re.findall(r"\)\{", out)) == 1, out
        for k in range(120):
            assert bool(re.fullmatch(pattern, "ab" * k)) == bool(re.fullmatch(out, "ab" * k)), k
    nested = normalize_regex(r"((ab c){12}d){12}")  # 49 x 12 sets: 5 outer copies spelled
    assert nested.endswith("d){7}") and "){0}" not in nested, nested
    for k in range(14):
        s = ("ab c" * 12 + "d") * k
        assert bool(re.fullmatch(nested, s)) == (k == 12)
    assert len(normalize_regex(r"(" + "a" * 600 + "){2}")) < 1300  # over the budget: counted


def test_idn_hostname_labels_are_ones_idna_takes():
    """idna.encode (jsonschema's idn-hostname checker) refuses hyphens in both the 3rd and 4th
    places of a label, which a plain hostname allows: no label the format's regex matches has
    them (every label over a small alphabet up to 8 characters, each checked by idna)."""
    import idna

    pattern = FORMAT_PATTERNS["idn-hostname"]
    assert re.fullmatch(pattern, "example.com") and re.fullmatch(pattern, "a" * 63 + ".b")
    assert not re.fullmatch(pattern, "ab--cd.com") and not re.fullmatch(pattern, "a" * 64)
    for n in range(1, 9):
        for label in map("".join, itertools.product("a-1", repeat=n)):
            if re.fullmatch(pattern, label):
                idna.encode(label)  # raises for a label IDNA refuses
