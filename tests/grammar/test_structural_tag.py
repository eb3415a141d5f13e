"""The structural_tag constraint kind (xgrammar's structural tags) and the tags plait builds for
tool calls in "auto" with a --tool-call-parser (plait/server/tool_calls.py's call_tag): free
text, and every call the model starts held to one of the tools, its arguments to the tool's
schema as plait enforces a response_format schema (patterns, closed objects, refusals)."""

from __future__ import annotations

import json

import pytest

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
PING = {"type": "function", "function": {"name": "ping"}}  # no parameters: an empty object


def _tag(parser: str, one_call: bool = False) -> str:
    from plait.server.tool_calls import Tool, call_tag

    tools = [Tool.model_validate(t) for t in (WEATHER, PING)]
    return json.dumps(call_tag(parser, tools, one_call))


def _accepts(backends, spec: str, text: str, whole: bool = True) -> bool:
    """Whether the constraint takes `text` (and, with whole, may end there)."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(backends["xgrammar"].compile("structural_tag", spec).compiled)
    return matcher.accept_string(text) and (not whole or matcher.is_terminated()
                                            or matcher.accept_token(matcher.stop_token_ids[0]))


HERMES_CALL = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>')


@pytest.mark.parametrize("text, ok", [
    ("Just text, no call.", True),
    ("Sure. " + HERMES_CALL, True),
    (HERMES_CALL + "\n" + '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>', True),
    (HERMES_CALL.replace("Paris", "paris"), False),  # the pattern
    (HERMES_CALL.replace('"celsius"', '"kelvin"'), False),  # the enum
    (HERMES_CALL.replace('"celsius"}', '"celsius", "x": 1}'), False),  # a closed object
    (HERMES_CALL.replace("get_weather", "get_time"), False),  # not one of the tools
    # no parameters: it takes none (plait's objects carry only declared properties)
    ('<tool_call>\n{"name": "ping", "arguments": {"a": 1}}\n</tool_call>', False),
])
def test_hermes_calls_are_held_to_their_tools(backends, text, ok):
    assert _accepts(backends, _tag("hermes"), text) == ok


def test_llama3_json_calls_are_held_to_their_tools(backends):
    call = '{"name": "get_weather", "parameters": {"city": "Lyon", "unit": "fahrenheit"}}'
    assert _accepts(backends, _tag("llama3_json"), call)
    assert _accepts(backends, _tag("llama3_json"), call + '; {"name": "ping", "parameters": {}}')
    assert not _accepts(backends, _tag("llama3_json"), call.replace("Lyon", "lyon"))
    assert not _accepts(backends, _tag("llama3_json"), '{"name": "nope", "parameters": {}}',
                        whole=False)


def test_one_call_ends_the_answer_after_its_call(backends):
    assert _accepts(backends, _tag("hermes", one_call=True), "Sure. " + HERMES_CALL)
    assert not _accepts(backends, _tag("hermes", one_call=True), HERMES_CALL + " more",
                        whole=False)
    assert _accepts(backends, _tag("hermes"), HERMES_CALL + " more")


def test_a_schema_plait_cannot_enforce_is_refused_inside_a_tag(backends):
    from plait.grammar.base import GrammarError

    tag = {"type": "structural_tag", "format": {"type": "tag", "begin": "<x>", "end": "</x>",
           "content": {"type": "json_schema", "json_schema": {
               "type": "array", "uniqueItems": True, "items": {"type": "integer"}}}}}
    with pytest.raises(GrammarError, match="uniqueItems"):
        backends["xgrammar"].compile("structural_tag", json.dumps(tag))
    tag["format"]["content"] = {"type": "json_schema", "json_schema": {"type": "object"},
                                "style": "qwen_xml"}
    with pytest.raises(GrammarError, match="style"):
        backends["xgrammar"].compile("structural_tag", json.dumps(tag))
    with pytest.raises(GrammarError, match="outlines"):
        backends["outlines"].compile("structural_tag", _tag("hermes"))
    with pytest.raises(GrammarError, match="structural_tag"):
        backends["xgrammar"].compile("structural_tag", '{"type": "structural_tag", "format": 1}')
