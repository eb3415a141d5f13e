"""SGLang-native HTTP API: /generate, /abort_request, /flush_cache, /get_model_info,
/get_server_info (and SGLang's newer /model_info, /server_info names).

Also the request plumbing the OpenAI layer reuses: admission control (429), running a
request's prompts concurrently with abort-on-disconnect, SSE framing, token texts for logprobs.
Errors are raised as RequestError; http_server turns them into OpenAI-style error bodies.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from plait.frontend.engine import expand_n, format_output
from plait.frontend.tokenizer_manager import GenerateInput, ReqState, RequestError, TokenizerManager
from plait.sampling import SamplingParams

router = APIRouter()
T = TypeVar("T")

# Top-level /generate fields of SGLang that plait does not serve: accepted when empty
# (SGLang's own clients send several of them as null), a 400 naming them otherwise.
UNSUPPORTED_GENERATE_FIELDS = (
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "session_id",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "log_metrics",
    "modalities",
)
GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "stream",
)
# SGLang sampling fields that plait ignores (detokenizer details) or renames.
IGNORED_SAMPLING_FIELDS = ("spaces_between_special_tokens", "stream_interval")
UNSUPPORTED_SAMPLING_FIELDS = (
    "stop_regex",
    "logit_bias",
    "custom_params",
    "structural_tag",
    "beam_width",
    "watermark",
)


# ---------------------------------------------------------------------- request plumbing
def tokenizer_manager(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; malformed JSON is a 400, not a 500."""
    body = await request.body()
    try:
        data = json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"body: invalid JSON ({e})", 400, "body") from None
    if not isinstance(data, dict):
        raise RequestError("body: must be a JSON object", 400, "body")
    return data


def admit(tm: TokenizerManager, num_requests: int) -> None:
    """503 once a child died; 429 when the new requests would overflow the waiting queue.

    Requests beyond the running capacity wait in the scheduler's queue, so the frontend's
    count of unfinished requests minus max_running_requests bounds the queue length from below.
    """
    tm.check_alive()
    args = tm.args
    waiting = len(tm.states) + num_requests - args.max_running_requests
    if waiting > args.max_queued_requests:
        raise RequestError(
            f"server overloaded: {max(0, waiting - num_requests)} requests are waiting "
            f"(--max-queued-requests {args.max_queued_requests}); retry later",
            429,
        )


class ClientGone(Exception):
    """The HTTP client disconnected before its response was ready."""


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def run_streams(
    tm: TokenizerManager, inputs: list[GenerateInput]
) -> AsyncIterator[tuple[int, ReqState]]:
    """Runs the inputs concurrently; yields (input index, state) as output arrives, each
    request's last state (finished_reason set) exactly once. The first error is raised and
    every other request aborted; closing the iterator early aborts the unfinished ones."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, inp: GenerateInput) -> None:
        try:
            async for state in tm.generate(inp):
                queue.put_nowait((i, state, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, inp)) for i, inp in enumerate(inputs)]
    finished: set[int] = set()
    try:
        while len(finished) < len(inputs):
            i, state, error = await queue.get()
            if error is not None:
                raise error
            if i in finished:  # the state moved on before this item was read
                continue
            if state.finished_reason is not None:
                finished.add(i)
            yield i, state
    finally:
        for t in tasks:
            t.cancel()  # generate()'s finally sends AbortReq for unfinished requests
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_all(tm: TokenizerManager, inputs: list[GenerateInput]) -> list[ReqState]:
    """Every input's final state, in input order."""
    states: list[ReqState | None] = [None] * len(inputs)
    async for i, state in run_streams(tm, inputs):
        if state.finished_reason is not None:
            states[i] = state
    return states  # type: ignore[return-value]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def error_body(e: RequestError) -> dict[str, Any]:
    """OpenAI's error object (also used by the native endpoints)."""
    code = (
        "model_not_found" if e.status == 404 and e.param == "model" else ERROR_CODES.get(e.status)
    )
    return {
        "error": {
            "message": str(e),
            "type": ERROR_TYPES.get(e.status, "server_error"),
            "param": e.param,
            "code": code,
        }
    }


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable_error",
}
ERROR_CODES = {401: "invalid_api_key", 429: "rate_limit_exceeded", 503: "service_unavailable"}


def stream_error(e: Exception) -> bytes:
    """An error after the stream's 200 header went out: one SSE event with the error body."""
    if not isinstance(e, RequestError):
        e = RequestError(f"internal error: {type(e).__name__}: {e}", 500)
    return sse(error_body(e))


async def first_then_rest(request: Request, stream: AsyncIterator[T]) -> tuple[T, AsyncIterator[T]]:
    """Wait for a stream's first item before committing to a 200: request errors found up
    to the first output (validation, bad constraint, overload, dead child) get their own
    HTTP status instead of an in-stream error event."""
    try:
        first = await until_disconnect(request, stream.__anext__())
    except BaseException:
        await stream.aclose()
        raise
    return first, stream


class TokenTexts:
    """Token id -> its text (for logprobs), decoded one token at a time and memoized."""

    def __init__(self, tokenizer, max_size: int = 1 << 17) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._max = max_size

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            if len(self._cache) < self._max:
                self._cache[token_id] = text
        return text


# ---------------------------------------------------------------------- /generate
@dataclasses.dataclass
class GenerateRequest:
    """A parsed /generate body: one GenerateInput per output (prompts x n)."""

    inputs: list[GenerateInput]
    batched: bool
    stream: bool
    return_text_in_logprobs: bool


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    _check_fields(body)
    prompts, batched = _prompts(body)
    stream = _flag(body, "stream")
    per_prompt = {
        name: _per_prompt(body, name, len(prompts), batched)
        for name in (
            "sampling_params",
            "rid",
            "return_logprob",
            "logprob_start_len",
            "top_logprobs_num",
        )
    }
    inputs = []
    for i, (key, prompt) in enumerate(prompts):
        rid, return_logprob, start, top_n = (
            per_prompt[name][i]
            for name in ("rid", "return_logprob", "logprob_start_len", "top_logprobs_num")
        )
        _check_types(rid, return_logprob, start, top_n)
        subs = expand_n(_sampling(per_prompt["sampling_params"][i]))
        for j, sub in enumerate(subs):
            inputs.append(
                GenerateInput(
                    **{key: prompt},
                    sampling_params=sub,
                    return_logprob=bool(return_logprob),
                    logprob_start_len=None if start is None or start < 0 else start,
                    top_logprobs_num=top_n or 0,
                    stream=stream,
                    rid=rid if rid is None or len(subs) == 1 else f"{rid}_{j}",
                )
            )
    return GenerateRequest(
        inputs,
        batched or len(inputs) > len(prompts),
        stream,
        _flag(body, "return_text_in_logprobs"),
    )


def _check_fields(body: dict[str, Any]) -> None:
    unknown = sorted(set(body) - set(GENERATE_FIELDS) - set(UNSUPPORTED_GENERATE_FIELDS))
    if unknown:
        raise RequestError(
            f"{unknown[0]}: unknown field (known: {', '.join(GENERATE_FIELDS)})", 400, unknown[0]
        )
    for name in UNSUPPORTED_GENERATE_FIELDS:
        if body.get(name):
            raise RequestError(f"{name}: not supported by plait", 400, name)


def _prompts(body: dict[str, Any]) -> tuple[list[tuple[str, Any]], bool]:
    """[("text" | "input_ids", prompt)], and whether the body is a batch."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise RequestError("text: give exactly one of text or input_ids", 400, "text")
    if text is not None:
        batched = isinstance(text, list)
        prompts = [("text", p) for p in (text if batched else [text])]
    else:
        if not isinstance(input_ids, list) or not input_ids:
            raise RequestError("input_ids: must be a non-empty list of token ids", 400, "input_ids")
        batched = isinstance(input_ids[0], list)
        prompts = [("input_ids", p) for p in (input_ids if batched else [input_ids])]
    if not prompts:
        raise RequestError("text: the batch is empty", 400, "text")
    return prompts, batched


def _check_types(rid: Any, return_logprob: Any, start: Any, top_n: Any) -> None:
    if rid is not None and not isinstance(rid, str):
        raise RequestError("rid: must be a string", 400, "rid")
    if return_logprob is not None and not isinstance(return_logprob, bool):
        raise RequestError("return_logprob: must be a boolean", 400, "return_logprob")
    for name, value in (("logprob_start_len", start), ("top_logprobs_num", top_n)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{name}: must be an integer", 400, name)
    if top_n is not None and not 0 <= top_n <= 1000:
        raise RequestError("top_logprobs_num: must be in [0, 1000]", 400, "top_logprobs_num")


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"{name}: must be a boolean", 400, name)
    return bool(value)


def _per_prompt(body: dict[str, Any], name: str, n: int, batched: bool) -> list[Any]:
    """A field given once for all prompts, or (batch only) as a list with one entry each."""
    value = body.get(name)
    if (
        batched
        and isinstance(value, list)
        and (name != "sampling_params" or value == [] or isinstance(value[0], dict))
    ):
        if len(value) != n:
            raise RequestError(f"{name}: a list must have one entry per prompt ({n})", 400, name)
        return value
    return [value] * n


def _sampling(params: Any) -> SamplingParams:
    """SGLang's sampling_params dict -> SamplingParams (null means 'default', as in SGLang)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params: must be an object", 400, "sampling_params")
    d = {k: v for k, v in params.items() if v is not None and k not in IGNORED_SAMPLING_FIELDS}
    if "sampling_seed" in d:  # SGLang's newer name
        d.setdefault("seed", d.pop("sampling_seed"))
    for name in UNSUPPORTED_SAMPLING_FIELDS:
        if d.pop(name, None) not in (None, [], {}, ()):
            raise RequestError(
                f"sampling_params.{name}: not supported by plait", 400, f"sampling_params.{name}"
            )
    for name in ("stop", "stop_token_ids"):
        if isinstance(d.get(name), tuple):
            d[name] = list(d[name])
    try:
        return SamplingParams.from_dict(d)
    except (TypeError, ValueError) as e:
        message = str(e)
        if not message.startswith("sampling_params."):
            message = "sampling_params." + message
        raise RequestError(message, 400, message.split(":")[0]) from None


def generate_output(state: ReqState, inp: GenerateInput, texts: TokenTexts | None) -> dict:
    """SGLang's output object; logprob entries are [logprob, token_id, text or None]."""
    out = format_output(state, inp.return_logprob)
    meta = out["meta_info"]
    meta["e2e_latency"] = time.monotonic() - state.created
    if state.finished_reason and state.finished_reason.get("type") == "length":
        meta["finish_reason"] = {**state.finished_reason, "length": meta["completion_tokens"]}
    if inp.return_logprob:
        if texts is not None:
            for key in ("input_token_logprobs", "output_token_logprobs"):
                meta[key] = [[lp, tok, texts(tok)] for lp, tok, _ in meta[key]]
            for key in ("input_top_logprobs", "output_top_logprobs"):
                meta[key] = [
                    None if row is None else [[lp, tok, texts(tok)] for lp, tok, _ in row]
                    for row in meta[key]
                ]
        values = [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None]
        meta["normalized_prompt_logprob"] = sum(values) / len(values) if values else None
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
    return out


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    tm = tokenizer_manager(request)
    req = parse_generate(await read_json(request))
    admit(tm, len(req.inputs))
    texts = TokenTexts(tm.tokenizer) if req.return_text_in_logprobs else None
    if not req.stream:
        states = await until_disconnect(request, run_all(tm, req.inputs))
        outs = [generate_output(s, inp, texts) for s, inp in zip(states, req.inputs)]
        return JSONResponse(outs if req.batched else outs[0])
    (i, state), rest = await first_then_rest(request, run_streams(tm, req.inputs))
    metrics = request.app.state.metrics

    async def events() -> AsyncIterator[bytes]:
        item: tuple[int, ReqState] | None = (i, state)
        try:
            while item is not None:
                k, st = item
                out = generate_output(st, req.inputs[k], texts)
                if req.batched:
                    out["index"] = k
                if st.finished_reason is not None:
                    metrics.observe_stream(st)
                yield sse(out)
                item = await rest.__anext__()
        except StopAsyncIteration:
            pass
        except Exception as e:
            yield stream_error(e)
        finally:
            await rest.aclose()
        yield SSE_DONE

    return StreamingResponse(events(), media_type="text/event-stream")


# ---------------------------------------------------------------------- control endpoints
@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    tm = tokenizer_manager(request)
    body = await read_json(request)
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not abort_all and not isinstance(rid, str):
        raise RequestError("rid: the id of the request to abort is required", 400, "rid")
    # n > 1 requests run as rid_0, rid_1, ...
    rids = [r for r in list(tm.states) if abort_all or r == rid or r.startswith(f"{rid}_")]
    for r in rids:
        tm.abort(r)
    return JSONResponse({"success": True, "aborted": rids})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    out = await tokenizer_manager(request).flush_cache()
    if not out.success:
        raise RequestError(f"cache not flushed: {out.message}", 400)
    return JSONResponse({"success": True, "message": "cache flushed"})


def model_info(request: Request) -> dict[str, Any]:
    tm = tokenizer_manager(request)
    info = tm.model_info
    args = request.app.state.args
    return {
        "model_path": info["model_path"],
        "served_model_name": request.app.state.model_name,
        "tokenizer_path": args.tokenizer_path or info["model_path"],
        "is_generation": True,
        "architectures": [info.get("architecture")],
        "context_length": tm.context_length,
        "vocab_size": info.get("vocab_size"),
        "max_total_tokens": info.get("max_total_tokens"),
        "eos_token_ids": info.get("eos_token_ids"),
        "dtype": info.get("dtype"),
        "device": info.get("device"),
        "preferred_sampling_params": None,
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    return JSONResponse(model_info(request))


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> Response:
    tm = tokenizer_manager(request)
    stats = await tm.get_stats(timeout=10.0)
    args = dataclasses.asdict(request.app.state.args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    runtime = request.app.state.runtime
    return JSONResponse(
        {
            **args,
            **model_info(request),
            **stats,
            "internal_states": [stats],
            "pid": os.getpid(),
            "child_pids": {
                name: p.pid for name, p in (runtime.procs if runtime else tm.procs).items()
            },
            "num_frontend_requests": len(tm.states),
            "version": _version(),
            "grammar_backends": _grammar_features(),
        }
    )


def _grammar_features() -> dict:
    from plait.grammar.manager import grammar_backend_features

    return grammar_backend_features()


def _version() -> str:
    import plait

    return plait.__version__
