"""OpenAI tool calling on /v1/chat/completions, made by the grammar instead of a parser.

`tool_choice` "required" or a named function ({"type": "function", "function": {"name": N}})
constrains the answer to a tool call by construction, as vLLM does for these two choices
without a model-specific parser: a named function's answer is its `parameters` schema (the
call's arguments), "required"'s a JSON array of one or more {"name", "parameters"} objects
(at most one with `parallel_tool_calls: false`). The answer comes back as
`message.tool_calls`. "none" answers in text. "auto", OpenAI's default when tools are given,
lets the model choose between text and a call in its own tool-call format: served with
`--tool-call-parser hermes` (the <tool_call> blocks of Qwen 2.5 and Hermes models),
`llama3_json` (Llama 3.1-3.3's JSON calls) or `pythonic` (Llama 3.2's and 4's Python lists of
calls), else refused by name rather than answered in text that ignores the tools; with
xgrammar, a structural tag (call_tag) holds each JSON call the model starts to one of the
tools and its schema, the rest of the answer free (pythonic calls are read as written).

The tools are passed to the chat template (`tools`), as transformers and vLLM pass them; a
template that does not mention them (SmolLM2's) leaves them out of the prompt, and the grammar
still holds the answer to their schemas.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import json
import math
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool

from plait.errors import RequestError
from plait.grammar.base import GrammarError
from plait.grammar.json_schema import check_schema

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCall(_Body):
    """A call in an assistant message of the conversation so far."""

    id: str
    type: Literal["function"]
    function: FunctionCall


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How a request with tools is answered: `named` (one function's arguments), a list of
    calls (`required`), both with `schema` the output's JSON schema; or, with `parser`, the
    model's own answer read for calls ("auto")."""

    named: str | None
    schema: dict[str, Any] | None
    parser: str | None = None
    one_call: bool = False  # parallel_tool_calls false, for a parser's calls
    # a parser's answer: the structural tag that holds each call the model starts to its tool
    # (name and arguments) and leaves the rest free (xgrammar; call_tag)
    tag: dict[str, Any] | None = None

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        """OpenAI ends a call it forced by name with "stop", calls the model chose with
        "tool_calls"."""
        if reason != "stop" or not has_calls or self.named is not None:
            return reason
        return "tool_calls"

    def answer(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer's (content, tool_calls)."""
        if self.parser is not None:
            reader = self.reader()
            calls = reader.read(text, final=True)
            if not calls:
                return text, None
            content = text[:reader.first].rstrip()
            calls = calls[:1] if self.one_call else calls
            return (content if content.strip() else None), [_call(*c) for c in calls]
        calls = self.calls(text)
        return (None, calls) if calls else (text, None)

    def reader(self) -> HermesReader | JsonCallsReader | PythonicReader:
        """A new reader of the parser's calls."""
        return PARSERS[self.parser]()

    def calls(self, text: str) -> list[dict[str, Any]] | None:
        """The answer's tool calls in OpenAI's form: a named function's call is its text; a
        list's calls are those whose name it has written. An answer cut by max_tokens gives
        what was written, as OpenAI returns it (None: a list cut before its first name)."""
        if self.named is not None:
            return [_call(self.named, text)]
        return [_call(name, arguments) for name, arguments in written_calls(text)] or None


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclasses.dataclass
class ScannedCall:
    """One call of a list of calls' text so far: its name once whole, where its parameters'
    text starts, and where it ends once whole (else None: it runs to the text's end); whether
    the call's object has closed."""

    name: str | None = None
    start: int | None = None
    end: int | None = None
    closed: bool = False


class CallScanner:
    """The calls in (a prefix of) a list of calls' JSON text, `[{"name": .., "parameters":
    ..}, ..]`, whatever the keys' order and the whitespace: each call's name and its
    parameters' text as the model wrote it, so that streamed pieces add up to the whole
    answer's arguments. Incremental: `feed` reads only what the text gained since the last
    call (a stream's text grows a token at a time: rescanning it whole each time would cost
    time quadratic in its length on the server's event loop). `objects=True`: the calls are
    top-level objects instead (a Hermes block's `{"name": .., "arguments": ..}`), and
    `arguments` the keys that hold a call's arguments."""

    def __init__(self, objects: bool = False, arguments: tuple[str, ...] = ("parameters",),
                 start: int = 0) -> None:
        self._call, self._arguments = (1 if objects else 2), arguments
        self.calls: list[ScannedCall] = []
        self._current = ScannedCall()  # the object being read at the calls' depth
        self.pos, self._depth, self._in_string, self._escaped = start, 0, False, False
        self._string_start, self._key, self._expect_key = 0, None, True
        self._value_start: int | None = None

    def feed(self, text: str, end: int | None = None) -> list[ScannedCall]:
        """Read text[pos:end] (end: the text's end)."""
        at, arguments = self._call, self._arguments
        end = len(text) if end is None else end
        for i in range(self.pos, end):
            ch = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == at:  # a key or a value of a call's object
                        if self._expect_key:
                            self._key = _json_string(text[self._string_start:i + 1])
                        elif self._key == "name":
                            self._current.name = _json_string(text[self._string_start:i + 1])
                        elif self._key in arguments and self._current.end is None:
                            self._current.end = i + 1
                continue
            if ch.isspace():
                continue
            depth, key = self._depth, self._key
            call = self._current
            if depth == at and not self._expect_key and key in arguments and call.start is None:
                call.start = i
            if ch == '"':
                self._in_string, self._string_start = True, i
            elif ch in "{[":
                self._depth += 1
                if self._depth == at:  # an object there is a call (a list is not)
                    self._current = ScannedCall()
                    if ch == "{":
                        self.calls.append(self._current)
                    self._expect_key, self._key = True, None
            elif ch in "}]":
                if depth == at + 1 and key in arguments and call.end is None:
                    call.end = i + 1
                elif depth == at:
                    if key in arguments and call.end is None:
                        call.end = self._value_start  # a number or literal ends here
                    call.closed = True
                self._depth -= 1
            elif depth == at and ch == ":":
                self._expect_key = False
            elif depth == at and ch == ",":
                if key in arguments and call.end is None:
                    call.end = self._value_start
                self._expect_key, self._key = True, None
            if self._depth == at and not self._expect_key and ch not in ":,":
                self._value_start = i + 1  # past the value's last character at this depth
        self.pos = max(self.pos, end)
        return self.calls


def _json_string(literal: str) -> str | None:
    """A JSON string literal's value; None if it is not one (a model's stray backslash)."""
    try:
        return json.loads(literal)
    except ValueError:
        return None


def written_calls(text: str, scanner: CallScanner | None = None) -> list[tuple[str, str]]:
    """(name, arguments text) of each call of a list of calls' text (so far) whose name is
    whole, up to the first whose name is not; an unfinished call's arguments up to their
    last character (a trailing space may end a number). `scanner`: one that has read a
    prefix of `text` (a stream's), else a new one."""
    out = []
    for c in (scanner or CallScanner()).feed(text):
        if c.name is None:
            break
        if c.start is None:
            out.append((c.name, ""))
        else:
            out.append((c.name, text[c.start:].rstrip() if c.end is None else text[c.start:c.end]))
    return out


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
HERMES_ARGUMENTS = ("arguments", "parameters")


def _held_back(text: str, end: int, tag: str) -> int:
    """`end`, less the longest suffix of text[:end] that could start `tag`."""
    for k in range(min(len(tag) - 1, end), 0, -1):
        if text.startswith(tag[:k], end - k):
            return end - k
    return end


class HermesReader:
    """The calls of an answer in Hermes blocks (vLLM's hermes parser's format, Qwen 2.5's and
    Hermes models'): `<tool_call>{"name": .., "arguments": ..}</tool_call>`, any number. A
    call is each block's object whose name is whole (a string); its arguments are the text the
    model wrote for them (an object's, or a string's value decoded once whole; "{}" for a call
    that closed without any), up to what is written: an answer cut short ends with the calls
    written so far, the last one's arguments cut (as OpenAI returns a cut call). A block with
    no such object is no call. Read incrementally (`read` on a growing text, linear in its
    length); what may still be a closing tag is not read until it is whole or turns out not
    to be one (`final`: the text is whole, read it all), so a stream's calls grow only by
    appending and end as the whole answer's."""

    def __init__(self) -> None:
        self.first: int | None = None  # where the first <tool_call> starts
        self._blocks: list[CallScanner] = []  # each block's, from past its opening tag
        self._closed = 0  # blocks whose closing tag is found
        self._search = 0  # no opening tag starts before this (past the closed blocks)

    def read(self, text: str, final: bool) -> list[tuple[str, str]]:
        """(name, arguments) of the calls in `text` so far."""
        while True:
            if len(self._blocks) == self._closed:  # look for the next block's opening tag
                tag = text.find(HERMES_OPEN, self._search)
                if tag < 0:
                    self._search = max(self._search, len(text) - len(HERMES_OPEN) + 1)
                    break
                if self.first is None:
                    self.first = tag
                self._blocks.append(
                    CallScanner(True, HERMES_ARGUMENTS, start=tag + len(HERMES_OPEN)))
            scanner = self._blocks[-1]
            close = text.find(HERMES_CLOSE, scanner.pos)  # the scanner stops short of one
            if close < 0:
                scanner.feed(text, None if final else _held_back(text, len(text), HERMES_CLOSE))
                break
            scanner.feed(text, close)
            self._closed += 1
            self._search = close + len(HERMES_CLOSE)
        calls = []
        for scanner in self._blocks:
            calls += [(c.name, _object_arguments(text, c, scanner.pos))
                      for c in scanner.calls if c.name is not None]
        return calls

    def content_end(self, text: str) -> int:
        """Before the first block is found: how much of the text may go out as content (not
        what may start an opening tag)."""
        return _held_back(text, len(text), HERMES_OPEN)


LLAMA_PYTHON_TAG = "<|python_tag|>"


def _space_end(text: str, i: int) -> int:
    """The index of the first character at or after i that is not space (len: none)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class JsonCallsReader:
    """The calls of an answer that is JSON objects (vLLM's llama3_json parser's format, Llama
    3.1-3.3's JSON tool calls): `{"name": .., "parameters": ..}` (or "arguments"), one or
    more, separated by `;` or space, after an optional `<|python_tag|>` (there when special
    tokens are kept); an answer whose first character past any space is not `{` (or that
    tag) is text. Calls and arguments as HermesReader reads a block's; incremental."""

    def __init__(self) -> None:
        self.first: int | None = None  # where the calls start (the object, or the tag)
        self._scanner: CallScanner | None = None
        self._text = False  # the answer is text

    def read(self, text: str, final: bool) -> list[tuple[str, str]]:
        """(name, arguments) of the calls in `text` so far."""
        if self._scanner is None and not self._text:
            start = _space_end(text, 0)
            begin = start
            if text.startswith(LLAMA_PYTHON_TAG, start):
                begin = _space_end(text, start + len(LLAMA_PYTHON_TAG))
            elif LLAMA_PYTHON_TAG.startswith(text[start:]) and not final:
                return []  # space so far, or what may be the tag: not known yet
            if begin == len(text) and not final:
                return []  # the tag, nothing after it yet
            if text.startswith("{", begin):
                self.first = start
                self._scanner = CallScanner(True, HERMES_ARGUMENTS, start=begin)
            else:
                self._text = True
        if self._scanner is None:
            return []
        self._scanner.feed(text)
        return [(c.name, _object_arguments(text, c, self._scanner.pos))
                for c in self._scanner.calls if c.name is not None]

    def content_end(self, text: str) -> int:
        """How much of the text may go out as content: none until it is known to be text."""
        return len(text) if self._text else 0


def _object_arguments(text: str, c: ScannedCall, end: int) -> str:
    """A call object's arguments read by CallScanner: the text the model wrote for them (up
    to `end`, trailing space held back, while unfinished), a JSON string's value once whole,
    "{}" for an object that closed without any."""
    if c.start is None:
        return "{}" if c.closed else ""
    if text[c.start] == '"':  # arguments written as a JSON string: its value, once whole
        if c.end is None:
            return ""
        try:
            value = json.loads(text[c.start:c.end])
        except ValueError:
            return text[c.start:c.end]
        return value if isinstance(value, str) else text[c.start:c.end]
    return text[c.start:end].rstrip() if c.end is None else text[c.start:c.end]


PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_PY_NAME = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\s*\(")
_PY_OPEN = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.-]*\s*\(")  # a call list's start
_PY_LITERAL_NAMES = {"true": True, "false": False, "null": None}  # JSON's, written by models


class PythonicReader:
    """The calls of an answer that is a Python list of calls (vLLM's pythonic parser's
    format, Llama 3.2's and Llama 4's): `[get_weather(city="Paris", days=3), ping()]`, after
    optional space and `<|python_start|>` (there when special tokens are kept); keyword
    arguments with literal values (strings, numbers, True/False/None, lists, dicts, tuples),
    each call's arguments the JSON object of its keywords. An answer is a call list when it
    starts (past that) with `[`, a name and `(`; any other answer is text. Its calls are the
    leading ones that are whole and well-formed: reading stops at a call with positional or
    non-literal arguments, and at one cut short (a call's arguments are not JSON until its
    `)`, so calls go out whole, one at a time; a stream's calls still only grow by appending
    and end as the whole answer's). Text after the list is not content (vLLM's reads the
    whole answer as the list). Incremental: each character is scanned once."""

    def __init__(self) -> None:
        self.first: int | None = None  # where the call list starts (the `[`, or the tag)
        self._text = False  # the answer is text
        self._calls: list[tuple[str, str]] = []
        self._pos = 0  # where the next call (or the list's end) is read from
        self._done = False  # the list ended, or a call that is not one stopped the reading
        # the call being scanned: its `(` at _open; bracket depth, string state
        self._open: int | None = None
        self._scan, self._depth, self._quote, self._escaped = 0, 0, "", False

    def read(self, text: str, final: bool) -> list[tuple[str, str]]:
        """(name, arguments) of the whole calls in `text` so far."""
        if self.first is None and not self._text:
            self._decide(text, final)
        while self.first is not None and not self._done:
            if self._open is None:  # the next call's name and `(`, or the list's end
                i = _space_end(text, self._pos)
                if i < len(text) and text[i] == "]":
                    self._done = True
                    break
                if i < len(text) and text[i] == "," and self._calls:
                    i = _space_end(text, i + 1)
                m = _PY_NAME.match(text, i)
                if m is None:
                    if i < len(text) and not re.fullmatch(r"[A-Za-z0-9_.-]*\s*", text[i:]):
                        self._done = True  # not a call: the calls end here
                    break
                self._pos, self._open = i, m.end() - 1
                self._scan, self._depth, self._quote = m.end(), 1, ""
            end = self._scan_call(text)
            if end is None:
                break
            call = _python_call(text[self._pos:end])
            if call is None:
                self._done = True
                break
            self._calls.append(call)
            self._pos, self._open = end, None
        return list(self._calls)

    def _decide(self, text: str, final: bool) -> None:
        """Whether the answer is a call list, once its start tells."""
        start = _space_end(text, 0)
        begin = start
        if text.startswith(PYTHON_START, start):
            begin = _space_end(text, start + len(PYTHON_START))
        elif PYTHON_START.startswith(text[start:]) and not final:
            return  # space so far, or what may be the tag
        if _PY_OPEN.match(text, begin):
            self.first, self._pos = start, begin + 1
        elif final or not re.fullmatch(r"\[?\s*(?:[A-Za-z_][A-Za-z0-9_.-]*\s*)?", text[begin:]):
            self._text = True

    def _scan_call(self, text: str) -> int | None:
        """The end of the call whose `(` is at _open (past its `)`), or None while unfinished."""
        i = self._scan
        while i < len(text):
            ch = text[i]
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == self._quote:
                    self._quote = ""
            elif ch in "\"'":
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._scan = i + 1
                    return i + 1
            i += 1
        self._scan = i
        return None

    def content_end(self, text: str) -> int:
        """How much of the text may go out as content: none until it is known to be text."""
        return len(text) if self._text else 0


def _python_call(source: str) -> tuple[str, str] | None:
    """(name, JSON arguments) of one `name(key=literal, ...)`; None if it is not one."""
    m = _PY_NAME.match(source)
    if m is None:
        return None
    try:  # (parsed, never run; a model's deep nesting is a RecursionError)
        node = ast.parse("_f(" + source[m.end():], mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        arguments = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            arguments[kw.arg] = _python_literal(kw.value)
        return m.group(1), json.dumps(arguments, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _python_literal(node: ast.AST) -> Any:
    """A literal's value (ast.literal_eval's, tuples as lists, and JSON's true/false/null
    names, which models write too); ValueError for anything else."""
    if isinstance(node, ast.Name) and node.id in _PY_LITERAL_NAMES:
        return _PY_LITERAL_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_key(_python_literal(k)): _python_literal(v)
                for k, v in zip(node.keys, node.values)}
    value = ast.literal_eval(node)
    if isinstance(value, (set, bytes, complex)) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise ValueError("not JSON")
    return value


def _key(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float, bool)) or value is None:
        return json.dumps(value)
    raise ValueError("a dict key that JSON cannot hold")


# --tool-call-parser: the readers of the models' own formats, by vLLM's parser names
PARSERS = {"hermes": HermesReader, "llama3_json": JsonCallsReader, "pythonic": PythonicReader}


class ParsedCallStreamer:
    """An "auto" answer read by the server's tool-call parser, as stream deltas that add up to
    the whole answer's (ToolPlan.answer): content as it comes, up to where the calls start
    (what may start them, and trailing space, are held back); then each call as it is written
    (its id, type and name once the name is whole, then its arguments as they grow); at the
    end, if the answer held no call, the held text as content."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.sent = 0
        self.has_calls = False
        self._reader = plan.reader()
        self._calls = CallStreamer()

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        calls = self._reader.read(text, finished)
        if self.plan.one_call:
            calls = calls[:1]
        first = self._reader.first
        if first is None:  # content: hold back what may start the calls, unless finished
            end = len(text) if finished else self._reader.content_end(text)
        else:
            end = first
        if not finished or first is not None:
            while end > self.sent and text[end - 1].isspace():
                end -= 1
        if finished and not calls:
            end = len(text)  # no call after all: the rest is content
        if end > self.sent:
            out.append({"content": text[self.sent:end]})
            self.sent = end
        if calls:
            self.has_calls = True
            pieces = self._calls.pieces(calls)
            if pieces:
                out.append({"tool_calls": pieces})
        return out


class CallStreamer:
    """A list of calls as OpenAI stream deltas, piece by piece: a call's id, type and name
    once its name is whole, then its arguments as they grow."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.sent: list[int] = []
        self._scanner = CallScanner()

    def deltas(self, text: str) -> list[dict[str, Any]]:
        return self.pieces(written_calls(text, self._scanner))

    def pieces(self, calls: list[tuple[str, str]]) -> list[dict[str, Any]]:
        """The deltas of calls (name, arguments so far) that grew from the last ones'."""
        out = []
        for j, (name, arguments) in enumerate(calls):
            if j == len(self.ids):
                call = _call(name, "")
                self.ids.append(call["id"])
                self.sent.append(0)
                out.append({"index": j, **call})
            if len(arguments) > self.sent[j]:
                out.append({"index": j, "function": {"arguments": arguments[self.sent[j]:]}})
                self.sent[j] = len(arguments)
        return out


def _check_parameters(tool: Tool, field: str) -> None:
    """A tool's parameters must be a valid schema whatever tool_choice is (OpenAI checks them
    all; under "none", or "auto" without compiling them, nothing else would)."""
    try:
        _checked_schema(json.dumps(_parameters(tool), sort_keys=True))
    except GrammarError as e:
        raise RequestError(field, str(e).removeprefix("json_schema: ")) from None


@functools.lru_cache(maxsize=256)
def _checked_schema(text: str) -> None:
    """check_schema once per schema text (agent loops send the same tools every turn)."""
    check_schema(json.loads(text))


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel_tool_calls: bool | None,
         other_constraint: str | None, parser: str = "none",
         structural_tags: bool = False) -> ToolPlan | None:
    """The request's tools and tool_choice checked; None when the answer is text. `parser`:
    the server's --tool-call-parser, which "auto" needs; `structural_tags`: the server's
    grammar backend has them (xgrammar), so that "auto" holds the calls to their tools where
    the request has no other constraint."""
    if not tools:
        if tools is not None:
            raise RequestError("tools", "must not be empty (leave it out for no tools)")
        if choice not in (None, "none"):
            raise RequestError("tool_choice", "needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise RequestError("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    names: dict[str, int] = {}
    for i, t in enumerate(tools):
        name = t.function.name
        if not _NAME.fullmatch(name):
            raise RequestError(f"tools.{i}.function.name", "1 to 64 letters, digits, '_' or "
                               f"'-', got {name[:80]!r}")
        if name in names:
            raise RequestError(f"tools.{i}.function.name", f"{name!r} is also tools.{names[name]}")
        names[name] = i
        _check_parameters(t, f"tools.{i}.function.parameters")
    if choice is None or choice == "auto":
        if parser in PARSERS:  # the model's own answer, read for calls
            one_call = parallel_tool_calls is False
            tag = (call_tag(parser, tools, one_call)  # (pythonic: Python, not JSON, calls)
                   if structural_tags and other_constraint is None and parser in _CALL_FORMATS
                   else None)
            return ToolPlan(None, None, parser, one_call, tag)
        raise RequestError("tool_choice", "'auto' (the default with tools) lets the model answer "
                           "in its own tool-call format, which this server does not parse "
                           "(start it with --tool-call-parser hermes for <tool_call> blocks, "
                           "llama3_json for Llama 3's JSON calls, or pythonic for Llama 3.2's "
                           "and 4's [name(key=value)] lists); "
                           "use 'required', a named function ({'type': 'function', 'function': "
                           "{'name': ...}}) or 'none'")
    if choice == "none":
        return None
    if other_constraint is not None:
        raise RequestError(other_constraint, f"cannot be combined with tool_choice "
                           f"{choice if isinstance(choice, str) else 'naming a function'}: "
                           "the tool call is the answer's format")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise RequestError("tool_choice.function.name", f"{name[:80]!r} is not one of the "
                               "tools")
        return ToolPlan(name, _parameters(tools[names[name]]))
    defs: dict[str, Any] = {}
    options = []
    for i, t in enumerate(tools):
        defs.update(_hoisted(_parameters(t), f"tool{i}", f"tools.{i}.function.parameters"))
        options.append({
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [t.function.name]},
                           "parameters": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options},
                              "$defs": defs}
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return ToolPlan(None, schema)


# how each parser's format writes a call: (trigger, its start up to the arguments, its end)
_CALL_FORMATS = {
    "hermes": ("<tool_call>", '<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', '{{"name": {name}, "parameters": ', "}"),
}


def call_tag(parser: str, tools: list[Tool], one_call: bool) -> dict[str, Any]:
    """xgrammar's structural tag for "auto" with a parser: text as the model likes, and once
    it starts a call (the format's trigger), the call is one of the tools by name with its
    `parameters` schema's arguments, in the layout the parser reads. With one_call, the answer
    ends after a call."""
    trigger, begin, end = _CALL_FORMATS[parser]
    tags = [{"type": "tag", "begin": begin.format(name=json.dumps(t.function.name)),
             "content": {"type": "json_schema", "json_schema": _parameters(t)}, "end": end}
            for t in tools]
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger], "tags": tags, "at_least_one": False,
        "stop_after_first": one_call}}


def _parameters(tool: Tool) -> dict[str, Any]:
    # OpenAI: a function without parameters takes none
    p = tool.function.parameters
    return {"type": "object", "properties": {}} if p is None else p


def _hoisted(schema: dict[str, Any], key: str, field: str) -> dict[str, Any]:
    """`schema` as root-level definitions for an array schema that holds it below its root:
    the schema under `key`, its own $defs / definitions beside it as key__name, and every
    local $ref (which points from the schema's root) rewritten to match."""
    schema = copy.deepcopy(schema)
    own: dict[str, Any] = {}
    for section in ("definitions", "$defs"):
        defs = schema.pop(section, {})
        if not isinstance(defs, dict):
            raise RequestError(f"{field}.{section}", "must be an object of schemas")
        own.update(defs)

    def rewrite(node: Any) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#"):
                node["$ref"] = _moved(ref[1:], key)
            for v in node.values():
                rewrite(v)
        elif isinstance(node, list):
            for v in node:
                rewrite(v)

    out = {key: schema, **{f"{key}__{name}": d for name, d in own.items()}}
    rewrite(out)
    return out


def _moved(pointer: str, key: str) -> str:
    for section in ("/$defs/", "/definitions/"):
        if pointer.startswith(section):
            name, _, rest = pointer[len(section):].partition("/")
            return f"#/$defs/{key}__{name}" + (f"/{rest}" if rest else "")
    return f"#/$defs/{key}{pointer}"


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as chat templates take them (transformers' `tools`: OpenAI's objects)."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]


def template_tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's calls for the template: arguments as an object where they are
    one (Hugging Face templates expect that), else as given."""
    out = []
    for c in calls:
        try:
            arguments: Any = json.loads(c.function.arguments)
        except ValueError:
            arguments = c.function.arguments
        if not isinstance(arguments, dict):
            arguments = c.function.arguments
        out.append({"id": c.id, "type": "function",
                    "function": {"name": c.function.name, "arguments": arguments}})
    return out
