"""The guarantee, on both backends: every output a matcher lets through to EOS parses and
validates (JSON schemas, with jsonschema and its format checker) or fully matches (regexes).

Outputs come from seeded random walks over the allowed tokens (see walker.py) of the
tiny-llama tokenizer, with the model's padded vocabulary (8256 > 8195 tokens).
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from plait.grammar.base import GrammarError
from tests.grammar.conftest import BACKENDS
from tests.grammar.strategies import json_schemas, regexes

SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
WALKS = 4
# what outlines-core does not enforce (plait refuses it by name on that backend)
OUTLINES_REFUSED = (
    r"keyword '(minimum|maximum|exclusiveMinimum|exclusiveMaximum|multipleOf|minProperties|"
    r"maxProperties)'|object key .* needs JSON escaping"
)


def check_schema_outputs(backend, walker, schema: dict, seed: int) -> int:
    """Compile and walk; returns how many walks finished. Every finished one must validate."""
    name = backend.name
    try:
        grammar = backend.compile("json_schema", json.dumps(schema))
    except GrammarError as e:
        assert name == "outlines" and re.search(OUTLINES_REFUSED, str(e)), (name, str(e), schema)
        return -1
    validator = Draft202012Validator(schema, format_checker=Draft202012Validator.FORMAT_CHECKER)
    finished = 0
    for k in range(WALKS):
        walk = walker.walk(grammar.matcher(), seed=seed + k, max_steps=150)
        assert not walk.stuck, (name, schema, walker.text(walk.tokens))
        if walk.terminated:
            finished += 1
            value = json.loads(walk.text)
            errors = [e.message for e in validator.iter_errors(value)]
            assert not errors, (name, schema, walk.text, errors)
    return finished


@pytest.mark.parametrize("backend_name", BACKENDS)
@SETTINGS
@given(schema=json_schemas(), seed=st.integers(0, 1000))
def test_random_schemas_outputs_validate(backends, walker, backend_name, schema, seed):
    check_schema_outputs(backends[backend_name], walker, schema, seed)


@pytest.mark.parametrize("backend_name", BACKENDS)
@SETTINGS
@given(regex=regexes(), seed=st.integers(0, 1000))
def test_random_regex_outputs_fully_match(backends, walker, backend_name, regex, seed):
    grammar = backends[backend_name].compile("regex", regex)
    for k in range(WALKS):
        walk = walker.walk(grammar.matcher(), seed=seed + k, max_steps=60)
        assert not walk.stuck, (regex, walker.text(walk.tokens))
        if walk.terminated:
            assert re.fullmatch(regex, walk.text), (backend_name, regex, walk.text)


FIXED_SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
     "required": ["name"]},
    {"type": "array", "items": {"enum": ["a\"b", 1, None, True]}, "maxItems": 3},
    {"type": "string", "format": "date"},
    {"anyOf": [{"type": "boolean"}, {"type": "string", "pattern": "^x[0-9]{2}$"}]},
    {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}},
     "$ref": "#/$defs/n"},
]


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("schema", FIXED_SCHEMAS, ids=range(len(FIXED_SCHEMAS)))
def test_walks_finish(backends, walker, backend_name, schema):
    """The walker really finishes outputs: the property tests above are not vacuous."""
    assert check_schema_outputs(backends[backend_name], walker, schema, seed=0) >= 2


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_json_object_outputs_are_objects(backends, walker, backend_name):
    grammar = backends[backend_name].compile("json_object", "")
    finished = 0
    for seed in range(8):
        walk = walker.walk(grammar.matcher(), seed=seed, max_steps=120)
        if walk.terminated:
            finished += 1
            assert isinstance(json.loads(walk.text), dict), walk.text
    assert finished >= 3


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_choices_outputs_are_one_choice(backends, walker, backend_name):
    options = ["yes", "no", "a.b", 'say "x"', "日本"]
    grammar = backends[backend_name].compile("choices", json.dumps(options))
    seen = set()
    for seed in range(12):
        walk = walker.walk(grammar.matcher(), seed=seed)
        assert walk.terminated and walk.text in options
        seen.add(walk.text)
    assert len(seen) >= 3


def test_ebnf_outputs_are_in_the_language(backends, walker):
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+ | "\\"" [0-9]* "\\""'
    grammar = backends["xgrammar"].compile("ebnf", ebnf)
    finished = 0
    for seed in range(8):
        walk = walker.walk(grammar.matcher(), seed=seed, max_steps=80)
        if walk.terminated:
            finished += 1
            item = r'(?:[a-c]+|"[0-9]*")'
            assert re.fullmatch(rf"\({item}(?:,{item})*\)", walk.text), walk.text
    assert finished >= 2
