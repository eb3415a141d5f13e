"""OpenAI-compatible API: /v1/models, /v1/completions, /v1/chat/completions.

Request bodies are pydantic models with extra="forbid" (an unknown field is a 400 naming it);
each request becomes a GenerateInput, normalized like a /generate body (prompts x n outputs),
and runs through the same plumbing (http_common).
Beyond OpenAI's fields, the constraint fields regex / ebnf / json_schema / choices and a few
SGLang sampling fields (top_k, min_p, ...) are accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError

from plait.errors import RequestError
from plait.io_struct import GenerateInput, ReqInput, ReqState
from plait.models.tokenizer import encode_prompt
from plait.sampling import SamplingParams
from plait.server import http_common, tool_calls
from plait.server.http_common import TokenTexts
from plait.server.tool_calls import Tool, ToolCall, ToolChoice, ToolPlan

router = APIRouter(prefix="/v1")
# vLLM's /tokenize and /detokenize, at the root as vLLM serves them
token_router = APIRouter()

MAX_TOP_LOGPROBS = 20
# SamplingParams' field names -> the OpenAI request's, for error messages.
OPENAI_NAMES = {"min_new_tokens": "min_tokens"}  # max_new_tokens: FieldNames.max_tokens


# ---------------------------------------------------------------------- request models
class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: StrictBool = False


class JsonSchemaFormat(_Body):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None  # structural_tag's (vLLM's form: xgrammar's format)


class _Sampling(_Body):
    """The fields completions and chat share."""

    model: str | None = None
    max_tokens: int | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: int | None = None  # plait: higher is served sooner (default: the API key's)
    logit_bias: dict[str, float] | None = None
    # SGLang / vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: StrictBool | None = None
    no_stop_trim: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None  # vLLM's
    # constraints (plait.grammar)
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None
    choices: list[str] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(BaseModel):
    """A part of a message's content. Only text parts are served (a text-only model); any
    other type (image_url, input_audio, file) is refused by name (check_content_parts), so its
    own fields are let through here."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls earlier in the conversation
    # OpenAI's other assistant fields, which an answer fed back (the SDK's model_dump()) carries
    # null or empty: accepted so, refused by name otherwise (check_messages)
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # plait/server/tool_calls.py
    parallel_tool_calls: StrictBool | None = None
    # OpenAI fields that change nothing here, accepted as OpenAI's and vLLM's servers do
    # (clients send them): metadata tags stored completions, service_tier auto/default is the
    # one tier; store=true, which plait cannot honour, is refused (check_openai_extras)
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None


def parse_body(cls: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e) from None
    except RecursionError:
        raise RequestError("body", "nested too deeply") from None


def _validation_error(e: ValidationError) -> RequestError:
    errors = e.errors()
    unknown = [_location(err) for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        return RequestError(unknown[0], f"unknown field{'s' if len(unknown) > 1 else ''}"
                            + (f" (also {', '.join(unknown[1:])})" if len(unknown) > 1 else ""))
    return RequestError(_location(errors[0]), errors[0]["msg"])


def _location(err: dict[str, Any]) -> str:
    """The field's dotted path, without pydantic's union-branch names ('str', 'list[int]')."""
    loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in _TYPES))]
    return ".".join(loc) or "body"


_TYPES = {"str", "int", "float", "bool", "dict", "list", "function-after", "literal"}


# ---------------------------------------------------------------------- conversion
def check_model(request: Request, model: str | None) -> None:
    names = request.app.state.model_names
    if model is not None and model not in names:
        raise RequestError(
            "model", f"the model '{model}' does not exist (served: {names[0]})", 404
        )


@dataclasses.dataclass(frozen=True)
class FieldNames:
    """How one OpenAI request names the fields that plait's errors carry by SamplingParams'
    and /generate's names."""

    prompt: str = "prompt"  # completions' prompt (prompt.i in a batch); chat's messages
    max_tokens: str = "max_tokens"  # chat's max_completion_tokens when the request gives it
    constraint: str | None = None  # the field a constraint came from: response_format, tools


def sampling_params(
    req: _Sampling, max_tokens: int | None, constraint: dict[str, Any],
    names: FieldNames = FieldNames(),
) -> SamplingParams:
    """`constraint` from the request field `names.constraint` (response_format, tools)."""
    d: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "n": req.n,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "seed": req.seed,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "repetition_penalty": req.repetition_penalty,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "regex": req.regex,
        "ebnf": req.ebnf,
        "json_schema": req.json_schema,
        "choices": req.choices,
        "logit_bias": req.logit_bias,
        **constraint,
    }
    try:
        return SamplingParams.from_dict({k: v for k, v in d.items() if v is not None})
    except RequestError as e:
        raise openai_error(e, names) from None


def openai_error(e: RequestError, names: FieldNames = FieldNames()) -> RequestError:
    """Names SamplingParams' fields as the OpenAI request does (max_new_tokens -> max_tokens
    or max_completion_tokens; a constraint given as response_format -> response_format), and
    the prompt (/generate's text.i / input_ids.i): completions' prompt.i, chat's messages."""
    field = e.field
    head, dot, rest = (field or "").partition(".")
    if head in ("text", "input_ids"):
        return e.renamed(names.prompt + (dot + rest if names.prompt == "prompt" else ""))
    if field == "max_new_tokens":
        return e.renamed(names.max_tokens)
    if field in OPENAI_NAMES:
        return e.renamed(OPENAI_NAMES[field])
    if names.constraint and field in ("json_schema", "json_object", "structural_tag"):
        return e.renamed(names.constraint)
    return e


def response_format_constraint(fmt: ResponseFormat | None) -> dict[str, Any]:
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.type == "structural_tag":
        if fmt.format is None:
            raise RequestError("response_format.format", "required for type structural_tag")
        return {"structural_tag": {"type": "structural_tag", "format": fmt.format}}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format.json_schema.schema", "required for type json_schema")
    return {"json_schema": fmt.json_schema.schema_}


def check_openai_extras(req: ChatCompletionRequest) -> None:
    """The accepted-and-ignored OpenAI fields, within OpenAI's own bounds."""
    if req.store:
        raise RequestError("store", "plait does not store completions (only false)")
    if req.service_tier not in (None, "auto", "default"):
        raise RequestError("service_tier", f"plait serves one tier: 'auto' or 'default', "
                           f"got {req.service_tier[:32]!r}")
    if req.metadata is not None and (len(req.metadata) > 16 or any(
            len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())):
        raise RequestError("metadata", "at most 16 pairs, keys of up to 64 characters and "
                           "values of up to 512")


def check_content_parts(messages: list[ChatMessage]) -> None:
    """Content given as parts: text parts only, each with its text."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            if part.type != "text":
                raise RequestError(f"messages.{i}.content.{j}.type", "only text content parts "
                                   f"are supported by this model, got {part.type!r}")
            if not isinstance(part.text, str):
                raise RequestError(f"messages.{i}.content.{j}.text", "required for a text part")


def check_prompt_size(field: str, chars: int, limit: int) -> None:
    """A prompt of `chars` characters is refused over --max-prompt-chars, before tokenizing."""
    if chars > limit:
        raise RequestError(field, f"{chars} characters, over the limit of {limit} "
                           "(--max-prompt-chars; by default derived from the context length)")


def check_messages(messages: list[ChatMessage], limit: int) -> None:
    """Chat messages as they may be rendered: text content parts, calls only in assistant
    messages, at most `limit` characters."""
    check_content_parts(messages)
    for i, m in enumerate(messages):
        if m.tool_calls is not None and m.role != "assistant":
            raise RequestError(f"messages.{i}.tool_calls", "only assistant messages hold calls")
        for field in ("refusal", "annotations", "audio", "function_call"):
            if getattr(m, field):
                raise RequestError(f"messages.{i}.{field}", "not supported by plait (only null "
                                   "or empty, as in an answer fed back)")
    check_prompt_size("messages", sum(
        (len(m.content or "") if isinstance(m.content, str) else
         sum(len(p.text) for p in m.content or []))
        + sum(len(c.function.arguments) for c in m.tool_calls or []) for m in messages), limit)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    tools: list[Tool] | None = None) -> list[int]:
    """The conversation's prompt ids through the chat template (messages as check_messages
    leaves them; the tools and earlier calls as tool_calls.py passes them)."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("messages", "the model has no chat template; use /v1/completions")
    conversation = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if m.role == "developer" else m.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if m.tool_calls:
            message["tool_calls"] = tool_calls.template_tool_calls(m.tool_calls)
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        conversation.append(message)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tools=tool_calls.template_tools(tools), tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
    except Exception as e:  # jinja raises for conversations the template refuses
        raise RequestError("messages", f"the chat template failed: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)


def normalize(
    request: Request,
    prompts: list[dict[str, Any]],
    sp: SamplingParams,
    req: _Sampling,
    top_logprobs: int | None,
    return_logprob: bool,
    names: FieldNames = FieldNames(),
    logprob_start_len: int | None = None,
) -> list[ReqInput]:
    """The OpenAI request as a GenerateInput, normalized: prompt i, sample j -> choice
    index i * n + j."""
    key = "text" if "text" in prompts[0] else "input_ids"
    values = [p[key] for p in prompts]
    inp = GenerateInput(
        **{key: values if len(values) > 1 else values[0]},
        sampling_params=sp,
        stream=req.stream,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs,
        priority=req.priority,
    )
    try:
        reqs = http_common.normalize(request, inp).reqs
    except RequestError as e:
        raise openai_error(e, names) from None
    return reqs


async def run(request: Request, reqs: list[ReqInput], names: FieldNames = FieldNames()):
    try:
        return await http_common.run_to_end(request, reqs)
    except RequestError as e:
        raise openai_error(e, names) from None


def response_head(request: Request, id_prefix: str, obj: str) -> dict[str, Any]:
    """The fields every OpenAI response (and each of its stream's chunks) starts with."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": request.app.state.model_name,
    }


def finish_reason(state: ReqState) -> str | None:
    reason = state.finished_reason
    if reason is None:
        return None
    return {"stop": "stop", "length": "length"}.get(reason.get("type"), reason.get("type"))


def usage(states: list[ReqState], n: int) -> dict[str, Any]:
    """Prompt tokens count once per prompt (not per sample), as OpenAI counts them."""
    firsts = states[::n]
    prompt = sum(s.meta.get("prompt_tokens", s.prompt_tokens) for s in firsts)
    cached = sum(
        min(s.meta.get("cached_tokens", 0) for s in states[i : i + n])
        for i in range(0, len(states), n)
    )
    completion = sum(s.meta.get("completion_tokens", len(s.output_ids)) for s in states)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---------------------------------------------------------------------- logprobs
def completion_logprobs(
    state: ReqState, start: int, end: int, texts: TokenTexts, text_offset: int,
    echo: bool = False,
) -> dict[str, Any]:
    """OpenAI's legacy logprobs object for output tokens [start, end); with `echo`, the
    prompt's tokens first (the first one's logprob null, as OpenAI and vLLM give it)."""
    entries = []  # (logprob, token id, top rows or None)
    if echo:
        prompt, rows = state.input_token_logprobs or [], state.input_top_logprobs or []
        entries += [(lp, tok, rows[k] if k < len(rows) else None)
                    for k, (lp, tok) in enumerate(prompt)]
    rows = state.output_top_logprobs
    entries += [(*state.output_token_logprobs[k], rows[k] if k < len(rows) else None)
                for k in range(start, end)]
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for lp, tok, top in entries:
        text = texts(tok)
        tokens.append(text)
        token_logprobs.append(lp)
        offsets.append(text_offset)
        text_offset += len(text)
        tops.append(_top_with_token(top or [], text, lp, texts))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def _top_with_token(
    top: list, text: str, logprob: float | None, texts: TokenTexts
) -> dict[str, float] | None:
    """A legacy top_logprobs entry: the top-k and the chosen token, which OpenAI always
    includes ("up to logprobs+1 elements"); None for a token without a logprob (the first of
    an echoed prompt)."""
    if logprob is None:
        return None
    entry = {texts(t): v for v, t in top}
    entry.setdefault(text, logprob)
    return entry


def chat_logprobs(state: ReqState, start: int, end: int, texts: TokenTexts) -> dict[str, Any]:
    content = []
    rows = state.output_top_logprobs
    for k in range(start, end):
        lp, tok = state.output_token_logprobs[k]
        text = texts(tok)
        top = rows[k] if k < len(rows) and rows[k] else []
        content.append(
            {
                "token": text,
                "logprob": lp,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": texts(t), "logprob": v, "bytes": list(texts(t).encode())}
                    for v, t in top
                ],
            }
        )
    return {"content": content}


class TokenizeRequest(_Body):
    """vLLM's /tokenize body: a text `prompt` (add_special_tokens default true: the ids
    /generate and /v1/completions would run) or chat `messages` (through the chat template,
    as /v1/chat/completions renders them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[StrictInt]


@token_router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    req: TokenizeRequest = parse_body(TokenizeRequest, await http_common.read_json(request))
    check_model(request, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("prompt", "give exactly one of prompt and messages")
    tm = http_common.tokenizer_manager(request)
    if req.messages is not None:
        if req.add_special_tokens:
            raise RequestError("add_special_tokens", "the chat template places the special "
                               "tokens: only false with messages")
        check_messages(req.messages, tm.limits.max_prompt_chars)
    else:
        check_prompt_size("prompt", len(req.prompt), tm.limits.max_prompt_chars)
    if req.messages is not None:
        ids = await asyncio.to_thread(chat_prompt_ids, tm.tokenizer, req.messages,
                                      req.add_generation_prompt)
    elif req.add_special_tokens is False:
        ids = await asyncio.to_thread(tm.tokenizer.encode, req.prompt, add_special_tokens=False)
    else:
        ids = await asyncio.to_thread(encode_prompt, tm.tokenizer, req.prompt)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": tm.context_length, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = tm.tokenizer.convert_ids_to_tokens(ids)
    return JSONResponse(out)


@token_router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    req: DetokenizeRequest = parse_body(DetokenizeRequest, await http_common.read_json(request))
    check_model(request, req.model)
    tm = http_common.tokenizer_manager(request)
    vocab = tm.limits.vocab_size
    if len(req.tokens) > tm.context_length:
        raise RequestError("tokens", f"{len(req.tokens)} ids, over the context length "
                           f"{tm.context_length}")
    for t in req.tokens:
        if not 0 <= t < (vocab if vocab is not None else 2**31):
            raise RequestError("tokens", f"token id {t} is outside the vocabulary [0, {vocab})")
    text = await asyncio.to_thread(tm.tokenizer.decode, req.tokens)
    return JSONResponse({"prompt": text})


# ---------------------------------------------------------------------- endpoints
def _model_card(request: Request) -> dict[str, Any]:
    state = request.app.state
    tm = state.tokenizer_manager
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(state.start_time),
        "owned_by": "plait",
        "root": tm.model_info["model_path"],
        "max_model_len": tm.context_length,
    }


@router.get("/models")
async def list_models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_card(request)]})


@router.get("/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> Response:
    """OpenAI's models.retrieve (SGLang serves it too); a served name's card is the one model's."""
    check_model(request, model)
    return JSONResponse(_model_card(request))


@router.post("/completions")
async def completions(request: Request) -> Response:
    req: CompletionRequest = parse_body(CompletionRequest, await http_common.read_json(request))
    check_model(request, req.model)
    if req.best_of not in (None, 1):
        raise RequestError("best_of", "only 1 is supported")
    if req.suffix:
        raise RequestError("suffix", "not supported by plait")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError("logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
    prompts = _completion_prompts(req.prompt)
    sp = sampling_params(req, req.max_tokens, {})
    # echo + logprobs scores the prompt too (lm-evaluation-harness's loglikelihood)
    echo_logprobs = req.echo and req.logprobs is not None
    inputs = normalize(request, prompts, sp, req, req.logprobs, req.logprobs is not None,
                       logprob_start_len=0 if echo_logprobs else None)
    tm = http_common.tokenizer_manager(request)
    texts = TokenTexts(tm.tokenizer)
    head = response_head(request, "cmpl", "text_completion")
    if req.stream:
        return await stream_response(
            request,
            inputs,
            head,
            _completion_chunks(req, texts, [_prompt_text(tm.tokenizer, p) for p in prompts]
                               if req.echo else None, echo_logprobs),
            usage_n=req.n if _include_usage(req) else None,
            continuous_usage=_continuous_usage(req),
        )
    states = await run(request, inputs)
    choices = []
    for i, s in enumerate(states):
        prefix = _prompt_text(tm.tokenizer, prompts[i // req.n]) if req.echo else ""
        choices.append(
            {
                "index": i,
                "text": prefix + s.text,
                "logprobs": None
                if req.logprobs is None
                else completion_logprobs(s, 0, len(s.output_token_logprobs), texts, 0,
                                         echo_logprobs),
                "finish_reason": finish_reason(s),
            }
        )
    return JSONResponse({**head, "choices": choices, "usage": usage(states, req.n)})


def _completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    if isinstance(prompt, str):
        return [{"text": prompt}]
    if not prompt:
        raise RequestError("prompt", "must not be empty")
    if isinstance(prompt[0], int):
        return [{"input_ids": prompt}]
    if isinstance(prompt[0], str):
        return [{"text": p} for p in prompt]
    return [{"input_ids": p} for p in prompt]


def _prompt_text(tokenizer, prompt: dict[str, Any]) -> str:
    return prompt["text"] if "text" in prompt else tokenizer.decode(prompt["input_ids"])


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    body = await http_common.read_json(request)
    req: ChatCompletionRequest = parse_body(ChatCompletionRequest, body)
    check_model(request, req.model)
    check_openai_extras(req)
    args = request.app.state.args
    tool_plan = tool_calls.plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                                _other_constraint(req), args.tool_call_parser,
                                structural_tags=args.grammar_backend == "xgrammar")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise RequestError("top_logprobs", "requires logprobs to be true")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}]")
    tm = http_common.tokenizer_manager(request)
    check_messages(req.messages, tm.limits.max_prompt_chars)
    # rendering and tokenizing a long conversation takes a while: off the event loop
    ids = await asyncio.to_thread(chat_prompt_ids, tm.tokenizer, req.messages, True, req.tools)
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:  # as much as the context leaves
        max_tokens = max(0, tm.context_length - len(ids))
    fmt = req.response_format
    if tool_plan is not None and tool_plan.schema is not None:
        constraint, constraint_field = {"json_schema": tool_plan.schema}, "tools"
    elif tool_plan is not None and tool_plan.tag is not None:
        # "auto" with a parser: free text, each call held to its tool (xgrammar's structural
        # tags; the outlines backend has none: its calls are read as written)
        constraint, constraint_field = {"structural_tag": json.dumps(tool_plan.tag)}, "tools"
    else:
        constraint = response_format_constraint(fmt)
        constraint_field = "response_format" if fmt is not None and fmt.type != "text" else None
    names = FieldNames(
        prompt="messages",
        max_tokens="max_completion_tokens" if req.max_completion_tokens is not None
        else "max_tokens",
        constraint=constraint_field,
    )
    sp = sampling_params(req, max_tokens, constraint, names)
    inputs = normalize(request, [{"input_ids": ids}], sp, req, req.top_logprobs, req.logprobs,
                       names)
    texts = TokenTexts(tm.tokenizer)
    head = response_head(request, "chatcmpl", "chat.completion")
    if req.stream:
        roles = [_chat_choice(i, {"role": "assistant", "content": ""}) for i in range(len(inputs))]
        return await stream_response(
            request,
            inputs,
            {**head, "object": "chat.completion.chunk"},
            _chat_chunks(req, texts, tool_plan),
            first_chunks=roles,
            usage_n=req.n if _include_usage(req) else None,
            continuous_usage=_continuous_usage(req),
            names=names,
        )
    states = await run(request, inputs, names)
    choices = [
        {
            "index": i,
            "message": (message := _chat_message(s, tool_plan)),
            "logprobs": chat_logprobs(s, 0, len(s.output_token_logprobs), texts)
            if req.logprobs
            else None,
            "finish_reason": _chat_finish_reason(s, tool_plan, "tool_calls" in message),
        }
        for i, s in enumerate(states)
    ]
    return JSONResponse({**head, "choices": choices, "usage": usage(states, req.n)})


def _other_constraint(req: ChatCompletionRequest) -> str | None:
    """The field of an output constraint the request sets besides tools, if any."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return next((f for f in ("regex", "ebnf", "json_schema", "choices")
                 if getattr(req, f) is not None), None)


def _chat_message(state: ReqState, plan: ToolPlan | None) -> dict[str, Any]:
    content, calls = plan.answer(state.text) if plan is not None else (state.text, None)
    if calls is None:
        return {"role": "assistant", "content": content}
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _chat_finish_reason(state: ReqState, plan: ToolPlan | None, has_calls: bool) -> str | None:
    reason = finish_reason(state)
    return reason if plan is None else plan.finish_reason(reason, has_calls)


# ---------------------------------------------------------------------- streaming
@dataclasses.dataclass
class Delta:
    """What one choice produced since its previous chunk."""

    index: int
    state: ReqState
    text: str
    text_offset: int  # where `text` starts in the choice's whole text
    tokens: tuple[int, int]  # [start, end) of its new output tokens (for logprobs)

    @property
    def finish_reason(self) -> str | None:
        return finish_reason(self.state)


async def stream_response(
    request: Request,
    inputs: list[ReqInput],
    head: dict[str, Any],
    render: Callable[[Delta], list[dict]],
    first_chunks: list[dict] | None = None,
    usage_n: int | None = None,
    continuous_usage: bool = False,
    names: FieldNames = FieldNames(),
) -> Response:
    """SSE response of OpenAI chunks: `render` turns each Delta into chunk bodies (without
    the shared `head` fields); with usage_n (= n) a last chunk carries the usage, and with
    continuous_usage every chunk its choice's usage so far (first_chunks: one per choice)."""
    usage_field = {"usage": None} if usage_n is not None else {}

    async def chunks(outputs: AsyncIterator[tuple[int, ReqState]]) -> AsyncIterator[dict]:
        finals: dict[int, ReqState] = {}
        extra = usage_field
        for i, body in enumerate(first_chunks or []):
            if continuous_usage:
                extra = {"usage": _running_usage(len(inputs[i].input_ids or ()), 0)}
            yield {**head, **body, **extra}
        async for delta in _deltas(outputs, len(inputs)):
            if continuous_usage:
                s = delta.state
                extra = {"usage": _running_usage(
                    s.meta.get("prompt_tokens", s.prompt_tokens), len(s.output_ids))}
            for body in render(delta):
                yield {**head, **body, **extra}
            if delta.state.finished_reason is not None:
                finals[delta.index] = delta.state
        if usage_n is not None:
            states = [finals[i] for i in sorted(finals)]
            yield {**head, "choices": [], "usage": usage(states, usage_n)}

    return await http_common.sse_response(
        request, inputs, chunks, lambda e: openai_error(e, names)
    )


async def _deltas(
    outputs: AsyncIterator[tuple[int, ReqState]], num_choices: int
) -> AsyncIterator[Delta]:
    sent_text, sent_tokens = [0] * num_choices, [0] * num_choices
    async for i, state in outputs:
        end = len(state.output_token_logprobs)
        yield Delta(i, state, state.text[sent_text[i] :], sent_text[i], (sent_tokens[i], end))
        sent_text[i], sent_tokens[i] = len(state.text), end


def _completion_chunks(req: CompletionRequest, texts: TokenTexts,
                       echoes: list[str] | None = None,
                       echo_logprobs: bool = False) -> Callable[[Delta], list[dict]]:
    """Text deltas; with `echo` (echoes: each prompt's text), a choice's first chunk starts with
    its prompt, as vLLM streams it, and with logprobs its prompt tokens' logprobs first (the
    later chunks' text offsets count the prompt's tokens, as the whole answer's do)."""
    echoed: dict[int, int] = {}  # choice -> width of its prompt's tokens (text_offset's shift)

    def render(d: Delta) -> list[dict]:
        if not (d.text or d.finish_reason or d.tokens[1] > d.tokens[0]):
            return []
        first = echoes is not None and d.index not in echoed
        logprobs = None
        if req.logprobs is not None:
            logprobs = completion_logprobs(d.state, *d.tokens, texts,
                                           d.text_offset + echoed.get(d.index, 0),
                                           echo_logprobs and first)
        text = d.text
        if first:
            echoed[d.index] = sum(len(texts(tok)) for _, tok in
                                  d.state.input_token_logprobs or []) if echo_logprobs else 0
            text = echoes[d.index // req.n] + text
        choice = {
            "index": d.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": d.finish_reason,
        }
        return [{"choices": [choice]}]

    return render


def _chat_chunks(req: ChatCompletionRequest, texts: TokenTexts,
                 plan: ToolPlan | None) -> Callable[[Delta], list[dict]]:
    """Content deltas; with a tool plan, tool_calls deltas: each call's id, type and name
    first, then its arguments as they grow (a list of calls: tool_calls.CallStreamer); a
    parser's answer: tool_calls.ParsedCallStreamer."""
    streamers: dict[int, Any] = {}
    call_ids: dict[int, str] = {}

    def render(d: Delta) -> list[dict]:
        chunks = []
        finished = d.finish_reason is not None
        has_calls = True
        if plan is not None and plan.parser is not None:
            streamer = streamers.setdefault(d.index, tool_calls.ParsedCallStreamer(plan))
            pieces = streamer.deltas(d.state.text, finished)
            logprobs = (chat_logprobs(d.state, *d.tokens, texts)
                        if req.logprobs and d.tokens[1] > d.tokens[0] else None)
            for j, delta in enumerate(pieces or ([{}] if logprobs else [])):
                chunks.append(_chat_choice(d.index, delta, logprobs=logprobs if j == 0 else None))
            has_calls = streamer.has_calls
        elif d.text or d.tokens[1] > d.tokens[0]:
            logprobs = chat_logprobs(d.state, *d.tokens, texts) if req.logprobs else None
            if plan is None:
                delta: dict[str, Any] = {"content": d.text}
            elif plan.named is None:
                streamer = streamers.setdefault(d.index, tool_calls.CallStreamer())
                pieces = streamer.deltas(d.state.text)
                delta = {"tool_calls": pieces} if pieces else {}
            elif d.index not in call_ids:
                call = plan.calls(d.text)[0]
                call_ids[d.index] = call["id"]
                delta = {"tool_calls": [{"index": 0, **call}]}
            else:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": d.text}}]}
            if delta or logprobs:  # a list's new text may not finish a name or add arguments
                chunks.append(_chat_choice(d.index, delta, logprobs=logprobs))
        if finished:
            if plan is not None and plan.parser is None and plan.named is None:
                streamer = streamers.get(d.index)
                has_calls = streamer is not None and bool(streamer.ids)
                if not has_calls:  # a list cut before its first call's name: its text
                    chunks.append(_chat_choice(d.index, {"content": d.state.text}))
            chunks.append(_chat_choice(d.index, {}, _chat_finish_reason(d.state, plan, has_calls)))
        return chunks

    return render


def _chat_choice(index: int, delta: dict, reason: str | None = None, logprobs: Any = None) -> dict:
    return {
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]
    }


def _include_usage(req: _Sampling) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def _continuous_usage(req: _Sampling) -> bool:
    return _include_usage(req) and req.stream_options.continuous_usage_stats


def _running_usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}
