"""Constrained generation through the Engine (scheduler, masks, jump-forward, budget closing):
finished outputs always satisfy their constraint; bad constraints fail only their request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import plait

pytestmark = pytest.mark.model  # starts a model or a server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Person:", "Data about Bob", "x", "Extract the user as JSON: Ann, 31, likes tea"]


@pytest.fixture(scope="module", params=["xgrammar", "outlines"])
def engine(request, tiny_llama):
    with plait.Engine(tiny_llama, grammar_backend=request.param, max_total_tokens=8192) as eng:
        yield eng


def finished_ok(out) -> bool:
    return out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature):
    outs = engine.generate(
        PROMPTS * 2,
        [{"max_new_tokens": 96, "temperature": temperature, "seed": i, "json_schema": json.dumps(SCHEMA)}
         for i in range(len(PROMPTS) * 2)],
    )
    for o in outs:
        assert finished_ok(o), o["meta_info"]
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_closes_within_a_tight_budget(engine, temperature):
    """32 tokens: the closing plan (~15 tokens) always fits, so every output must end as valid
    JSON. Greedy decoding on random weights repeats one digit or string token forever: the
    planner must find the way out of an open number or string (a depth-first search that
    wandered into string content found none, and every output came back incomplete)."""
    outs = engine.generate(
        PROMPTS, [{"max_new_tokens": 32, "temperature": temperature, "seed": i,
                   "json_schema": json.dumps(SCHEMA)} for i in range(len(PROMPTS))],
    )
    for o in outs:
        assert finished_ok(o), (o["text"], o["meta_info"])
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        assert o["meta_info"]["completion_tokens"] <= 32


def test_regex_and_choices(engine):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    for seed in range(3):
        out = engine.generate("Phone:", {"max_new_tokens": 30, "temperature": 1.0, "seed": seed, "regex": pattern})
        assert finished_ok(out) and re.fullmatch(pattern, out["text"])
    choices = ["apple", "banana split", "cherry"]
    outs = engine.generate(["Pick:"] * 3, {"max_new_tokens": 20, "temperature": 1.0, "choices": choices})
    assert all(o["text"] in choices for o in outs)


@pytest.mark.parametrize(
    "params, word",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}})}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
    ],
)
def test_bad_constraints_fail_alone(engine, params, word):
    with pytest.raises(ValueError, match=word):
        engine.generate("x", {"max_new_tokens": 8, **params})
    assert engine.generate("still serving", {"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4


def test_jump_forward_saves_forwards_and_off_forces_nothing(tiny_llama):
    # off, the model decodes every token under the mask (what vLLM does): one forward each;
    # on, forced text costs no forward of its own
    sp = {"max_new_tokens": 80, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}
    results = {}
    for jf in (False, True):
        with plait.Engine(tiny_llama, disable_jump_forward=not jf) as eng:
            outs = eng.generate(PROMPTS, sp)
            for o in outs:
                if finished_ok(o):
                    jsonschema.validate(json.loads(o["text"]), SCHEMA)
            info = eng.get_server_info()
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            results[jf] = (info["request_forwards"], tokens, info["forced_tokens"])
    forwards, tokens, _ = results[False]
    assert forwards >= tokens
    forwards, tokens, forced = results[True]
    assert forced > 0 and forwards < tokens
