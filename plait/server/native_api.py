"""SGLang-native HTTP API: /generate, /abort_request, /flush_cache, /get_model_info,
/get_server_info (and SGLang's newer /model_info, /server_info names).

A /generate body becomes a GenerateInput (plait/io_struct.py) and is normalized there; the
shared plumbing (body, admission, SSE, disconnects) is in http_common. Errors are raised as
RequestError; http_server turns them into OpenAI-style error bodies.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plait.errors import RequestError
from plait.io_struct import (
    DEFAULT_LIMITS,
    GenerateInput,
    InputLimits,
    NormalizedInput,
    ReqInput,
    ReqState,
    format_output,
)
from plait.sampling import SamplingParams
from plait.server import http_common
from plait.server.http_common import TokenTexts

router = APIRouter()


def parse_generate(body: Any, limits: InputLimits = DEFAULT_LIMITS) -> NormalizedInput:
    """A /generate body -> the normalized requests (one per output: prompts x n)."""
    return GenerateInput.from_dict(body).normalize(limits)


def generate_output(state: ReqState, inp: ReqInput, texts: TokenTexts | None) -> dict:
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
    tm = http_common.tokenizer_manager(request)
    inp = GenerateInput.from_dict(await http_common.read_json(request))
    req = http_common.normalize(request, inp)
    texts = TokenTexts(tm.tokenizer) if req.return_text_in_logprobs else None
    if not req.stream:
        try:
            states = await http_common.run_to_end(request, req.reqs)
        except RequestError as e:
            raise native_error(e) from None
        outs = [generate_output(s, r, texts) for s, r in zip(states, req.reqs)]
        return JSONResponse(outs if req.batched else outs[0])

    async def render(outputs: AsyncIterator[tuple[int, ReqState]]) -> AsyncIterator[dict]:
        async for k, st in outputs:
            out = generate_output(st, req.reqs[k], texts)
            if req.batched:
                out["index"] = k
            yield out

    return await http_common.sse_response(request, req.reqs, render, native_error)


_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def native_error(e: RequestError) -> RequestError:
    """The scheduler names a refused constraint by its SamplingParams field (`regex`); in a
    /generate body that field is `sampling_params.regex`."""
    if e.field and e.field.split(".")[0] in _SAMPLING_FIELDS:
        return e.renamed(f"sampling_params.{e.field}")
    return e


# ---------------------------------------------------------------------- control endpoints
@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    tm = http_common.tokenizer_manager(request)
    body = await http_common.read_json(request)
    unknown = sorted(set(body) - {"rid", "abort_all"})
    if unknown:
        raise RequestError(unknown[0], "unknown field (known: rid, abort_all)")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise RequestError("abort_all", f"must be a boolean, got {type(abort_all).__name__}")
    if not abort_all and not isinstance(rid, str):
        raise RequestError("rid", "the id (a string) of the request to abort is required")
    # exact match: the request's own rid, or the rid a client gave an n > 1 request
    rids = [
        r
        for r, st in list(tm.states.items())
        if abort_all or r == rid or (st.group is not None and st.group == rid)
    ]
    for r in rids:
        tm.abort(r)
    return JSONResponse({"success": True, "aborted": rids})


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    out = await http_common.tokenizer_manager(request).flush_cache()
    if not out.success:
        raise RequestError(None, f"cache not flushed: {out.message}", 400)
    return JSONResponse({"success": True, "message": "cache flushed"})


def model_info(request: Request) -> dict[str, Any]:
    tm = http_common.tokenizer_manager(request)
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
    tm = http_common.tokenizer_manager(request)
    stats = await tm.get_stats(timeout=10.0)
    args = dataclasses.asdict(request.app.state.args)
    if args.get("api_key"):
        args["api_key"] = "<redacted>"
    children = request.app.state.children
    return JSONResponse(
        {
            **args,
            **model_info(request),
            **stats,
            "internal_states": [stats],
            "pid": os.getpid(),
            "child_pids": {
                name: p.pid for name, p in (children.procs if children else tm.procs).items()
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
