"""What SGLang's router (`sglang-router`, `python -m sglang_router.launch_router`) needs from a
worker beyond plait's own API, so an unmodified router fronts N `plait serve` replicas.

Observed with sglang-router 0.3.2 in front of plait (a logging proxy between them):

- Registration: GET /health, /server_info, /model_info (already served; the router reads
  `model_path` to load the tokenizer and `served_model_name` as the model id).
- Health: GET /health every --health-check-interval-secs (default 60).
- Load: GET /get_load (its /get_loads endpoint and the power_of_two policy read it). Served
  here in SGLang's shape, one entry per data-parallel rank.
- /flush_cache: POST, fanned out to every worker.
- Requests: the router parses each body into its own typed request and re-serializes it,
  so every forwarded body carries the router's defaults for fields plait does not know.
  `ROUTER_FIELDS` lists them per path with the values that ask plait for nothing; those are
  dropped before plait's own (strict) parsing, any other value is a 400 naming the field.
  A field outside the table stays an unknown field (400), as for any client.

The stripping is a pure-ASGI wrapper (`RouterFields`) rather than edits to each endpoint's
parser: the same table serves /generate and both OpenAI endpoints, the endpoints stay strict
for everything else, and streaming and disconnect detection pass through untouched.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from plait.errors import RequestError
from plait.tokenizer.tokenizer_manager import TokenizerManager

router = APIRouter()

ANY_BOOL = (True, False)
# path -> {field: the values that are accepted and dropped}. Why each is inert for plait:
ROUTER_FIELDS: dict[str, dict[str, tuple]] = {
    "/generate": {
        # SGLang's per-request metrics logging switch: plait's /metrics counts every request
        "log_metrics": ANY_BOOL,
        # SGLang's switch to keep request text out of its logs: plait never logs request text
        "no_logs": ANY_BOOL,
        # features plait does not have, sent as false by the router
        "return_hidden_states": (False,),
        "background": (False,),
        "return_bytes": (False,),
        "return_entropy": (False,),
    },
    "/v1/completions": {
        "return_hidden_states": (False,),
    },
    "/v1/chat/completions": {
        "return_hidden_states": (False,),
        "continue_final_message": (False,),
        # reasoning-parser switches: plait has no reasoning parser, so either value means the
        # same thing (the whole output is the message content)
        "separate_reasoning": ANY_BOOL,
        "stream_reasoning": ANY_BOOL,
    },
}
# The router names the model "unknown" on chat requests whose client gave none (`model` is
# optional for plait): treated as absent unless a replica really serves a model by that name.
ROUTER_UNKNOWN_MODEL = "unknown"


def strip_router_fields(path: str, body: dict[str, Any], model_names: list[str]) -> dict[str, Any]:
    """`body` without the router's inert fields for `path`; RequestError (400, naming the
    field) when one of them asks for something plait does not do."""
    fields = ROUTER_FIELDS.get(path, {})
    out = {}
    for name, value in body.items():
        if name == "model":
            if _drop_model(path, value, model_names):
                continue
        elif name in fields:
            if not any(value is v for v in fields[name]):
                allowed = " or ".join(json.dumps(v) for v in fields[name])
                raise RequestError(
                    name, f"plait accepts only {allowed} here, got {json.dumps(value)}"
                )
            continue
        out[name] = value
    return out


def _drop_model(path: str, model: Any, model_names: list[str]) -> bool:
    """Whether the router's `model` field carries nothing for plait. On /generate (which has
    no model field of its own) the router always sends it, null unless the client named one;
    a name plait does not serve is a 404 there, as on the OpenAI endpoints."""
    if path == "/generate":
        if model is None or model in model_names:
            return True
        raise RequestError(
            "model", f"the model '{model}' does not exist (served: {model_names[0]})", 404
        )
    return model == ROUTER_UNKNOWN_MODEL and model not in model_names


class RouterFields:
    """Pure-ASGI wrapper: drops the router's inert fields from POST bodies of the paths in
    ROUTER_FIELDS before the endpoint reads them. Bodies that are not a JSON object pass
    through unchanged (the endpoint reports them)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in ("POST", "PUT")
            or scope["path"] not in ROUTER_FIELDS
        ):
            return await self.app(scope, receive, send)
        limit = scope["app"].state.args.max_request_bytes
        messages, size, more = [], 0, True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # disconnected while sending the body
                return await self.app(scope, _replay(messages, receive), send)
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > limit:  # not buffered further: the endpoint answers 413
                return await self.app(scope, _replay(messages, receive), send)
        body = b"".join(m.get("body", b"") for m in messages)
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):  # the endpoint's own parser names the problem
            data = None
        if isinstance(data, dict):
            try:
                names = scope["app"].state.model_names
                stripped = strip_router_fields(scope["path"], data, names)
            except RequestError as e:
                return await _send_json(send, _error_body(e), e.status)
            if len(stripped) != len(data):
                body = json.dumps(stripped).encode()
        message = {"type": "http.request", "body": body, "more_body": False}
        return await self.app(scope, _replay([message], receive), send)


def _replay(messages: list[dict], receive):
    """A receive() that returns `messages` first, then the real receive() (which reports the
    client's disconnect to the endpoint's watcher)."""
    pending = list(messages)

    async def replayed():
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


def _error_body(e: RequestError) -> dict[str, Any]:
    from plait.server.http_common import error_body

    return error_body(e)


async def _send_json(send, obj: Any, status: int) -> None:
    response = JSONResponse(obj, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


# ---------------------------------------------------------------------- load reporting
@router.get("/get_load")
async def get_load(request: Request) -> Response:
    """SGLang's load report: one entry per data-parallel rank (plait: one scheduler, rank 0).
    num_tokens is the KV slots held by requests (not reusable cache), which the router's
    load-aware policies compare across workers."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    stats = await tm.get_stats(timeout=10.0)
    return JSONResponse(
        [
            {
                "dp_rank": 0,
                "num_reqs": stats["num_running"] + stats["num_waiting"],
                "num_waiting_reqs": stats["num_waiting"],
                "num_tokens": stats["kv_used"],
            }
        ]
    )
