"""Request conversion without a server: OpenAI bodies and SGLang /generate bodies ->
SamplingParams / GenerateInputs, and the errors they raise."""

from __future__ import annotations

import json

import pytest

from plait.errors import RequestError
from plait.server.http_common import error_body
from plait.server.native_api import parse_generate
from plait.server.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    openai_error,
    parse_body,
    response_format_constraint,
    sampling_params,
)

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields) -> ChatCompletionRequest:
    return parse_body(ChatCompletionRequest, {"model": "m", "messages": MSGS, **fields})


def chat_sampling(**fields):
    req = chat(**fields)
    return sampling_params(req, req.max_tokens, response_format_constraint(req.response_format))


def test_response_format_json_schema():
    sp = chat_sampling(
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
        }
    )
    assert sp.constraint == (
        "json_schema",
        json.dumps(SCHEMA, separators=(",", ":")),  # keys in the schema's order
    )


def test_response_format_json_object_and_text():
    assert chat_sampling(response_format={"type": "json_object"}).constraint == ("json_object", "")
    assert chat_sampling(response_format={"type": "text"}).constraint is None


def test_response_format_json_schema_needs_a_schema():
    with pytest.raises(RequestError, match="response_format.json_schema.schema"):
        chat_sampling(response_format={"type": "json_schema", "json_schema": {"name": "x"}})


def test_response_format_structural_tag():
    fmt = {"type": "tag", "begin": "<a>", "content": {"type": "json_schema",
                                                      "json_schema": SCHEMA}, "end": "</a>"}
    sp = chat_sampling(response_format={"type": "structural_tag", "format": fmt})
    assert sp.constraint == ("structural_tag", json.dumps(
        {"type": "structural_tag", "format": fmt}))
    with pytest.raises(RequestError, match="response_format.format"):
        chat_sampling(response_format={"type": "structural_tag"})


@pytest.mark.parametrize(
    "field, value, kind",
    [
        ("regex", "[0-9]+", "regex"),
        ("ebnf", 'root ::= "a"', "ebnf"),
        ("json_schema", SCHEMA, "json_schema"),
        ("choices", ["yes", "no"], "choices"),
    ],
)
def test_constraint_extra_fields_pass_through(field, value, kind):
    assert chat_sampling(**{field: value}).constraint[0] == kind
    req = parse_body(CompletionRequest, {"prompt": "x", field: value})
    assert sampling_params(req, 5, {}).constraint[0] == kind


def test_two_constraints_are_refused():
    with pytest.raises(RequestError, match="only one constraint"):
        chat_sampling(regex="a", response_format={"type": "json_object"})


def test_openai_fields_map_to_sampling_params():
    sp = chat_sampling(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        seed=3,
        stop="x",
        n=2,
        frequency_penalty=0.1,
        presence_penalty=0.2,
        top_k=5,
        min_p=0.1,
        min_tokens=2,
        repetition_penalty=1.1,
        ignore_eos=True,
        stop_token_ids=[9],
    )
    assert (sp.max_new_tokens, sp.temperature, sp.top_p, sp.seed, sp.stop, sp.n) == (
        7,
        0.5,
        0.9,
        3,
        ["x"],
        2,
    )
    assert (sp.frequency_penalty, sp.presence_penalty, sp.top_k, sp.min_p) == (0.1, 0.2, 5, 0.1)
    assert (sp.min_new_tokens, sp.repetition_penalty, sp.ignore_eos, sp.stop_token_ids) == (
        2,
        1.1,
        True,
        [9],
    )


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"foo": 1}, "foo"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}},
            "response_format.json_schema.bogus",
        ),
        ({"messages": [{"role": "user", "content": "x", "extra": 1}]}, "messages.0.extra"),
        ({"temperature": "warm"}, "temperature"),
        ({"n": "many"}, "n"),
        ({"stream_options": {"include_usage": "yes please"}}, "stream_options.include_usage"),
        ({"stream_options": {"include_usage": True, "continuous_usage_stats": 1}},
         "stream_options.continuous_usage_stats"),
    ],
)
def test_invalid_bodies_name_the_field(fields, param):
    with pytest.raises(RequestError) as e:
        chat(**fields)
    assert e.value.status == 400 and e.value.param == param and param in str(e.value)


def test_errors_use_openai_names():
    e = openai_error(RequestError("max_new_tokens", "5000 new tokens exceed"))
    assert str(e) == "max_tokens: 5000 new tokens exceed" and e.param == "max_tokens"
    with pytest.raises(RequestError) as e:
        chat_sampling(max_tokens=-2)
    assert e.value.param == "max_tokens" and str(e.value).startswith("max_tokens:")


def test_error_body_shape():
    assert error_body(RequestError("model", "no such model", 404)) == {
        "error": {
            "message": "model: no such model",
            "type": "not_found_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error_body(RequestError(None, "busy", 429))["error"]["code"] == "rate_limit_exceeded"


def test_generate_batch_and_n_expand_in_order():
    req = parse_generate(
        {
            "text": ["a", "b"],
            "rid": ["r1", "r2"],
            "sampling_params": {"n": 2, "seed": 10, "max_new_tokens": 3},
        }
    )
    assert req.batched and not req.stream
    assert [(i.text, i.rid, i.sampling_params.seed) for i in req.reqs] == [
        ("a", "r1_0", 10),
        ("a", "r1_1", 11),
        ("b", "r2_0", 10),
        ("b", "r2_1", 11),
    ]
    single = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}})
    assert not single.batched and single.reqs[0].input_ids == [1, 2, 3]


def test_generate_accepts_sglang_nulls_and_names():
    req = parse_generate(
        {
            "text": "x",
            "lora_path": None,
            "session_id": None,
            "logprob_start_len": None,
            "sampling_params": {
                "temperature": None,
                "max_new_tokens": 4,
                "stop": [],
                "stop_regex": [],
                "spaces_between_special_tokens": True,
                "sampling_seed": 5,
                "json_schema": None,
                "regex": None,
            },
        }
    )
    sp = req.reqs[0].sampling_params
    assert (sp.temperature, sp.max_new_tokens, sp.seed, sp.constraint) == (1.0, 4, 5, None)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"text": "x", "sampling_params": {"top_k": "all"}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
        ({"text": "x", "image_data": "b64"}, "image_data"),
        ({"text": "x", "rid": 5}, "rid"),
        ({"text": "x", "top_logprobs_num": "3"}, "top_logprobs_num"),
        ({"input_ids": []}, "input_ids"),
        ({"text": ["a"], "rid": ["1", "2"]}, "rid"),
    ],
)
def test_generate_errors_name_the_field(body, param):
    with pytest.raises(RequestError) as e:
        parse_generate(body)
    assert e.value.status == 400 and e.value.param == param


async def test_a_stream_sends_each_requests_last_state_once():
    """The frontend's state of a request is one object that moves on while a stream is
    written: items queued before it finished read as finished when taken (the stream's first
    item most often, taken before the 200 went out). Each request's last state goes out (and
    is counted) once: an OpenAI stream ended with two finish_reason chunks before."""
    from plait.io_struct import ReqState
    from plait.server.http_common import each_last_once

    a, b = ReqState("a", 3), ReqState("b", 3)

    async def rest():
        yield 0, a  # queued while "a" ran; it has finished since
        yield 1, b
        b.text, b.finished_reason = "yes", {"type": "stop"}
        yield 1, b
        yield 0, a

    a.text, a.finished_reason = "hi", {"type": "length"}  # before the stream reads its first
    lasts = []
    got = [(i, s.rid) async for i, s in each_last_once((0, a), rest(), lasts.append)]
    assert got == [(0, "a"), (1, "b"), (1, "b")]
    assert lasts == [a, b]
