"""OpenAI tool calling (plait/server/tool_calls.py) through the official client against a real
server: tool_choice "required" and a named function answer with tool calls whose arguments
hold to the tools' schemas by construction, "none" in text, "auto" is refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_utils import MODEL_NAME

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
# a schema that refers to its own definitions: under "required" it sits below the array's root
TIME = {
    "type": "function",
    "function": {
        "name": "get-time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"$ref": "#/$defs/zone"}, "h24": {"type": "boolean"}},
            "required": ["zone", "h24"],
            "additionalProperties": False,
            "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        },
    },
}
NO_PARAMETERS = {"type": "function", "function": {"name": "ping"}}
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"})
           for t in (WEATHER, TIME, NO_PARAMETERS)}


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def check_call(call) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.parametrize("tool", [WEATHER, TIME, NO_PARAMETERS])
def test_a_named_function_is_called_with_arguments_of_its_schema(client, tool):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME, NO_PARAMETERS],
        tool_choice=named(tool["function"]["name"]), max_tokens=64, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "stop"  # OpenAI's reason for a call forced by name
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == tool["function"]["name"]
    check_call(call)


def test_required_answers_with_calls_of_the_given_tools(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
        max_tokens=400, temperature=1.0, seed=3, n=4)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)
    names = {c.function.name for ch in r.choices for c in ch.message.tool_calls}
    assert names <= {"get_weather", "get-time"}


def test_parallel_tool_calls_false_makes_one_call(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        check_call(call)


def test_a_cut_list_returns_the_calls_written_so_far(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
        max_tokens=22, temperature=0)
    (choice,) = r.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls  # OpenAI's form: the arguments cut where the answer was
    assert call.function.name == "get_weather"
    assert call.function.arguments.startswith('{"city": "')
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="required",
        max_tokens=3, temperature=0)
    (choice,) = r.choices  # cut before the first name: the text
    assert choice.message.tool_calls is None and choice.message.content.startswith("[")


def test_none_answers_in_text(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER], tool_choice="none", max_tokens=8,
        temperature=0)
    plain = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    (choice,) = r.choices
    assert choice.message.tool_calls is None
    # the test model's template does not mention tools: the same prompt, the same answer
    assert choice.message.content == plain.choices[0].message.content


@pytest.mark.parametrize("tool_choice, parallel, max_tokens", [
    (named("get_weather"), False, 120),
    ("required", False, 120),
    ("required", True, 90),  # the random model's list goes on: cut inside a later call
    ("required", False, 14),  # cut just after the first call's name
    ("required", False, 22),  # cut inside the first call's arguments
    ("required", False, 3),  # cut before the first name: text
])
def test_streamed_calls_equal_the_whole_answer(client, tool_choice, parallel, max_tokens):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER, TIME],
              "tool_choice": tool_choice, "parallel_tool_calls": parallel,
              "max_tokens": max_tokens, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, list[str]] = {}
    content, reasons = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                if d.id is not None:  # a call starts: its id, type and name come first
                    assert d.index == len(calls) and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
    assert [r for r in reasons if r] == [whole.finish_reason]
    expected = [[c.function.name, c.function.arguments] for c in whole.message.tool_calls or []]
    assert [calls[i] for i in sorted(calls)] == expected
    assert content == (whole.message.content or "")
    if max_tokens == 3:
        assert not calls and content.startswith("[")
    elif whole.finish_reason != "length":
        for name, arguments in expected:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if parallel:
        assert len(expected) > 1


@pytest.mark.parametrize("separators, indent", [((", ", ": "), None), ((",", ":"), None),
                                                ((",", ": "), 2)])
def test_a_list_of_calls_streams_piece_by_piece_to_its_whole_arguments(separators, indent):
    """tool_calls.CallStreamer fed the text a character at a time, whatever the whitespace,
    the keys' order, and strings holding brackets, commas and escaped quotes."""
    from plait.server.tool_calls import CallStreamer, written_calls

    calls = [{"name": "a", "parameters": {"q": 'x "y" }], {', "n": [1, {"m": None}]}},
             {"parameters": 12, "name": "b"}, {"name": "e", "parameters": 7.5},
             {"name": "c", "parameters": "s,}"},
             {"name": "d", "parameters": {}}]
    text = json.dumps(calls, separators=separators, indent=indent)
    streamer, got = CallStreamer(), {}
    for k in range(1, len(text) + 1):
        for d in streamer.deltas(text[:k]):
            if "id" in d:
                got[d["index"]] = [d["function"]["name"], ""]
            got[d["index"]][1] += d["function"]["arguments"]
    assert [(n, json.loads(a)) for n, a in got.values()] == [
        (c["name"], c["parameters"]) for c in calls]
    assert [tuple(v) for v in got.values()] == written_calls(text)


def test_a_conversation_with_earlier_calls_is_served(client):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER],
                                       tool_choice="none", max_tokens=4)
    assert r.choices[0].message.content is not None


def test_an_answer_fed_back_as_the_sdk_dumps_it_is_served(client):
    """An agent loop that appends `message.model_dump()` (or an OpenAI answer's message) sends
    OpenAI's other assistant fields too, null or empty: refusal, annotations, audio,
    function_call."""
    kwargs = {"model": MODEL_NAME, "tools": [WEATHER], "max_tokens": 60, "temperature": 0}
    first = client.chat.completions.create(messages=MESSAGES, tool_choice="required", **kwargs)
    message = first.choices[0].message
    assert message.tool_calls
    dumped = message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= dumped.keys()
    messages = [*MESSAGES, dumped, *[{"role": "tool", "tool_call_id": c.id, "content": "21 C"}
                                     for c in message.tool_calls]]
    r = client.chat.completions.create(messages=messages, tool_choice="none", **kwargs)
    assert r.choices[0].message.content is not None


def test_tools_and_calls_reach_the_chat_template(server):
    """A template that renders tools and earlier calls sees them (transformers' `tools`, and
    a call's arguments as an object)."""
    from transformers import AutoTokenizer

    from plait.server.openai_api import ChatCompletionRequest, chat_prompt_ids

    tok = AutoTokenizer.from_pretrained(server.args.model_path)
    tok.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
        "{{ c.function.arguments.city }}]{% endfor %}{% endfor %}")
    req = ChatCompletionRequest.model_validate({"messages": [*MESSAGES, {
        "role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]}],
        "tools": [WEATHER, TIME]})
    text = tok.decode(chat_prompt_ids(tok, req.messages, False, req.tools))
    assert "[tool get_weather][tool get-time]" in text and "[call get_weather Oslo]" in text


@pytest.mark.parametrize("body, field", [
    ({"tools": [WEATHER]}, "tool_choice"),  # "auto", the default with tools
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": named("nope")}, "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "required"},
     "tools.0.function.name"),
    ({"tools": [], "tool_choice": "none"}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval", "function": {"name": "x"}}], "tool_choice": "required"},
     "tools.0.type"),
    ({"tools": [WEATHER], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": named("get_weather"), "regex": "a+"}, "regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "other.json#/a"}}}}}],
      "tool_choice": "none"}, "tools.1.function.parameters"),
    # an invalid schema is refused under "required" too, where it sits below the list's root
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": []}}}], "tool_choice": "required"},
     "tools.1.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": "a"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters"),
    # checked whatever tool_choice is: "none" and a named call too (OpenAI checks every tool)
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}], "tool_choice": "none"}, "tools.0.function.parameters"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": "a"}}}], "tool_choice": named("get_weather")},
     "tools.1.function.parameters"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]}]},
     "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]},
     "messages.0.audio"),
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {
        "name": "f", "arguments": "{}"}}]}, "messages.0.function_call"),
    ({"messages": [{"role": "user", "content": "x", "refusal": "no"}]}, "messages.0.refusal"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.tool_calls"),
])
def test_bad_tools_are_a_400_naming_the_field(server, body, field):
    resp = httpx.post(server.url + "/v1/chat/completions",
                      json={"messages": MESSAGES, "max_tokens": 4, **body}, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field, err
    if "$ref" in json.dumps(body):
        assert "$.properties.x" in err["message"], err  # where the $ref is


def test_streamed_calls_carry_every_tokens_logprob(client):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER],
              "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
              "temperature": 0, "logprobs": True, "top_logprobs": 2}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = [lp.token for chunk in client.chat.completions.create(stream=True, **kwargs)
                for ch in chunk.choices for lp in (ch.logprobs.content if ch.logprobs else [])]
    assert streamed == [lp.token for lp in whole.logprobs.content] and streamed


# ---------------------------------------------------------------- "auto", --tool-call-parser hermes
HERMES_ANSWERS = [
    ('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius"}}\n</tool_call>'),
    ('<tool_call>{"name": "ping", "arguments": {}}</tool_call>\n<tool_call>{"name": '
     '"get-time", "arguments": {"zone": "UTC", "h24": true}}</tool_call>'),
    "Just text, with a < sign and <tool_",  # ends inside what could have been the tag
    'A cut call <tool_call>{"name": "ping", "argu',  # cut: the call, no arguments yet
    'Cut later <tool_call>{"name": "get_weather", "arguments": {"city": "Par',
    "<tool_call>not json</tool_call>",
    '<tool_call>["name": "x"]</tool_call> and {"name": "y"} outside a block',
    '  \n<tool_call>{"name": "ping", "parameters": {"x": 1}}</tool_call>',
    # the keys in another order, arguments as a JSON string, a number, none; a closing tag
    # ends its block even inside a string (as vLLM's parser reads it): that block is no call
    ('<tool_call>{"arguments": {"q": "a }] b"}, "name": "s"}</tool_call>'
     '<tool_call>{"arguments": {"q": "a </tool_call>", "name": "r"}</tool_call>'
     '<tool_call>{"name": "t", "arguments": "{\\"k\\": 1}"}</tool_call><tool_call>'
     '{"name": "u", "arguments": 5 }</tool_call><tool_call> {"name": "v"} </tool_call>'),
    '<tool_call>{"name": "bad\\q", "x": 1}</tool_call><tool_call>{"name": "w"}</tool_call>',
]


def _merged(pieces: list[dict]) -> list[tuple[str, str]]:
    """Streamed tool_calls pieces put together by index: (name, arguments)."""
    got: dict[int, list[str]] = {}
    for d in pieces:
        if "id" in d:
            assert d["index"] == len(got) and d["type"] == "function"
            got[d["index"]] = [d["function"]["name"], ""]
        got[d["index"]][1] += d["function"]["arguments"]
    return [tuple(v) for v in got.values()]


LLAMA_ANSWERS = [
    '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
    ('<|python_tag|>{"name": "ping", "parameters": {}}; {"name": "get-time", "arguments": '
     '{"zone": "UTC"}}'),
    '  \n{"parameters": {"x": [1, "}"]}, "name": "p"} {"name": "q"}',
    'The weather {"name": "get_weather"} is fine.',  # text first: text
    '{"city": "Paris"}',  # JSON without a name: text
    '{"name": "get_weather", "parameters": {"ci',  # cut
    "<|python_tag|>",
    "<|python",
    "   ",
]


PYTHONIC_ANSWERS = [
    '[get_weather(city="Paris", unit="celsius")]',
    (' <|python_start|>[ping(), get-time(zone=\'UTC\'), s(q="a )] b", d={"k": [1, (2, 3)]})]'
     '<|python_end|>'),
    '[f(x=1, y=None, z=True), g(flag=false, n=null)]',  # JSON's names too
    "[f(x=1), g(2), h()]",  # a positional argument ends the calls
    "[f(x=1), g(y=[1,",  # cut inside the second
    "[f(x=print(1))]",  # not a literal: no call, text
    "Call [f(x=1)] like this.",  # text first: text
    "[1, 2, 3]",
    "[note] this",
    "[f",
    "<|python_start|>",
    "<|python",
    "   ",
]


def _stream_parsed(plan, text, steps):
    """ParsedCallStreamer fed growing prefixes of text (ends in `steps`): the streamed
    content, the calls put together, and whether it said it had calls."""
    from plait.server.tool_calls import ParsedCallStreamer

    streamer, streamed, got = ParsedCallStreamer(plan), "", []
    for k in steps:
        for d in streamer.deltas(text[:k], finished=k == len(text)):
            streamed += d.get("content", "")
            got += d.get("tool_calls", [])
    return streamed, _merged(got), streamer.has_calls


@pytest.mark.parametrize("parser, text", [("hermes", t) for t in HERMES_ANSWERS]
                         + [("llama3_json", t) for t in LLAMA_ANSWERS]
                         + [("pythonic", t) for t in PYTHONIC_ANSWERS])
@pytest.mark.parametrize("one_call", [False, True])
def test_parsed_answers_stream_piece_by_piece_to_the_whole_answer(parser, text, one_call):
    """ParsedCallStreamer fed the text a character at a time: content, then each call's name
    and arguments as written, add up to the whole answer's (ToolPlan.answer)."""
    from plait.server.tool_calls import ToolPlan

    plan = ToolPlan(None, None, parser, one_call=one_call)
    content, calls = plan.answer(text)
    streamed, got, has_calls = _stream_parsed(plan, text, range(1, len(text) + 1))
    assert streamed == (content or "")
    assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []]
    assert has_calls == (calls is not None)
    if calls is None:
        assert content == text  # not a call after all: the whole text is the content


@pytest.mark.parametrize("parser, extra", [
    ("hermes", ["<tool_call>", "</tool_call>", "<tool_", "</tool"]),
    ("llama3_json", ["<|python_tag|>", "<|py", ";", "{"]),
    ("pythonic", ["<|python_start|>", "[f(", "g(x=", "h()", "(", ")", "=", "'", "None", "2.5",
                  "[ping(a='x)', b=[1, (2,)])"])])
def test_parsed_streams_equal_whole_answers_on_random_texts(parser, extra):
    """Random texts of tag, JSON and stray pieces, streamed in random steps: the streamed
    content and calls are the whole answer's every time (and nothing raises)."""
    import random

    from plait.server.tool_calls import ToolPlan

    pieces = [*extra, "{", "}", "[", "]", '"name"', '"arguments"', '"parameters"', ":", ",",
              " ", "\n", '"x"', '"a\\"b"', "\\", "1", '"', "text", "<",
              '{"name": "f", "arguments": {"a": [1, "}"]}}']
    rng = random.Random(0)
    for _ in range(1500):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 25)))
        plan = ToolPlan(None, None, parser, one_call=rng.random() < 0.3)
        content, calls = plan.answer(text)
        steps, k = [], 0
        while k < len(text):
            k = min(len(text), k + rng.randrange(1, 4))
            steps.append(k)
        streamed, got, _ = _stream_parsed(plan, text, steps)
        assert streamed == (content or ""), text
        assert got == [(c["function"]["name"], c["function"]["arguments"])
                       for c in calls or []], text


def test_hermes_calls_stream_as_they_are_written():
    """A call's name goes out once whole and its arguments as they grow, long before the
    answer ends; what may be a closing tag is held back until it is one."""
    from plait.server.tool_calls import ParsedCallStreamer, ToolPlan

    text = HERMES_ANSWERS[1]
    streamer = ParsedCallStreamer(ToolPlan(None, None, "hermes"))
    cut = text.index('", "arguments"') + 1  # the first call's name just whole
    (d,) = streamer.deltas(text[:cut], finished=False)
    assert _merged(d["tool_calls"]) == [("ping", "")]
    (d,) = streamer.deltas(text[:text.index("</tool_call>") + 3], finished=False)
    assert d["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]
    second = text.index('"UTC"') + 2  # the second call's arguments half written
    d = streamer.deltas(text[:second], finished=False)
    assert [p.get("function", {}).get("arguments") for p in d[0]["tool_calls"]] == [
        "", '{"zone": "U']


def test_hermes_calls_are_read_with_their_arguments():
    from plait.server.tool_calls import ToolPlan

    def read(text, one_call=False):
        content, calls = ToolPlan(None, None, "hermes", one_call=one_call).answer(text)
        return content, [(c["function"]["name"], c["function"]["arguments"])
                         for c in calls or []]

    content, calls = read(HERMES_ANSWERS[0])
    assert content == "Sure." and calls == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')]
    assert read(HERMES_ANSWERS[1], one_call=True) == (None, [("ping", "{}")])
    assert read(HERMES_ANSWERS[3]) == ("A cut call", [("ping", "")])
    assert read(HERMES_ANSWERS[4]) == ("Cut later", [("get_weather", '{"city": "Par')])
    for text in HERMES_ANSWERS[5:7]:  # no object with a name in a block: text
        assert read(text) == (text, [])
    assert read(HERMES_ANSWERS[8]) == (None, [
        ("s", '{"q": "a }] b"}'), ("t", '{"k": 1}'), ("u", "5"), ("v", "{}")])
    assert read(HERMES_ANSWERS[9]) == (None, [("w", "{}")])  # a name that is no JSON string


def test_llama3_json_calls_are_read_with_their_arguments():
    from plait.server.tool_calls import ToolPlan

    def read(text):
        content, calls = ToolPlan(None, None, "llama3_json").answer(text)
        return content, [(c["function"]["name"], c["function"]["arguments"])
                         for c in calls or []]

    assert read(LLAMA_ANSWERS[0]) == (None, [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    assert read(LLAMA_ANSWERS[1]) == (None, [("ping", "{}"), ("get-time", '{"zone": "UTC"}')])
    assert read(LLAMA_ANSWERS[2]) == (None, [("p", '{"x": [1, "}"]}'), ("q", "{}")])
    for text in (*LLAMA_ANSWERS[3:5], *LLAMA_ANSWERS[6:]):
        assert read(text) == (text, [])
    assert read(LLAMA_ANSWERS[5]) == (None, [("get_weather", '{"ci')])


def test_pythonic_calls_are_read_as_json_arguments():
    """Keyword literals become the JSON arguments (tuples as lists, None/True/False and JSON's
    null/true/false names alike); the calls end at the first call that is not whole and
    well-formed; an answer that does not start with `[name(` is text."""
    from plait.server.tool_calls import ToolPlan

    def read(text, one_call=False):
        content, calls = ToolPlan(None, None, "pythonic", one_call=one_call).answer(text)
        return content, [(c["function"]["name"], c["function"]["arguments"])
                         for c in calls or []]

    assert read(PYTHONIC_ANSWERS[0]) == (None, [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}')])
    assert read(PYTHONIC_ANSWERS[1]) == (None, [
        ("ping", "{}"), ("get-time", '{"zone": "UTC"}'),
        ("s", '{"q": "a )] b", "d": {"k": [1, [2, 3]]}}')])
    assert read(PYTHONIC_ANSWERS[1], one_call=True) == (None, [("ping", "{}")])
    assert read(PYTHONIC_ANSWERS[2]) == (None, [
        ("f", '{"x": 1, "y": null, "z": true}'), ("g", '{"flag": false, "n": null}')])
    assert read(PYTHONIC_ANSWERS[3]) == (None, [("f", '{"x": 1}')])
    assert read(PYTHONIC_ANSWERS[4]) == (None, [("f", '{"x": 1}')])
    for text in PYTHONIC_ANSWERS[5:]:
        assert read(text) == (text, [])
    for bad in ("[f(x=1e400)]", "[f(x={1, 2})]", "[f(**k)]", "[f(x=b'1')]",
                "[f(x=" + "[" * 5000 + "]" * 5000 + ")]"):
        assert read(bad) == (bad, []), bad  # no JSON for them: no call


def _parser_client(model: str, parser: str):
    """An OpenAI client of a server started with --tool-call-parser `parser` (a generator:
    the server stops after the module's tests)."""
    from tests.server.server_utils import start_server

    server = start_server(model, tool_call_parser=parser)
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c
    server.shutdown()


@pytest.fixture(scope="module")
def hermes_client(tiny_llama):
    yield from _parser_client(tiny_llama, "hermes")


def _stream(client, **kwargs):
    """A streamed answer's content, its calls put together by index, and finish reasons."""
    content, pieces, reasons = "", [], []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            pieces += [d.model_dump(exclude_none=True) for d in ch.delta.tool_calls or []]
            reasons.append(ch.finish_reason)
    return content, _merged(pieces), [r for r in reasons if r]


@pytest.mark.parametrize("parallel", [None, False])
def test_auto_reads_the_models_hermes_calls(hermes_client, parallel):
    """The test model is random: a regex makes it write Hermes blocks, as a model trained on
    them would (tool_choice left out: OpenAI's default with tools, "auto")."""
    import re

    answer = HERMES_ANSWERS[0] + "\n" + HERMES_ANSWERS[1]
    # a choice inside the first call's arguments (the forced text before it goes out first)
    regex = re.escape(answer).replace("Paris", "(Paris|Lyon)")
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER, TIME, NO_PARAMETERS],
              "max_tokens": 200, "temperature": 0, "extra_body": {"regex": regex}}
    if parallel is not None:
        kwargs["parallel_tool_calls"] = parallel
    (choice,) = hermes_client.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."
    names = ["get_weather", "ping", "get-time"][:1 if parallel is False else 3]
    assert [c.function.name for c in choice.message.tool_calls] == names
    for call in choice.message.tool_calls:
        check_call(call)
    content, calls, reasons = _stream(hermes_client, **kwargs)
    assert content == "Sure." and reasons == ["tool_calls"]
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


@pytest.fixture(scope="module")
def llama_client(tiny_llama):
    yield from _parser_client(tiny_llama, "llama3_json")


def _check_parsed_calls(client, answer: str, names: list[str]) -> None:
    """A parser's server: the random test model held to `answer` by a regex (a choice inside
    its first call) gives `names`' calls, whole and streamed alike; held to a sentence, it
    answers in content."""
    import re

    regex = re.escape(answer).replace("Paris", "(Paris|Lyon)")
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER, TIME, NO_PARAMETERS],
              "max_tokens": 200, "temperature": 0, "extra_body": {"regex": regex}}
    (choice,) = client.chat.completions.create(**kwargs).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c.function.name for c in choice.message.tool_calls] == names
    for call in choice.message.tool_calls:
        check_call(call)
    assert _stream(client, **kwargs) == (
        "", [(c.function.name, c.function.arguments) for c in choice.message.tool_calls],
        ["tool_calls"])
    kwargs["extra_body"] = {"regex": "It is sunny in (Paris|Lyon)\\."}
    (choice,) = client.chat.completions.create(**kwargs).choices
    assert choice.message.tool_calls is None and choice.message.content.startswith("It is sunny")
    assert _stream(client, **kwargs) == (choice.message.content, [], [choice.finish_reason])


def test_auto_reads_the_models_llama3_json_calls(llama_client):
    """--tool-call-parser llama3_json: the answer's JSON objects are the calls, streamed or
    whole alike; a text answer is content."""
    _check_parsed_calls(llama_client, (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
        '"celsius"}}; {"name": "ping", "parameters": {}}'), ["get_weather", "ping"])


@pytest.fixture(scope="module")
def pythonic_client(tiny_llama):
    yield from _parser_client(tiny_llama, "pythonic")


def test_auto_reads_the_models_pythonic_calls(pythonic_client):
    """--tool-call-parser pythonic: a [name(key=value)] list is the calls, streamed or whole
    alike; a text answer is content; no structural tag (its calls are not JSON)."""
    _check_parsed_calls(pythonic_client, '[get_weather(city="Paris", unit="celsius"), ping()]',
                        ["get_weather", "ping"])
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER, TIME],
              "temperature": 0}
    # no other constraint: still no structural tag (nothing compiled)
    info = httpx.get(str(pythonic_client.base_url).removesuffix("/v1/") + "/get_server_info")
    before = info.json()["grammar"].get("cache_misses", 0)
    pythonic_client.chat.completions.create(**{**kwargs, "max_tokens": 4})
    info = httpx.get(str(pythonic_client.base_url).removesuffix("/v1/") + "/get_server_info")
    assert info.json()["grammar"].get("cache_misses", 0) == before


def test_auto_holds_the_models_calls_to_the_tools(hermes_client):
    """With a parser and no other constraint, "auto" runs under a structural tag (the calls
    held to the tools: tests/grammar/test_structural_tag.py): the scheduler compiles one, and
    a tool whose schema plait cannot enforce is a 400 naming the tools, as for "required"."""
    info = httpx.get(str(hermes_client.base_url).removesuffix("/v1/") + "/get_server_info")
    before = info.json()["grammar"].get("cache_misses", 0)  # {} before a first constraint
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER, TIME],
              "max_tokens": 8, "temperature": 0}
    hermes_client.chat.completions.create(**kwargs)
    info = httpx.get(str(hermes_client.base_url).removesuffix("/v1/") + "/get_server_info")
    assert info.json()["grammar"]["cache_misses"] == before + 1
    unique = {"type": "function", "function": {"name": "tags", "parameters": {
        "type": "object", "properties": {"t": {"type": "array", "uniqueItems": True}}}}}
    with pytest.raises(openai.BadRequestError) as e:
        hermes_client.chat.completions.create(**{**kwargs, "tools": [WEATHER, unique]})
    assert e.value.body["param"] == "tools" and "uniqueItems" in e.value.body["message"]


def test_generate_takes_a_structural_tag(http):
    """SGLang's structural_tag sampling parameter on /generate (a JSON object or its text):
    the output is the tag's format, its JSON schema part held as a response_format's is."""
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"}}}
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<x>", "content": {"type": "json_schema", "json_schema": schema},
        "end": "</x>"}}
    for value in (tag, json.dumps(tag)):
        r = http.post("/generate", json={"text": "Weather:", "sampling_params": {
            "max_new_tokens": 80, "temperature": 0, "structural_tag": value}})
        assert r.status_code == 200, r.text
        text = r.json()["text"]
        assert text.startswith("<x>") and text.endswith("</x>"), text
        jsonschema.validate(json.loads(text[3:-4]), schema)
    r = http.post("/generate", json={"text": "x", "sampling_params": {
        "structural_tag": tag, "regex": "a+"}})
    assert r.status_code == 400 and "only one constraint" in r.text


def test_auto_without_calls_answers_in_text(hermes_client):
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER],
              "tool_choice": "auto", "max_tokens": 16, "temperature": 0}
    (choice,) = hermes_client.chat.completions.create(**kwargs).choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert _stream(hermes_client, **kwargs) == (choice.message.content, [], [choice.finish_reason])
