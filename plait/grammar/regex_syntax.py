"""Regexes in one portable dialect that both grammar backends read the same way.

A user regex (or a JSON-schema `pattern`) is parsed with Python's own `re` parser, so its meaning
is Python's (what `re.fullmatch` and jsonschema's `pattern` check use), turned into a tiny tree
(one character from a set, sequence, alternation, repetition), and printed back with explicit
character ranges. xgrammar and outlines-core then never see `\\d`, `\\w`, `.` or `[^...]`, whose
meaning differs between Python, ECMA-262, Rust and xgrammar. Features a regular-language engine
cannot enforce (look-around, back-references, word boundaries, flags, anchors inside) raise
GrammarError naming the feature.

`json_string_regex` prints the same tree for the *contents of a JSON string*: characters that
JSON must escape come out as their escape sequence, and minLength/maxLength are folded in.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from plait.grammar.base import GrammarError

try:  # Python >= 3.11
    import re._constants as _c
    import re._parser as _sre
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _sre  # type: ignore[no-redef]

# A set of code points: sorted, disjoint, inclusive (lo, hi) ranges.
CharSet = tuple[tuple[int, int], ...]

MAX_CHAR = 0x10FFFF
# Surrogates cannot be encoded in UTF-8: no output may contain them.
VALID: CharSet = ((0, 0xD7FF), (0xE000, MAX_CHAR))
# Characters a JSON string must escape.
JSON_UNSAFE: CharSet = ((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}

_REFUSED_FLAGS = {
    _c.SRE_FLAG_IGNORECASE: "the ignore-case flag",
    _c.SRE_FLAG_LOCALE: "the locale flag",
    _c.SRE_FLAG_MULTILINE: "the multiline flag",
    _c.SRE_FLAG_ASCII: "the ASCII flag",
}
_START_ANCHORS = (_c.AT_BEGINNING, _c.AT_BEGINNING_STRING)
_END_ANCHORS = (_c.AT_END, _c.AT_END_STRING)
_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")  # ECMA `(?<name>` -> Python `(?P<name>`


# ----------------------------------------------------------------------------- char sets
def _normalize(ranges: list[tuple[int, int]]) -> CharSet:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def union(*sets: CharSet) -> CharSet:
    return _normalize([r for s in sets for r in s])


def complement(s: CharSet) -> CharSet:
    """Complement within VALID (never includes surrogates)."""
    out, start = [], 0
    for lo, hi in s:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CHAR:
        out.append((start, MAX_CHAR))
    return intersect(tuple(out), VALID)


def intersect(a: CharSet, b: CharSet) -> CharSet:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(a: CharSet, b: CharSet) -> CharSet:
    return intersect(a, complement(b))


def chars(*cs: str) -> CharSet:
    return _normalize([(ord(c), ord(c)) for c in cs])


@functools.cache
def _python_category(code: int) -> CharSet:
    """Python's exact Unicode meaning of \\d, \\w or \\s, found with `re` itself (fast, in C)."""
    probe = {_c.CATEGORY_DIGIT: r"\d+", _c.CATEGORY_WORD: r"\w+", _c.CATEGORY_SPACE: r"\s+"}[code]
    text = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, MAX_CHAR + 1)))

    def cp(i: int) -> int:  # text index -> code point (the text skips the surrogates)
        return i if i < 0xD800 else i + 0x800

    return _normalize([(cp(m.start()), cp(m.end() - 1)) for m in re.finditer(probe, text)])


# ASCII meanings (ECMA-262's, and a subset of Python's Unicode ones)
_ASCII_CATEGORY = {
    _c.CATEGORY_DIGIT: ((0x30, 0x39),),
    _c.CATEGORY_WORD: ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    _c.CATEGORY_SPACE: ((0x09, 0x0D), (0x20, 0x20)),
}
_NEGATED_CATEGORY = {
    _c.CATEGORY_NOT_DIGIT: _c.CATEGORY_DIGIT,
    _c.CATEGORY_NOT_WORD: _c.CATEGORY_WORD,
    _c.CATEGORY_NOT_SPACE: _c.CATEGORY_SPACE,
}


def _category(code: int, upper: bool) -> CharSet:
    """A class escape as a set. \\d, \\w, \\s mean different things in Python (Unicode) and
    ECMA-262 (ASCII); we print a set that is right under both: the smaller reading where the
    set is used as is, the larger one where it is negated (upper=True)."""
    if code in _NEGATED_CATEGORY:
        positive = _NEGATED_CATEGORY[code]
        return complement(_category(positive, upper=not upper))
    if code not in _ASCII_CATEGORY:
        raise GrammarError(f"unsupported character class {code}")
    return _python_category(code) if upper else _ASCII_CATEGORY[code]


# ----------------------------------------------------------------------------- the tree
@dataclass(frozen=True)
class Char:
    chars: CharSet


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    item: Node
    lo: int
    hi: int | None  # None = unbounded


Node = Char | Seq | Alt | Repeat
EMPTY = Seq(())


def literal(text: str) -> Node:
    return Seq(tuple(Char(chars(c)) for c in text))


def length_range(node: Node) -> tuple[int, int | None]:
    """(min, max) number of characters the node matches; max None = unbounded."""
    if isinstance(node, Char):
        return 1, 1
    if isinstance(node, Seq):
        lo, hi = 0, 0
        for item in node.items:
            a, b = length_range(item)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if isinstance(node, Alt):
        ranges = [length_range(o) for o in node.options]
        his = [b for _, b in ranges]
        return min(a for a, _ in ranges), None if None in his else max(his)  # type: ignore[type-var]
    a, b = length_range(node.item)
    hi = None if node.hi is None or b is None else node.hi * b
    return node.lo * a, hi


# ----------------------------------------------------------------------------- parsing
def parse(pattern: str, param: str) -> Node:
    """Python-regex text -> tree, refusing what a regular-language backend cannot enforce."""
    try:
        parsed = _sre.parse(_NAMED_GROUP.sub("(?P<", pattern))
    except re.error as e:
        raise GrammarError(f"{param}: invalid regular expression {pattern!r}: {e}", param) from None
    except (RecursionError, OverflowError):
        raise GrammarError(f"{param}: regular expression too complex", param) from None
    _check_flags(parsed.state.flags, param)
    dotall = bool(parsed.state.flags & _c.SRE_FLAG_DOTALL)
    return _Converter(param, dotall).seq(parsed, left=True, right=True)


def _check_flags(flags: int, param: str) -> None:
    for flag, name in _REFUSED_FLAGS.items():
        if flags & flag:
            raise GrammarError(f"{param}: {name} is not supported in regular expressions", param)


class _Converter:
    def __init__(self, param: str, dotall: bool) -> None:
        self.param = param
        self.dotall = dotall

    def refuse(self, feature: str) -> GrammarError:
        return GrammarError(
            f"{self.param}: {feature} is not supported (a grammar cannot enforce it)", self.param
        )

    def seq(self, items, left: bool, right: bool) -> Node:
        """`left`/`right`: whether this sequence starts/ends the whole match (anchors allowed)."""
        items = list(items)
        if left:  # start anchors, then a negative look-ahead: `^(?!@@)[\w@]+$`
            k = next((i for i, (op, av) in enumerate(items)
                      if not (op is _c.AT and av in _START_ANCHORS)), len(items))
            if k < len(items) and items[k][0] is _c.ASSERT_NOT and items[k][1][0] == 1:
                rest = self.seq(items[k + 1:], True, right)
                return self.not_starting(self.seq(items[k][1][1], False, False), rest)
        out: list[Node] = []
        for i, (op, av) in enumerate(items):
            node = self.item(op, av, left and i == 0, right and i == len(items) - 1)
            if node is not EMPTY:
                out.append(node)
        return out[0] if len(out) == 1 else Seq(tuple(out))

    def item(self, op, av, left: bool, right: bool) -> Node:
        if op is _c.LITERAL:
            return Char(intersect(chars(chr(av)), VALID))
        if op is _c.NOT_LITERAL:
            return Char(complement(chars(chr(av))))
        if op is _c.ANY:
            return Char(VALID if self.dotall else complement(chars("\n")))
        if op is _c.IN:
            return Char(self.charset(av))
        if op is _c.BRANCH:
            return Alt(tuple(self.seq(branch, left, right) for branch in av[1]))
        if op is _c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            if (add_flags | del_flags) & ~(_c.SRE_FLAG_VERBOSE | _c.SRE_FLAG_UNICODE):
                raise self.refuse("an inline flag group")
            return self.seq(sub, left, right)
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT):  # lazy = greedy for a whole-string match
            lo, hi, sub = av
            return Repeat(self.seq(sub, False, False), lo, None if hi is _c.MAXREPEAT else hi)
        if op is _c.AT:
            return self.anchor(av, left, right)
        raise self.refuse(_FEATURE_NAMES.get(op, f"the regex operator {op}"))

    def not_starting(self, prefix: Node, rest: Node) -> Node:
        """The strings of `rest` that do not start with `prefix`, for a prefix of single
        characters (`@@`, `[0-9]`) and a rest that is one character set repeated: each
        string either is shorter than the prefix and follows it all along, or first leaves it
        at some position (the rest's characters, then anything of its set)."""
        items = prefix.items if isinstance(prefix, Seq) else (prefix,)
        if not (items and all(isinstance(item, Char) for item in items)
                and isinstance(rest, Repeat) and isinstance(rest.item, Char)):
            raise self.refuse("a negative look-ahead other than `^(?!<characters>)` before one "
                              "character class repeated")
        sets = [item.chars for item in items]  # type: ignore[union-attr]
        c, lo, hi = rest.item.chars, rest.lo, rest.hi
        follow = [intersect(x, c) for x in sets]
        options: list[Node] = []
        for j, x in enumerate(sets):  # the first position where the string leaves the prefix
            away = subtract(c, x)
            if not away or (hi is not None and hi < j + 1) or not all(follow[:j]):
                continue
            tail_hi = None if hi is None else hi - j - 1
            options.append(Seq((*[Char(f) for f in follow[:j]], Char(away),
                                Repeat(Char(c), max(0, lo - j - 1), tail_hi))))
        for n in range(lo, len(sets) if hi is None else min(hi + 1, len(sets))):
            if all(follow[:n]):  # shorter than the prefix, following it
                options.append(Seq(tuple(Char(f) for f in follow[:n])))
        if not options:
            raise self.refuse("a negative look-ahead that no string gets past")
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def anchor(self, code, left: bool, right: bool) -> Node:
        if (code in _START_ANCHORS and left) or (code in _END_ANCHORS and right):
            return EMPTY  # the whole string is matched anyway
        if code in (_c.AT_BOUNDARY, _c.AT_NON_BOUNDARY):
            raise self.refuse("a word boundary (\\b, \\B)")
        raise self.refuse("an anchor (^, $, \\A, \\Z) inside the pattern")

    def charset(self, items) -> CharSet:
        negate = bool(items) and items[0][0] is _c.NEGATE
        parts = []
        for op, av in items[1:] if negate else items:
            if op is _c.LITERAL:
                parts.append(chars(chr(av)))
            elif op is _c.RANGE:
                parts.append(((av[0], av[1]),))
            elif op is _c.CATEGORY:
                parts.append(_category(av, upper=negate))
            else:
                raise self.refuse(f"the character-class item {op}")
        s = union(*parts)
        return complement(s) if negate else intersect(s, VALID)


_FEATURE_NAMES = {
    _c.ASSERT: "a look-ahead/look-behind assertion",
    _c.ASSERT_NOT: "a negative look-ahead/look-behind assertion",
    _c.GROUPREF: "a back-reference",
    _c.GROUPREF_EXISTS: "a conditional group",
}
for _name, _feature in (("POSSESSIVE_REPEAT", "a possessive quantifier"),
                        ("ATOMIC_GROUP", "an atomic group")):
    if hasattr(_c, _name):
        _FEATURE_NAMES[getattr(_c, _name)] = _feature


# ----------------------------------------------------------------------------- printing
_META = frozenset("\\.^$|?*+()[]{}-/")  # never escape < > (Rust reads \< \> as word boundaries)
_CLASS_META = frozenset("\\]^-[&~")


def _char_text(code: int, in_class: bool) -> str:
    # \uXXXX, never \xXX: xgrammar reads every hex digit after \x (`[\x01a]` is U+001A)
    if code < 0x20 or 0x7F <= code <= 0x9F:
        return f"\\u{code:04x}"
    ch = chr(code)
    if ch in "&~" and in_class:  # escaped for Python's and Rust's set operations (&&, ~~);
        return f"\\u{code:04x}"  # as \& or \~ xgrammar warns of an unknown escape each time
    return "\\" + ch if ch in (_CLASS_META if in_class else _META) else ch


def _class_text(s: CharSet) -> str:
    if len(s) == 1 and s[0][0] == s[0][1]:
        return _char_text(s[0][0], in_class=False)
    parts = []
    for lo, hi in s:
        parts.append(_char_text(lo, True) if lo == hi else
                     f"{_char_text(lo, True)}-{_char_text(hi, True)}")
    # xgrammar re-prints a class's escapes as \xNN or unpadded \uNNN and then reads every hex
    # digit after them (`[\u0001a]` became U+001A): the parts that start with a hex digit go
    # first, so that no escape is ever followed by one (the set is the same in any order)
    parts.sort(key=lambda text: text[0] not in _HEX_DIGITS)
    return "[" + "".join(parts) + "]"


_HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def _json_escapes(s: CharSet) -> list[str]:
    """Regex texts for the JSON escape sequences of the unsafe characters in s."""
    out, by_high = [], {0: [], 1: []}
    for lo, hi in s:
        for code in range(lo, hi + 1):
            if code in _SHORT_ESCAPES:
                out.append("\\\\" + _char_text(ord(_SHORT_ESCAPES[code]), False))
            else:  # \u00XX, lowercase hex: one spelling is enough
                by_high[code >> 4].append(code & 0xF)
    for high, lows in by_high.items():
        if lows:
            digits = "".join(sorted({f"{x:x}" for x in lows}))
            cls = digits if len(digits) == 1 else f"[{digits}]"
            out.append(f"\\\\u00{high}{cls}")
    return out


def _char_regex(s: CharSet, json: bool) -> tuple[str, bool]:
    """(regex text, atomic?) for one character from s."""
    if not s:
        raise GrammarError("a character class that matches nothing")
    if not json:
        return _class_text(s), True
    safe, unsafe = subtract(s, JSON_UNSAFE), intersect(s, JSON_UNSAFE)
    options = ([_class_text(safe)] if safe else []) + _json_escapes(unsafe)
    if len(options) == 1:
        return options[0], not options[0].startswith("\\\\")
    return "(?:" + "|".join(options) + ")", True


# xgrammar (0.2.8) masks a counted repetition of a group without its token cache wherever a token
# can run from one repeat into the next (` the` after `\w+ ` in `(\w+ ){5,}`): 13 ms a mask fill
# (22 ms at worst) on a 100k vocabulary, against 0.1-0.2 ms for the same language spelled out
# (`\w+ \w+ \w+ \w+ \w+ (?:\w+ )*`); `(?:\w+ ){0,3}` 18 ms at worst against 0.4. So a counted
# repetition of anything but one character set is spelled out: lo copies, then `(?:X)*` or
# hi - lo nested optionals `(?:X(?:X)?)?` (one way to read each string, no ambiguity). Spelling
# costs compile time, in the compiler process and once (then cached) but against its 5 s
# timeout: on a 100k vocabulary `(\w+ ){3,64}` 0.5 s, 512 character sets (`(\w+ \w+ \w+ \w+
# ){0,63}`) 2.2 s. So at most SPELL_COPIES copies of a group and SPELL_LEAVES character sets in
# all; past those the first copies are spelled and the rest stay counted after them
# (`(\w+ ){3,200}`: 64 copies, the innermost optional holding `(?:\w+ ){0,136}`), so an output
# that stops within them never reaches the slow form. Character sets repeated (`[a-z]{2,40}`)
# are cached and stay counted.
SPELL_COPIES = 64
SPELL_LEAVES = 256


def _leaves(node: Node) -> int:
    if isinstance(node, Char):
        return 1
    if isinstance(node, Repeat):
        return _leaves(node.item)
    parts = node.items if isinstance(node, Seq) else node.options
    return sum(_leaves(p) for p in parts)


def spell_out_counts(node: Node) -> Node:
    """The same language with small counted repetitions of groups written out (see above)."""
    return _spell(node, [SPELL_LEAVES - _leaves(node)])


def _spell(node: Node, budget: list[int]) -> Node:
    if isinstance(node, Char):
        return node
    if isinstance(node, Seq):
        return Seq(tuple(_spell(i, budget) for i in node.items))
    if isinstance(node, Alt):
        return Alt(tuple(_spell(o, budget) for o in node.options))
    item = _spell(node.item, budget)
    lo, hi = node.lo, node.hi
    if isinstance(item, Char) or (lo, hi) in ((0, None), (1, None), (0, 1)) or hi == 0:
        return Repeat(item, lo, hi)
    if (lo, hi) == (1, 1):
        return item
    # copies written out: all of them (lo, and hi - lo optional or one starred) where the
    # budget allows, else as many as it allows, the rest left counted after them
    size = _leaves(item)
    copies = min(lo + (1 if hi is None else hi - lo), SPELL_COPIES, 1 + budget[0] // size)
    if copies < 2:
        return Repeat(item, lo, hi)
    budget[0] -= (copies - 1) * size
    if copies <= lo:  # the first copies of the required ones, then the rest counted
        rest_hi = None if hi is None else hi - copies
        return Seq((item,) * copies + ((Repeat(item, lo - copies, rest_hi),) if rest_hi != 0
                                       else ()))
    if hi is None:
        return Seq((item,) * lo + (Repeat(item, 0, None),))
    # lo copies, then copies - lo nested optionals, the innermost holding the rest counted
    rest = hi - copies
    tail: Node | None = None
    for depth in range(copies - lo):
        inner = item if depth > 0 or rest == 0 else Seq((item, Repeat(item, 0, rest)))
        tail = Repeat(inner if tail is None else Seq((item, tail)), 0, 1)
    return Seq((item,) * lo + (() if tail is None else (tail,)))


def to_regex(node: Node, json: bool = False) -> str:
    text, _ = _print(node, json)
    return text


def _print(node: Node, json: bool) -> tuple[str, bool]:
    if isinstance(node, Char):
        return _char_regex(node.chars, json)
    if isinstance(node, Seq):
        if len(node.items) == 1:
            return _print(node.items[0], json)
        return "".join(_group(_print(i, json), alt_only=True) for i in node.items), False
    if isinstance(node, Alt):
        return "|".join(_print(o, json)[0] for o in node.options), False
    text = _group(_print(node.item, json), alt_only=False)
    hi = "" if node.hi is None else str(node.hi)
    # not atomic: a repeat of a repeat needs a group ("a*{2}" is an error)
    if (node.lo, node.hi) == (0, None):
        return text + "*", False
    if (node.lo, node.hi) == (1, None):
        return text + "+", False
    if (node.lo, node.hi) == (0, 1):
        return text + "?", False
    if node.hi is not None and node.lo == node.hi:
        return f"{text}{{{node.lo}}}", False
    return f"{text}{{{node.lo},{hi}}}", False


def _group(printed: tuple[str, bool], alt_only: bool) -> str:
    text, atomic = printed
    if atomic or (alt_only and "|" not in _top_level(text)):
        return text
    return f"(?:{text})"


def _top_level(text: str) -> str:
    """The characters of a printed regex outside groups and classes (to spot a top-level |)."""
    out, depth, in_class, i = [], 0, False, 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif depth == 0:
            out.append(ch)
        i += 1
    return "".join(out)


# ----------------------------------------------------------------------------- entry points
def normalize_regex(pattern: str, param: str = "regex") -> str:
    """A whole-string regex (Python meaning) in the portable dialect."""
    return to_regex(spell_out_counts(parse(pattern, param)))


def literal_of(pattern: str) -> str | None:
    """The one string a pattern anchored at both ends matches (`^kafka_topic$`; Python's `$`
    also lets that string end in a newline), or None for any other pattern."""
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    try:
        node = parse(pattern, "pattern")
    except GrammarError:
        return None
    items = node.items if isinstance(node, Seq) else (node,)
    text = []
    for item in items:
        if not (isinstance(item, Char) and len(item.chars) == 1
                and item.chars[0][0] == item.chars[0][1]):
            return None
        text.append(chr(item.chars[0][0]))
    return "".join(text)


def choices_regex(options: list[str]) -> str:
    """Exactly one of the given strings."""
    return to_regex(Alt(tuple(literal(o) for o in options)))


ANY_CHAR = Char(VALID)


def json_string_regex(
    pattern: str | None, min_len: int = 0, max_len: int | None = None, where: str = "$"
) -> str:
    """Regex for the *raw contents* of a JSON string whose decoded value matches `pattern`
    (as a whole: an unanchored pattern is treated as anchored, a subset of what it allows) and
    has between min_len and max_len characters. Escapes count as one character."""
    node = parse(pattern, "json_schema") if pattern is not None else Repeat(ANY_CHAR, 0, None)
    node = fold_length(node, min_len, max_len, where)
    return _json_text(node)


def _json_text(node: Node) -> str:
    text = to_regex(spell_out_counts(node), json=True)
    # outlines splices the pattern between quotes as is: a top-level | must not escape them
    return f"(?:{text})" if "|" in _top_level(text) else text


def _repeated_set(node: Node) -> Repeat | None:
    """node if it is one character set repeated without bound (X* or X+), else None."""
    if (isinstance(node, Repeat) and isinstance(node.item, Char) and node.hi is None
            and node.lo <= 1):
        return node
    return None


def json_string_regex_not(pattern: str, min_len: int, max_len: int | None,
                          where: str) -> str | None:
    """Regex for the contents of a JSON string (min_len..max_len characters) whose value does
    *not* match `pattern` (`not: {pattern: ...}`): for a pattern anchored at both ends that is
    one character set X repeated (^X+$, ^X*$), the values with a character outside X (and,
    for ^X+$, the empty string). None for other patterns: an unanchored one searches, and the
    complement of plait's anchored subset of it would be a superset."""
    if not (pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$")):
        return None
    node = _repeated_set(parse(pattern, "json_schema"))
    if node is None:
        return None
    # Python's $ (jsonschema's) also matches before a final newline: a newline is not the
    # outside character (`X+` then a newline still matches)
    outside = subtract(subtract(VALID, node.item.chars), chars("\n"))
    if not outside:
        return None
    anything = Repeat(ANY_CHAR, 0, None)
    tree: Node = Seq((anything, Char(outside), anything))
    if node.lo == 1:
        tree = Alt((EMPTY, tree))
    return _json_text(fold_length(tree, min_len, max_len, where))


def json_key_regex(pattern: str, exclude: list[str]) -> str | None:
    """json_string_regex(pattern) less the strings in `exclude` (an object's declared property
    names, which a patternProperties key must not repeat), or None when the pattern is not one
    character set repeated (X* or X+, as property-name patterns usually are)."""
    node = _repeated_set(parse(pattern, "json_schema"))
    if node is None:
        return None
    return _json_text(strings_but(node.item.chars, exclude, nonempty=node.lo == 1))


def strings_but(x: CharSet, words: list[str], nonempty: bool = False) -> Node:
    """The strings of characters from x (at least one if nonempty) except `words`, spelled
    from their trie: a way off the trie (a prefix of a word, then a character of x that leads
    off every word; or a whole word, then one more character), then anything of x; or a prefix
    of a word that is itself no word. The tail is written once: with one per way off the trie,
    outlines-core took 186 s to build its index for two short words (0.04 s this way)."""
    trie: dict = {}
    for word in words:
        if all(intersect(x, chars(c)) for c in word):  # x cannot spell the others
            level = trie
            for ch in word:
                level = level.setdefault(ch, {})
            level[None] = {}  # the word ends here

    def one_of(options: list[Node]) -> Node:
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def leave(level: dict) -> Node:
        kids = sorted(c for c in level if c is not None)
        other = subtract(x, chars(*kids)) if kids else x
        return one_of(([Char(other)] if other else [])
                      + [Seq((Char(chars(c)), leave(level[c]))) for c in kids])

    def inside(level: dict, start: bool) -> Node | None:
        options: list[Node] = [] if None in level or (start and nonempty) else [EMPTY]
        for c in sorted(k for k in level if k is not None):
            after = inside(level[c], False)
            if after is not None:
                options.append(Seq((Char(chars(c)), after)))
        return one_of(options) if options else None

    off = Seq((leave(trie), Repeat(Char(x), 0, None)))
    short = inside(trie, True)
    return off if short is None else Alt((off, short))


# a repetition of a variable-length part under a length budget (`(?:/[a-z]*)*` in a uri of at
# most 2048 characters) repeats at most this many times, each repeat taking its share
MAX_SHARED_REPEATS = 8


def fold_length(node: Node, min_len: int, max_len: int | None, where: str) -> Node:
    """Restrict node to strings of min_len..max_len characters, or refuse. Exact (every string
    of an allowed length the node matches) where one part varies in length; where several do
    (`^\\d+\\.\\d+$`, an email), each gets a share of the lengths (`_shares`): a subset of
    those strings, every one of them of an allowed length and matching the node."""
    lo, hi = length_range(node)
    if lo >= min_len and (max_len is None or (hi is not None and hi <= max_len)):
        return node
    if max_len is not None and (lo > max_len or min_len > max_len):
        raise _unsatisfiable(where)
    if hi is not None and hi < min_len:
        raise _unsatisfiable(where)
    if isinstance(node, Alt):
        options = []
        for option in node.options:
            try:
                options.append(fold_length(option, min_len, max_len, where))
            except _Unsatisfiable:
                continue
        if not options:
            raise _unsatisfiable(where)
        return Alt(tuple(options))
    if isinstance(node, Repeat) and isinstance(node.item, Char):
        new_lo = max(node.lo, min_len)
        bounds = [b for b in (node.hi, max_len) if b is not None]
        new_hi = min(bounds) if bounds else None
        if new_hi is not None and new_lo > new_hi:
            raise _unsatisfiable(where)
        return Repeat(node.item, new_lo, new_hi)
    if isinstance(node, Seq):
        return _fold_seq(node, min_len, max_len, where)
    assert isinstance(node, Repeat)
    return _fold_repeat(node, min_len, max_len, where)


def _fold_seq(node: Seq, min_len: int, max_len: int | None, where: str) -> Node:
    ranges = [length_range(i) for i in node.items]
    variable = [i for i, (a, b) in enumerate(ranges) if a != b]
    if len(variable) == 1:  # exact: the one variable part takes what the fixed ones leave
        k = variable[0]
        fixed = sum(a for i, (a, _) in enumerate(ranges) if i != k)
        inner_max = None if max_len is None else max_len - fixed
        folded = fold_length(node.items[k], max(0, min_len - fixed), inner_max, where)
        return Seq(node.items[:k] + (folded,) + node.items[k + 1 :])
    lows = _shares([a for a, _ in ranges], [b for _, b in ranges], min_len, grow_present=True)
    highs: list[int | None] = [b for _, b in ranges]
    if max_len is not None:
        highs = _shares(lows, highs, max_len)
    return Seq(tuple(_fold_part(item, low, high, where)
                     for item, low, high in zip(node.items, lows, highs)))


def _fold_repeat(node: Repeat, min_len: int, max_len: int | None, where: str) -> Node:
    """A repetition of a part longer than one character, in lengths min_len..max_len: a count
    range and a length range for each repeat whose products fall inside (a subset)."""
    a, b = length_range(node.item)
    count_hi, item_hi = node.hi, b
    if max_len is not None:
        most = MAX_SHARED_REPEATS if node.hi is None else min(node.hi, MAX_SHARED_REPEATS)
        if b is not None and b > 0 and (a == b or max_len // b >= max(node.lo, 1, most)):
            # repeats of one length, or whole repeats of any length as many as the shares
            # would give: only the count is limited (exact for repeats of one length)
            count_hi = max_len // b if node.hi is None else min(node.hi, max_len // b)
        else:
            count_hi = _repeat_count(node, a, b, max_len)
            if count_hi == 0:
                if min_len:
                    raise _unsatisfiable(where)
                return EMPTY
            item_hi = max_len // count_hi
    count_lo, item_lo = node.lo, a
    if min_len > count_lo * item_lo:
        if item_lo > 0:  # more repeats first, then longer ones
            want = -(-min_len // item_lo)
            count_lo = max(count_lo, want if count_hi is None else min(count_hi, want))
        count_lo = max(count_lo, 1)
        if count_hi is not None and count_lo > count_hi:
            raise _unsatisfiable(where)
        item_lo = max(item_lo, -(-min_len // count_lo))
        if item_hi is not None and item_lo > item_hi:
            raise _unsatisfiable(where)
    return Repeat(_fold_part(node.item, item_lo, item_hi, where), count_lo, count_hi)


def _repeat_count(node: Repeat, a: int, b: int | None, max_len: int) -> int:
    """How many repeats, each up to max_len // count characters long: among the counts that
    reach within 5% of the longest total, the one nearest about as many repeats as each
    one's share is long (sqrt of the budget, at most MAX_SHARED_REPEATS)."""
    least = max(node.lo, 1)
    most = max_len // max(a, 1)
    if node.hi is not None:
        most = min(most, node.hi)
    if most < least:
        return node.lo if node.lo * a <= max_len else 0
    reach = {c: c * (max_len // c if b is None else min(b, max_len // c))
             for c in range(least, most + 1)}
    best = max(reach.values())
    guess = max(1, min(MAX_SHARED_REPEATS, math.isqrt(max_len // max(a, 1))))
    return min((c for c, r in reach.items() if r * 20 >= best * 19),
               key=lambda c: (abs(c - guess), c))


def _fold_part(node: Node, low: int, high: int | None, where: str) -> Node:
    try:
        return fold_length(node, low, high, where)
    except _Unsatisfiable:  # its share has no string (`(ab)+` in 3 characters): the split's
        raise GrammarError(
            f"json_schema: minLength/maxLength at {where} cannot be combined with this pattern or "
            "format (no split of the lengths among its variable parts was found)",
            "json_schema",
        ) from None


def _shares(lows: list[int], highs: list[int | None], total: int, grow_present: bool = False
            ) -> list[int]:
    """Per-part lengths between lows and highs (None: no limit) that add up to `total` where
    they can (else to as close to it as the highs allow), the extra spread evenly over the
    parts with room: the maxLength budget among the parts, or (grow_present) more minimum for
    minLength, given first to parts that must appear anyway, so that an optional part (a
    uri's port) is not made to appear while a present one can grow."""
    out = list(lows)
    left = total - sum(out)
    passes = ([i for i, low in enumerate(lows) if low > 0], range(len(lows))) if grow_present \
        else (range(len(lows)),)
    for parts in passes:
        while left > 0:
            room = [i for i in parts if highs[i] is None or out[i] < highs[i]]  # type: ignore[operator]
            if not room:
                break
            each = max(1, left // len(room))
            for i in room:
                high = highs[i]
                give = min(each, left, each if high is None else high - out[i])
                out[i] += give
                left -= give
                if not left:
                    break
    return out


class _Unsatisfiable(GrammarError):
    pass


def _unsatisfiable(where: str) -> GrammarError:
    return _Unsatisfiable(
        f"json_schema: the string constraints at {where} cannot be satisfied (no string of an "
        "allowed length matches)",
        "json_schema",
    )
