"""Hypothesis strategies: random regexes and random JSON schemas for the guarantee tests.

Schemas stay inside what xgrammar enforces after plait's rewriting (so every xgrammar compile
must succeed); outlines refuses the numeric and property-count keywords, by name.
"""

from __future__ import annotations

import re

from hypothesis import strategies as st

from plait.grammar.formats import FORMAT_PATTERNS
from plait.grammar.regex_syntax import length_range, parse

# ----------------------------------------------------------------------------- regexes
_LITERALS = ["a", "b", "z", "0", "7", " ", "-", ".", '"', "\\", "é", "\u00ff", "日", "/", ":"]
_CLASSES = [
    "[a-c]", "[^a-z]", "[0-9]", r"\d", r"\w", r"\s", ".", '[^"]', r"\D", "[xy_]", r"[\d.]",
    "[^\\s]",
]
_QUANTIFIERS = ["", "", "", "?", "*", "+", "{1,3}", "{2}", "{0,2}"]


def _atoms() -> st.SearchStrategy[str]:
    return st.sampled_from([re.escape(c) for c in _LITERALS] + _CLASSES)


def _piece(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    group = inner.map(lambda r: f"(?:{r})")
    return st.tuples(_atoms() | group, st.sampled_from(_QUANTIFIERS)).map("".join)


def regexes() -> st.SearchStrategy[str]:
    """Python regexes built from literals (specials included), classes, groups, alternation and
    quantifiers, sometimes anchored at the ends."""
    body = st.recursive(
        st.lists(_piece(_atoms()), min_size=1, max_size=3).map("".join),
        lambda inner: st.lists(
            st.lists(_piece(inner), min_size=1, max_size=3).map("".join), min_size=1, max_size=3
        ).map("|".join),
        max_leaves=6,
    )
    anchored = st.tuples(st.sampled_from(["", "^"]), body, st.sampled_from(["", "$"]))
    return anchored.map(lambda t: f"{t[0]}(?:{t[1]}){t[2]}" if t[0] or t[2] else t[1])


# ----------------------------------------------------------------------------- schemas
_NAMES = ["a", "name", "b c", 'q"uote', "x-1", "é", "id", "tags", "back\\slash"]
_TEXTS = ["", "x", 'say "hi"', "a\\b", "line\nbreak", "tab\t", "日本", "\u0001", "😀"]
# (pattern, whether minLength/maxLength may be added: it has a variable-length part; with
# several, plait shares the lengths among them)
_PATTERNS = [
    (r"^[a-z]+$", True), (r"^\d{3}-\d{2}$", False), (r"^[A-Z][a-z]*$", True),
    (r'^"[^"]*"$', True), (r"^(?:yes|no)$", False), (r"^.{2,}$", True), (r"^\w+@\w+\.com$", True),
    (r"^[^\\]*\\[nt]$", True), (r"^x(?:\.[0-9]{1,3})?$", True), (r"^\d+\.\d+(?:-\w+)*$", True),
]
_FORMATS = ["date", "time", "date-time", "uuid", "ipv4", "ipv6", "email", "hostname", "uri"]
_SCALARS = (
    st.sampled_from(_TEXTS)
    | st.integers(-1000, 1000)
    | st.sampled_from([0.5, -2.25, 1e3, 3.0])
    | st.booleans()
    | st.none()
)


@st.composite
def _string(draw) -> dict:
    kind = draw(st.sampled_from(["plain", "pattern", "format"]))
    schema: dict = {"type": "string"}
    lengths_ok = True
    regex = None
    if kind == "pattern":
        schema["pattern"], lengths_ok = draw(st.sampled_from(_PATTERNS))
        regex = schema["pattern"]
    elif kind == "format":
        schema["format"] = draw(st.sampled_from(_FORMATS))
        regex = FORMAT_PATTERNS[schema["format"]]
        lengths_ok = len(set(length_range(parse(regex, "format")))) > 1
    if lengths_ok and draw(st.booleans()):
        shortest = length_range(parse(regex, "pattern"))[0] if regex else 0
        low = draw(st.integers(0, 3)) + (draw(st.sampled_from([0, shortest])) if regex else 0)
        schema["minLength"] = low
        if draw(st.booleans()):
            least = max(low, 2, shortest + 1)
            schema["maxLength"] = draw(st.integers(least, least + 6))
    return schema


@st.composite
def _integer(draw) -> dict:
    schema: dict = {"type": "integer"}
    low = draw(st.none() | st.integers(-30, 30))
    if low is not None:
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low if low is not None else 0) + draw(st.integers(2, 60))
    if draw(st.integers(0, 3)) == 0:  # with bounds: both, and a small range
        schema["multipleOf"] = draw(st.integers(2, 5))
        if low is None:
            schema.pop("maximum", None)
        else:
            schema.setdefault("maximum", low + 50)
    return schema


@st.composite
def _number(draw) -> dict:
    schema: dict = {"type": "number"}
    low = draw(st.none() | st.sampled_from([-2.5, 0, 0.25, 10]))
    if low is not None:
        schema["exclusiveMinimum" if draw(st.booleans()) else "minimum"] = low
    if draw(st.booleans()):
        schema["maximum"] = (low or 0) + draw(st.sampled_from([0.5, 1, 7.75, 100]))
    return schema


def _leaves() -> st.SearchStrategy[dict]:
    return st.one_of(
        _string(),
        _integer(),
        _number(),
        st.sampled_from([{"type": "boolean"}, {"type": "null"}, {"type": ["string", "null"]}]),
        st.lists(_SCALARS, min_size=1, max_size=4, unique_by=repr).map(lambda v: {"enum": v}),
        _SCALARS.map(lambda v: {"const": v}),
        st.just({"$ref": "#/$defs/node"}),
        st.just({"$ref": "#/$defs/word"}),
    )


@st.composite
def _object(draw, children) -> dict:
    names = draw(st.lists(st.sampled_from(_NAMES), min_size=1, max_size=3, unique=True))
    props = {n: draw(children) for n in names}
    required = [n for n in names if draw(st.booleans())]
    schema: dict = {"type": "object", "properties": props, "required": required}
    extra = draw(st.sampled_from(["absent", "false", "schema"]))
    if extra == "false":
        schema["additionalProperties"] = False
    elif extra == "schema":
        schema["additionalProperties"] = draw(_leaves())
    low = 0
    if extra != "schema" and draw(st.integers(0, 3)) == 0:
        low = schema["minProperties"] = draw(st.integers(0, len(names)))
    if draw(st.integers(0, 3)) == 0:
        schema["maxProperties"] = draw(st.integers(max(low, len(required)), len(names) + 1))
    return schema


@st.composite
def _array(draw, children) -> dict:
    if draw(st.integers(0, 3)) == 0:
        prefix = draw(st.lists(children, min_size=1, max_size=2))
        return {"type": "array", "prefixItems": prefix, "items": draw(st.just(False) | children)}
    low = draw(st.integers(0, 2))
    schema: dict = {"type": "array", "items": draw(children), "minItems": low}
    if draw(st.booleans()):
        schema["maxItems"] = low + draw(st.integers(0, 3))
    return schema


def _extend(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return st.one_of(
        _object(children),
        _array(children),
        st.lists(children, min_size=2, max_size=3).map(lambda bs: {"anyOf": bs}),
    )


DEFS = {
    # a recursive linked list, and a plain definition
    "node": {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
        "required": ["v"],
    },
    "word": {"type": "string", "pattern": "^[a-z]{1,5}$"},
}


def json_schemas() -> st.SearchStrategy[dict]:
    """Random schemas: objects (required/optional fields, additionalProperties), arrays
    (items, prefixItems, bounds), enums, consts, anyOf, local and recursive $refs, strings with
    patterns/lengths/formats, numbers with bounds."""
    body = st.recursive(_leaves(), _extend, max_leaves=8)
    top = _object(body) | _array(body) | body  # mostly containers at the top
    return top.map(lambda schema: {**schema, "$defs": DEFS})
