"""if/then/else and the `not` forms plait rewrites (plait/grammar/json_schema.py), checked
exactly: for random schemas of those forms, every candidate text in plait's layout is accepted
by the compiled grammar if and only if jsonschema says it is valid."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from plait.grammar.base import GrammarError

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))
KINDS = ["a", "multi", "b"]
PROPERTIES = {"k": {"enum": KINDS}, "x": {"type": "integer"}, "y": {"type": "string"}}
_CONDITIONS = [
    {"properties": {"k": {"const": "multi"}}},
    {"properties": {"k": {"enum": ["a", "b"]}}},
    {"properties": {"k": {"const": "a"}}, "required": ["x"]},
    {"properties": {"x": {"minimum": 5}}},
    {"properties": {"x": {"maximum": 0}, "k": {"const": "b"}}},
    {"required": ["y"], "properties": {}},
]
_OUTCOMES = [
    True, {"required": ["x"]}, {"required": ["y"]}, {"properties": {"y": False}},
    {"properties": {"x": {"maximum": 5}}}, {"properties": {"k": {"const": "a"}}},
]
_CONDITIONALS = st.builds(
    lambda c, t, e, which: {"if": c, **({"then": t} if which != "else" else {}),
                            **({"else": e} if which != "then" else {})},
    st.sampled_from(_CONDITIONS), st.sampled_from(_OUTCOMES), st.sampled_from(_OUTCOMES),
    st.sampled_from(["then", "else", "both"]))


def _objects() -> list[str]:
    """Every object over k, x, y (x, y optional) in plait's layout (declared order)."""
    out = []
    for k, x, y in itertools.product(KINDS, [None, -3, 0, 7], [None, "s"]):
        value = {"k": k, **({"x": x} if x is not None else {}), **({"y": y} if y else {})}
        out.append(json.dumps(value, separators=(", ", ": ")))
    return out


def _accepts(grammar, tokenizer, text: str) -> bool:
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(i) for i in ids) and matcher.can_terminate()


def _check_exact(backend, tokenizer, schema: dict, texts: list[str]) -> None:
    try:
        grammar = backend.compile("json_schema", json.dumps(schema))
    except GrammarError as e:  # only a combination with no valid value may be refused
        assert "cannot be satisfied" in str(e) or "no anyOf branch" in str(e), (schema, e)
        assert not any(Draft202012Validator(schema).is_valid(json.loads(t)) for t in texts)
        return
    validator = Draft202012Validator(schema)
    for text in texts:
        assert _accepts(grammar, tokenizer, text) == validator.is_valid(
            json.loads(text)), json.dumps(schema) + " " + text


@settings(SETTINGS, max_examples=60)
@given(conditionals=st.lists(_CONDITIONALS, min_size=1, max_size=2))
def test_if_then_else_accepts_exactly_the_valid_objects(backends, tokenizer, conditionals):
    schema = {"type": "object", "properties": PROPERTIES, "required": ["k"],
              "allOf": conditionals}
    _check_exact(backends["xgrammar"], tokenizer, schema, _objects())


_SCALARS = ["", "a", "ab", "b", "multi", 0, 3, -2, 2.5, True, False, None]


@pytest.mark.parametrize("backend_name", ["xgrammar", "outlines"])
@SETTINGS
@given(types=st.lists(st.sampled_from(["string", "boolean", "null", "integer"]), min_size=1,
                      max_size=4, unique=True),
       excluded=st.lists(st.sampled_from(_SCALARS), min_size=1, max_size=3))
def test_not_of_values_accepts_exactly_the_others(backends, tokenizer, backend_name, types,
                                                 excluded):
    schema = {"type": types, "not": {"enum": excluded}}
    if backend_name == "outlines" and "integer" in types and any(
            type(v) in (int, float) for v in excluded):
        return  # the integers around an excluded one are bounds, which outlines refuses
    texts = [json.dumps(v) for v in _SCALARS if type(v) is not float]
    _check_exact(backends[backend_name], tokenizer, schema, texts)


@pytest.mark.parametrize("words", [["multi", "mu", "x"], [""], [], ["a", "ab", "b"],
                                   ["nano", "vim"], ["a\nb", "é"]])
def test_the_pattern_of_all_strings_but_some_matches_exactly_the_others(words):
    import re

    from plait.grammar.json_schema import _pattern_but

    pattern = _pattern_but(words)
    alphabet = "abmuxé\n"
    texts = ["".join(t) for n in range(4) for t in itertools.product(alphabet, repeat=n)]
    for text in texts + words + ["multis", "nanox", "vimm", "a\nbc"]:
        assert bool(re.search(pattern, text)) == (text not in words), (words, text)
