"""Which JSON-schema keywords each backend enforces, established by experiment.

For every probe schema and backend: either plait refuses it with a GrammarError that names the
keyword (the expected refusals are listed below, per backend), or it compiles and every random
walk that finishes validates with jsonschema. The last tests run the *raw* engines on a few
refused or rewritten keywords and show the violations that made plait refuse or rewrite them.
"""

from __future__ import annotations

import json

import jsonschema
import outlines_core
import pytest
import xgrammar as xgr

from plait.grammar.base import GrammarError
from plait.grammar.outlines_backend import OutlinesCompiled
from plait.grammar.xgrammar_backend import XGrammarCompiled
from tests.grammar.conftest import BACKENDS


def s(**kw) -> dict:
    return {"type": "string", **kw}


OBJ3 = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
DRAFT7 = "http://json-schema.org/draft-07/schema#"  # `dependencies` (2019-09 on: dependent*)
PROBES: dict[str, dict] = {
    "minLength": s(minLength=5),
    "maxLength": s(maxLength=2),
    "pattern": s(pattern="^[a-c]+x$"),
    "pattern+maxLength": s(pattern="^a[0-9]*$", maxLength=4),
    "pattern quote": s(pattern='^a"b+$'),
    "format date": s(format="date"),
    "format date-time": s(format="date-time"),
    "format ipv4": s(format="ipv4"),
    "format uuid": s(format="uuid"),
    "format email": s(format="email"),
    "format email+maxLength": s(format="email", maxLength=30),
    "format date+pattern": s(format="date", pattern=r"^\d{4}-\d{2}-\d{2}$"),
    "format email+narrower pattern": s(format="email", pattern=r"^[a-z]+@example\.com$",
                                       maxLength=20),
    "format ipv4+wider pattern": s(format="ipv4", pattern=r"^\d{1,3}(?:\.\d{1,3}){3}$"),
    "format+crossing pattern": s(format="ipv4", pattern=r"^1"),
    "format uri+lengths": s(format="uri", minLength=20, maxLength=40),
    "pattern of two parts+maxLength": s(pattern=r"^\d+\.\d+$", maxLength=5),
    "format idn-email": s(format="idn-email"),
    "format idn-hostname": s(format="idn-hostname"),
    "format regex": s(format="regex"),
    "minimum": {"type": "integer", "minimum": 5},
    "int range": {"type": "integer", "minimum": -12, "maximum": 40},
    "patternProperties of names": {"type": "object", "patternProperties": {
        "^a$": {"type": "integer"}, "^b_c$": {"type": "string"}}, "required": ["a"]},
    "patternProperties of names, minProperties": {"type": "object", "patternProperties": {
        "^a$": {"type": "integer"}, "^b$": {"type": "string"}}, "additionalProperties": False,
        "minProperties": 1},
    "patternProperties of names beside additional": {
        "type": "object", "properties": {"a": {"minimum": 3}},
        "patternProperties": {"^a$": {"type": "integer"}, "^b$": {"type": "boolean"}},
        "additionalProperties": {"type": "string"}, "required": ["b"]},
    "int maximum past 64 bits": {"type": "integer", "minimum": 0,
                                 "maximum": 9223372036854776000},
    "int minimum past 64 bits": {"type": "integer", "minimum": 1e30},
    "exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    "draft4 exclusive": {"$schema": "http://json-schema.org/draft-04/schema#",
                         "type": "number", "minimum": 0, "exclusiveMinimum": True},
    "multipleOf": {"type": "integer", "multipleOf": 7},
    "multipleOf small range": {"type": "integer", "multipleOf": 3, "minimum": 1, "maximum": 30},
    "multipleOf one bound": {"type": "integer", "multipleOf": 2, "minimum": 0},
    "multipleOf fraction": {"type": "number", "multipleOf": 0.5},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                          "maxItems": 3},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True},
    "uniqueItems of strings": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "uniqueItems of booleans": {"type": "array", "items": {"type": "boolean"},
                                "uniqueItems": True, "minItems": 1},
    "enum siblings": {"enum": ["a", "bb", 3], "type": "string", "maxLength": 1},
    "const": {"const": {"k": ["v", None]}},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]},
    "oneOf overlapping": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "oneOf with an always-true branch": {"type": "string", "oneOf": [
        {"enum": ["nano", "vim"]}, {}]},
    "oneOf overlapping on a key": {"type": "object", "properties": {
        "k": {"enum": ["a", "b"]}, "n": {"type": "integer"}}, "required": ["k"], "oneOf": [
        {"properties": {"k": {"const": "a"}}}, {"required": ["n"]}]},
    "oneOf disjoint": {"oneOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf required": {"type": "object", "properties": {"x": {"type": "integer"},
                                                        "y": {"type": "integer"}},
                       "oneOf": [{"required": ["x"]}, {"required": ["y"]}]},
    "oneOf open branches": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "a"}}, "required": ["kind"],
         "additionalProperties": {"type": "integer"}},
        {"type": "object", "properties": {"kind": {"const": "b"}, "v": {"type": "integer"}},
         "required": ["kind", "v"], "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"],
         "additionalProperties": False}]},
    "oneOf beside a nested union": {"oneOf": [
        {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}}, "required": ["t"]},
                   {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"]}]},
        {"type": "object", "properties": {"t": {"enum": ["c", "d"]}}, "required": ["t"]}]},
    "allOf": {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]},
    "allOf objects": {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"properties": {"b": {"type": "string"}}, "required": ["b"]}]},
    "not": {"not": {"type": "string"}},
    "$ref": {"$defs": {"p": {"type": "string", "maxLength": 3}}, "type": "array",
             "items": {"$ref": "#/$defs/p"}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/n"}}, "required": ["v"]}},
        "$ref": "#/$defs/n"},
    "remote $ref": {"$ref": "http://example.com/schema.json"},
    "additionalProperties false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": False},
    "additionalProperties schema": {"type": "object",
                                    "additionalProperties": {"type": "integer", "maximum": 0}},
    "required undeclared": {"type": "object", "required": ["zz"]},
    "patternProperties": {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 1},
                      "additionalProperties": {"type": "integer"}},
    "minProperties": {"type": "object", "properties": OBJ3, "minProperties": 2},
    "maxProperties": {"type": "object", "properties": OBJ3, "maxProperties": 1},
    "minProperties open": {"type": "object", "additionalProperties": True, "minProperties": 2},
    "dependentRequired": {"type": "object", "properties": OBJ3, "dependentRequired": {"a": ["b"]}},
    "dependencies": {"$schema": DRAFT7, "type": "object", "properties": OBJ3,
                     "dependencies": {"a": ["b"]}},
    "dependencies schema": {
        "$schema": DRAFT7, "type": "object", "properties": OBJ3,
        "dependencies": {"a": {"properties": {"b": {"enum": [5, 6]}, "c": False},
                               "required": ["b"]}}},
    "dependentSchemas anyOf": {"type": "object", "properties": OBJ3, "dependentSchemas": {
        "b": {"anyOf": [{"required": ["a"]}, {"properties": {"c": {"const": -1}}}]}}},
    "dependencies chained": {
        "$schema": DRAFT7, "type": "object", "properties": OBJ3,
        "dependencies": {"a": ["b"], "b": ["c"], "c": {"properties": {"a": {"const": 2}}}}},
    "dependencies of a required key": {"type": "object", "properties": OBJ3, "required": ["a"],
                                       "dependentRequired": {"a": ["c"]}},
    "dependencies open object": {
        "$schema": DRAFT7, "type": "object", "properties": OBJ3, "dependencies": {"a": ["b"]},
        "additionalProperties": {"type": "integer"}},
    "dependencies of five keys": {"type": "object", "properties": {
        k: {"type": "integer"} for k in "abcdef"}, "dependentRequired": {
        k: ["f"] for k in "abcde"}},
    "anyOf with an unsatisfiable branch": {"anyOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"],
         "additionalProperties": False}, {"type": "integer"}]},
    "$ref to patternProperties with siblings": {
        "$defs": {"d": {"patternProperties": {"^x[0-9]$": {"type": "integer"}}}},
        "$ref": "#/$defs/d", "type": "object"},
    "not type": {"type": ["string", "integer", "null"], "not": {"type": ["string", "null"]}},
    "not required": {"type": "object", "properties": OBJ3, "not": {"required": ["a", "b"]}},
    "not anchored pattern": {"type": "string", "minLength": 1,
                             "not": {"pattern": "^[a-c ]+$"}},
    "not unanchored pattern": {"type": "string", "not": {"pattern": "[0-9]"}},
    "not of two keywords": {"not": {"type": "string", "maxLength": 3}},
    "not integer beside number": {"type": "number", "not": {"type": "integer"}},
    "not of true": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"not": {}}}},
    "patternProperties over a declared name": {
        "type": "object", "properties": {"ab": {"type": "integer", "maximum": 3}},
        "patternProperties": {"^[ab]+$": {"type": "integer", "minimum": 0}}},
    "patternProperties of every name": {
        "type": "object", "properties": {"by": {"type": "string", "maxLength": 2}},
        "required": ["by"], "patternProperties": {".*": {"type": "string"}}},
    "if/then/else": {"type": "integer", "if": {"minimum": 10}, "then": {"multipleOf": 2}},
    "if/then/else bounds": {"type": "integer", "if": {"minimum": 10}, "then": {"maximum": 20},
                            "else": {"minimum": 0}},
    "if/then discriminator": {
        "type": "object", "properties": {"type": {"enum": ["a", "multi", "b"]},
                                         "queries": {"type": "array",
                                                     "items": {"type": "integer"}}},
        "required": ["type"], "if": {"properties": {"type": {"const": "multi"}}},
        "then": {"required": ["queries"]}},
    "if/then/else in allOf": {
        "type": "object", "required": ["k"], "properties": {
            "k": {"enum": ["a", "b", "c"]}, "x": {"type": "integer"}, "y": {"type": "string"}},
        "allOf": [
            {"if": {"properties": {"k": {"const": "a"}}}, "then": {"required": ["x"]}},
            {"if": {"properties": {"k": {"const": "b"}}, "required": ["k"]},
             "then": {"required": ["y"]}, "else": {"properties": {"y": False}}}]},
    "if/then/else open string": {
        "type": "object", "properties": {"mode": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["mode"], "if": {"properties": {"mode": {"const": "count"}}},
        "then": {"required": ["n"]}, "else": {"properties": {"n": False}}},
    "not const string": {"type": "string", "not": {"const": "multi"}},
    "not enum of each type": {"type": ["string", "integer", "boolean", "null"],
                              "not": {"enum": ["a", 3, True, None]}},
    "not const object": {"type": "object", "not": {"const": {}}},
    "not of numbers": {"type": "number", "not": {"enum": [3, -2, 0.5, "x"]}},
    "not enum beside a pattern": {"type": "string", "pattern": "^[a-z]+$",
                                  "not": {"enum": ["ab"]}},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "items list (draft 7)": {"$schema": "http://json-schema.org/draft-07/schema#",
                             "type": "array", "items": [{"type": "string"}],
                             "additionalItems": {"type": "boolean"}},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}},
    "unevaluatedProperties false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                    "unevaluatedProperties": False},
    "type list": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "annotations": {"type": "string", "title": "t", "description": "d", "default": "x",
                    "examples": ["y"], "deprecated": True, "$comment": "c", "readOnly": True},
    "property name quote": {"type": "object", "properties": {'q"k': {"type": "integer"}},
                            "required": ['q"k']},
}
BOTH = set(BACKENDS)
OUTLINES = {"outlines"}
# probe -> backends that refuse it (a GrammarError naming the keyword or the combination)
REFUSED = {
    "format regex": BOTH,
    "minimum": OUTLINES,
    "exclusive": OUTLINES,
    "int maximum past 64 bits": OUTLINES,
    "patternProperties of names beside additional": OUTLINES,
    "patternProperties of names, minProperties": OUTLINES,
    "int minimum past 64 bits": BOTH,
    "format+crossing pattern": BOTH,
    "draft4 exclusive": OUTLINES,
    "multipleOf": OUTLINES,
    "multipleOf one bound": BOTH,
    "multipleOf fraction": BOTH,
    "uniqueItems of strings": BOTH,
    "oneOf overlapping": BOTH,
    "not unanchored pattern": BOTH,
    "not of two keywords": BOTH,
    "not integer beside number": BOTH,
    "remote $ref": BOTH,
    "additionalProperties schema": OUTLINES,
    "patternProperties": OUTLINES,
    "propertyNames": OUTLINES,
    "minProperties": OUTLINES,
    "maxProperties": OUTLINES,
    "minProperties open": BOTH,
    "dependencies open object": BOTH,
    "dependencies of five keys": BOTH,
    "patternProperties over a declared name": OUTLINES,
    "$ref to patternProperties with siblings": OUTLINES,
    "patternProperties of every name": OUTLINES,
    "if/then/else": BOTH,  # multipleOf beside a bound
    "not enum of each type": OUTLINES,  # integers around 3: exclusive bounds
    "not const object": BOTH,
    "not of numbers": OUTLINES,
    "not enum beside a pattern": BOTH,
    "contains": BOTH,
    "property name quote": OUTLINES,
}


def validator_for(schema: dict):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("probe", list(PROBES))
def test_probe(backends, walker, backend_name, probe):
    schema = PROBES[probe]
    refused = backend_name in REFUSED.get(probe, set())
    try:
        grammar = backends[backend_name].compile("json_schema", json.dumps(schema))
    except GrammarError as e:
        assert refused, f"{probe} unexpectedly refused: {e}"
        assert e.param == "json_schema"
        assert "not supported" in str(e) or "escaping" in str(e), str(e)
        return
    assert not refused, f"{probe} should be refused by {backend_name}"
    validator, finished = validator_for(schema), 0
    for seed in range(10):
        walk = walker.walk(grammar.matcher(), seed=seed)
        if walk.terminated:
            finished += 1
            value = json.loads(walk.text)
            assert not list(validator.iter_errors(value)), (probe, walk.text)
    assert finished >= 1, probe


def test_refusal_names_keyword_and_path(backends):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    for backend in backends.values():
        with pytest.raises(GrammarError, match=r"'uniqueItems' at \$\.properties\.tags") as info:
            backend.compile("json_schema", json.dumps(schema))
        assert info.value.param == "json_schema"
    with pytest.raises(GrammarError, match=r"'minimum' at \$\.properties\.age"):
        backends["outlines"].compile(
            "json_schema", json.dumps({"properties": {"age": {"type": "integer", "minimum": 0}}})
        )


def test_supported_features_lists(backends):
    for backend in backends.values():
        features = type(backend).supported_features()
        keywords = features["json_schema"]
        assert "uniqueItems" in keywords["supported_keywords"]  # items of a few values
        assert "if" in keywords["supported_keywords"]  # rewritten: see the notes
        assert "contains" in keywords["refused_keywords"]
        assert "not" in keywords["supported_keywords"]  # conditionally: see the notes
        assert "title" in keywords["ignored_keywords"]
    assert "ebnf" in backends["xgrammar"].supported_features()["kinds"]
    assert "ebnf" not in backends["outlines"].supported_features()["kinds"]
    assert "minimum" in backends["outlines"].supported_features()["json_schema"]["refused_keywords"]


@pytest.mark.parametrize(("probe", "texts"), [
    ("dependencies", {'{"a": 1, "b": 2}': True, '{"b": 2, "c": 3}': True, "{}": True,
                      '{"a": 1}': False, '{"a": 1, "c": 3}': False}),
    ("dependencies schema", {'{"a": 1, "b": 5}': True, '{"b": 1, "c": 1}': True,
                             '{"a": 1, "b": 1}': False, '{"a": 1, "b": 5, "c": 1}': False}),
    ("dependencies chained", {'{"a": 2, "b": 1, "c": 1}': True, '{"c": 1}': True,
                              '{"a": 2, "b": 1}': False,
                              '{"a": 1, "b": 1, "c": 1}': False, '{"b": 1}': False}),
    ("not of true", {'{"a": 1}': True, '{"a": 1, "b": 1}': False}),
    ("if/then/else bounds", {"5": True, "15": True, "0": True, "20": True, "25": False,
                             "-1": False}),
    ("if/then discriminator", {'{"type": "multi", "queries": [1]}': True,
                               '{"type": "multi"}': False, '{"type": "a"}': True,
                               '{"type": "b", "queries": []}': True}),
    ("if/then/else in allOf", {'{"k": "a", "x": 1}': True, '{"k": "a"}': False,
                               '{"k": "b", "y": "s"}': True, '{"k": "b"}': False,
                               '{"k": "c"}': True, '{"k": "c", "y": "s"}': False,
                               '{"k": "a", "x": 1, "y": "s"}': False,
                               '{"k": "b", "x": 1, "y": "s"}': True}),
    ("if/then/else open string", {'{"mode": "count", "n": 2}': True, '{"mode": "count"}': False,
                                  '{"mode": "counts"}': True, '{"mode": "coun", "n": 1}': False,
                                  '{"mode": ""}': True, '{"mode": "x\\n"}': True}),
    ("not of numbers", {"3": False, "-2": False, "0.5": False, "3.0": False, "0": True,
                        "4": True, "-3": True, "0.25": True, "2.5": True}),
    ("oneOf with an always-true branch", {'"emacs"': True, '""': True, '"nano"': False,
                                          '"vim"': False, '"vi"': True}),
    ("oneOf overlapping on a key", {'{"k": "a"}': True, '{"k": "b", "n": 1}': True,
                                    '{"k": "a", "n": 1}': False, '{"k": "b"}': False}),
    ("uniqueItems", {"[1, 2]": True, "[2, 1]": True, "[]": True, "[2]": True, "[1, 1]": False,
                     "[1, 2, 1]": False}),
    ("uniqueItems of booleans", {"[true]": True, "[false, true]": True, "[]": False,
                                 "[true, true]": False}),
    ("not const string", {'"mult"': True, '"multis"': True, '""': True, '"multi"': False,
                          '"multi\\n"': True, '"mu\\u006cti"': False}),
    ("not enum of each type", {'"b"': True, '""': True, '"a"': False, "4": True, "2": True,
                               "3": False, "false": True, "true": False, "null": False}),
    ("not type", {"3": True, '"x"': False, "null": False}),
    ("oneOf open branches", {'{"kind": "a", "n": 1}': True, '{"kind": "b", "v": 1}': True,
                             '{"w": 1}': True, '{"kind": "a", "w": 1}': True,
                             '{"kind": "b"}': False, '{"kind": "c"}': False}),
    ("not required", {'{"a": 1}': True, '{"b": 1, "c": 3}': True, '{"a": 1, "b": 2}': False,
                      '{"a": 1, "b": 2, "c": 3}': False}),
    ("not anchored pattern", {'"abd"': True, '"a b-"': True, '"ab"': False, '""': False,
                              '"a\\n"': False}),  # Python's $ matches before a final newline
    ("patternProperties over a declared name", {
        '{"ab": 3, "a": 9}': True, '{"ba": 7}': True, '{"ab": 9}': False,
        '{"ab": 1, "ab": 9}': False, '{"a": 9, "ab": 9}': False}),
    ("patternProperties of every name", {
        '{"by": "xy", "z": "long"}': True, '{"by": "long"}': False,
        '{"by": "x", "by": "long"}': False}),
])
def test_rewritten_keywords_accept_exactly_the_valid_texts(backends, tokenizer, probe, texts):
    """The rewrites above, checked on chosen texts (random walks seldom reach the cases that
    matter: a dependency's key present, a pattern key spelling a declared name)."""
    validator = validator_for(PROBES[probe])
    for text, valid in texts.items():
        assert validator.is_valid(json.loads(text)) == valid, text  # the case is what it says
        matcher = backends["xgrammar"].compile("json_schema", json.dumps(PROBES[probe])).matcher()
        ids = tokenizer.encode(text, add_special_tokens=False)
        accepted = all(matcher.accept_token(i) for i in ids) and matcher.can_terminate()
        assert accepted == valid, (probe, text)


# ----------------------------------------------------------------------------- raw engines
def raw_xgrammar(backend, schema: dict) -> XGrammarCompiled:
    compiler = xgr.GrammarCompiler(backend.tokenizer_info, max_threads=1)
    compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    return XGrammarCompiled(compiled, backend.vocab_size, backend.eos_token_ids)


def raw_outlines(backend, schema: dict) -> OutlinesCompiled:
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema), "")
    index = outlines_core.Index(regex, backend.vocabulary)
    return OutlinesCompiled(index, backend.token_info, backend.eos_token_ids)


RAW_VIOLATIONS = [
    ("xgrammar", {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True,
                  "minItems": 2}),
    ("xgrammar", {"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 5}]}),
    ("xgrammar", s(pattern='^a"b$')),  # the raw quote breaks the JSON string
    ("xgrammar", s(minLength=1, maxLength=3)),  # raw control characters inside the string
    ("xgrammar", {"type": "integer", "minimum": 0, "multipleOf": 2}),
    ("xgrammar", s(pattern=r"^a(?:x[0-9]+)?b$")),  # optional group: the x gets skipped
    ("outlines", {"type": "integer", "minimum": 5, "maximum": 9}),
    ("outlines", {"type": "object", "properties": {'q"k': {"type": "integer"}},
                  "required": ['q"k']}),
]


@pytest.mark.parametrize(("engine", "schema"), RAW_VIOLATIONS, ids=range(len(RAW_VIOLATIONS)))
def test_raw_engine_violates_what_plait_refuses_or_rewrites(backends, walker, engine, schema):
    build = raw_xgrammar if engine == "xgrammar" else raw_outlines
    grammar = build(backends[engine], schema)
    validator = validator_for(schema)
    for seed in range(60):
        walk = walker.walk(grammar.matcher(), seed=seed, max_steps=60)
        if not walk.terminated:
            continue
        try:
            value = json.loads(walk.text)
        except json.JSONDecodeError:
            return  # invalid JSON: a violation
        if not validator.is_valid(value):
            return
    pytest.fail(f"raw {engine} respected {schema}: plait's refusal may no longer be needed")
