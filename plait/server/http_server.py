"""The HTTP server: a FastAPI app built by `create_app` and served by uvicorn.

    plait serve --model PATH --port 30000        # == launch_server(ServerArgs(...))

The app's state (TokenizerManager, args, metrics, child processes) lives on `app.state`.
A pure-ASGI gate in front of every route checks the API key (--api-key, --api-key-file)
and the declared body size (413), answers 503 until the TokenizerManager runs, and counts
responses by status. Every error, native or OpenAI, has
OpenAI's body {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal
import socket
import time
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.io_struct import GenerateInput
from plait.server import native_api, openai_api, router_compat
from plait.server.http_common import (
    SCOPE_KEY,
    Admission,
    ClientGone,
    error_body,
    load_keys,
    until_disconnect,
)
from plait.server.metrics import CONTENT_TYPE, Metrics
from plait.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 3.0  # /health: how long the scheduler may take to answer a stats probe
HEALTH_GENERATE_TIMEOUT_S = 30.0
# idle keep-alive connections stay open this long: well past the clients' own expiry (httpx's
# default is 5 s, uvicorn's too), so a client never reuses a connection the server is closing
# at that very moment (an httpx ReadError on a request the server never saw)
KEEP_ALIVE_S = 75.0
OPEN_PATHS = ("/health",)  # served without the API key


def create_app(
    tokenizer_manager: TokenizerManager, args: ServerArgs, children: Any = None
) -> FastAPI:
    """The server's app. `children` (launch.ChildProcesses) are shut down with the app when given;
    the TokenizerManager is started and closed by the app's lifespan."""
    app = FastAPI(
        title="plait",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    state = app.state
    state.tokenizer_manager = tokenizer_manager
    state.args = args
    state.children = children
    state.ready = False
    state.start_time = time.time()
    state.model_name = args.model_name
    # the served name first; the path the model was loaded from is accepted too
    state.model_names = list(
        dict.fromkeys(
            [args.model_name, tokenizer_manager.model_info.get("model_path")]
            + ([args.model_path] if args.model_path else [])
        )
    )
    state.metrics = Metrics(args.model_name)
    state.admission = Admission(
        args.max_running_requests, args.max_queued_requests, args.queue_reserve_fraction
    )
    keys = load_keys(args.api_key, args.api_key_file)
    state.key_policies = {p.name: p for p in keys.values()}

    routers = [
        native_api.router, openai_api.router, openai_api.token_router, router_compat.router,
    ]
    for router in routers:
        app.include_router(router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/health_generate", health_generate, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    _add_error_handlers(app)
    # metric labels: known paths, everything else "other" (no unbounded label values)
    routes = {r.path for router in routers for r in router.routes}
    routes |= {"/health", "/health_generate", "/metrics"}
    # sglang-router's extra request fields (router_compat); inside the Gate, so after auth
    app.add_middleware(router_compat.RouterFields)
    app.add_middleware(Gate, keys=keys, routes=routes, max_body=args.max_request_bytes)
    from plait.server.openapi import install_openapi

    install_openapi(app)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    state = app.state
    tm: TokenizerManager = state.tokenizer_manager
    await tm.start()
    tm.listeners.append(state.metrics.on_finish)
    tm.listeners.append(lambda st: _charge_tokens(state, st))
    state.ready = True
    try:
        yield
    finally:
        state.ready = False
        await tm.close()
        if state.children is not None:
            await asyncio.to_thread(state.children.shutdown)


def _charge_tokens(state, st) -> None:
    """A finished request's tokens go to its API key's tokens-per-minute bucket."""
    policy = state.key_policies.get(st.key) if st.key else None
    if policy is not None:
        meta = st.meta
        policy.charge_tokens(
            meta.get("prompt_tokens", st.prompt_tokens)
            + meta.get("completion_tokens", len(st.output_ids))
        )


# ---------------------------------------------------------------------- gate (pure ASGI)
class Gate:
    """API key, body size, readiness and per-status counting for every request. Pure ASGI
    rather than BaseHTTPMiddleware, which would buffer streams and hide client disconnects."""

    def __init__(self, app, keys: dict, routes: set[str], max_body: int) -> None:
        self.app = app
        self.keys = keys  # key bytes -> KeyPolicy; empty: no authentication
        self.routes = routes
        self.max_body = max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        state = scope["app"].state
        label = path if path in self.routes else "other"
        status = 500

        async def send_counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            policy = self._policy(scope) if self.keys and path not in OPEN_PATHS else None
            if self.keys and path not in OPEN_PATHS and policy is None:
                await _send_error(
                    send_counted,
                    RequestError(
                        None, "invalid or missing API key: send 'Authorization: Bearer <key>'", 401
                    ),
                )
            elif self._declared_size(scope) > self.max_body:
                await _send_error(
                    send_counted,
                    RequestError(
                        "body", f"larger than {self.max_body} bytes (--max-request-bytes)", 413
                    ),
                )
            elif not state.ready:
                await _send_error(send_counted, RequestError(None, "server is not ready", 503))
            else:
                if policy is not None:
                    scope[SCOPE_KEY] = policy
                await self.app(scope, receive, send_counted)
        finally:
            state.metrics.observe_http(scope["method"], label, status)

    def _policy(self, scope):
        """The caller's KeyPolicy, or None. Every key is compared in constant time."""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() != b"bearer":
                    return None
                token = token.strip()
                found = None
                for key, policy in self.keys.items():
                    if hmac.compare_digest(token, key):
                        found = policy
                return found
        return None

    @staticmethod
    def _declared_size(scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0


async def _send_error(send, e: RequestError) -> None:
    response = error_response(e)
    await send(
        {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": response.raw_headers,
        }
    )
    await send({"type": "http.response.body", "body": response.body})


def error_response(e: RequestError) -> JSONResponse:
    headers = dict(e.headers)
    if e.status == 429:
        headers.setdefault("Retry-After", "1")
    elif e.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def request_error(request: Request, e: RequestError) -> Response:
        if e.status >= 500:
            logger.warning("%s %s: %s", request.method, request.url.path, e)
        return error_response(e)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, e: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the requests were aborted

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError) -> Response:
        err = e.errors()[0] if e.errors() else {"loc": ["body"], "msg": "invalid request"}
        param = ".".join(str(p) for p in err["loc"][1:]) or "body"
        return error_response(RequestError(param, err["msg"]))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> Response:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return error_response(RequestError(None, message, e.status_code))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> Response:
        logger.exception("%s %s failed", request.method, request.url.path)
        return error_response(RequestError(None, f"internal error: {type(e).__name__}: {e}", 500))


# ---------------------------------------------------------------------- health and metrics
async def health(request: Request) -> Response:
    """200 only when the scheduler answers a stats probe promptly."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    tm.check_alive()
    try:
        await tm.get_stats(timeout=HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RequestError(
            None, f"unhealthy: the scheduler did not answer within {HEALTH_TIMEOUT_S} s", 503
        ) from None
    return JSONResponse({"status": "ok"})


async def health_generate(request: Request) -> Response:
    """200 when a one-token generation completes."""
    tm: TokenizerManager = request.app.state.tokenizer_manager
    inp = GenerateInput(
        input_ids=[tm.tokenizer.bos_token_id or 0],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
    ).normalize(tm.limits).reqs[0]
    try:
        await until_disconnect(
            request, asyncio.wait_for(tm.generate_one(inp), HEALTH_GENERATE_TIMEOUT_S)
        )
    except asyncio.TimeoutError:
        raise RequestError(
            None,
            f"unhealthy: a one-token generation did not finish in {HEALTH_GENERATE_TIMEOUT_S} s",
            503,
        ) from None
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    state = request.app.state
    return Response(await state.metrics.render(state.tokenizer_manager), media_type=CONTENT_TYPE)


# ---------------------------------------------------------------------- launching
class _Server(uvicorn.Server):
    """uvicorn.Server that announces the URL once it accepts connections, and on shutdown
    fails the requests still running after the grace period (their streams end with an error
    event) rather than letting uvicorn cancel their tasks mid-write."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, url: str, grace: float) -> None:
        super().__init__(config)
        self.app, self.url, self.grace = app, url, grace

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            print(f"plait server ready at {self.url}", flush=True)

    async def shutdown(self, sockets=None) -> None:
        self.app.state.ready = False  # keep-alive connections get 503 from now on
        loop = asyncio.get_running_loop()
        timer = loop.call_later(
            self.grace, fail_in_flight, self.app, "server is shutting down"
        )
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def fail_in_flight(app: FastAPI, reason: str) -> None:
    """Every unfinished request ends now with a 503 (its generator aborts it)."""
    tm: TokenizerManager = app.state.tokenizer_manager
    for state in list(tm.states.values()):
        if state.finished_reason is None and state.error is None:
            state.error = RequestError(None, reason, 503)
            state.event.set()


class _Terminated(SystemExit):
    def __init__(self) -> None:
        super().__init__(0)


def _terminate(signum, frame) -> None:
    raise _Terminated()


def bind_socket(host: str, port: int) -> socket.socket:
    """Claim the port before the model loads, so a port in use fails in a second."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"plait serve: cannot bind {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def launch_server(args: ServerArgs) -> None:
    """Start the child processes, then serve HTTP until SIGINT/SIGTERM; every child is
    stopped on the way out."""
    from plait.launch import CHILD_DEATH_EXIT_S, launch_with_tokenizer

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s frontend %(levelname)s %(message)s"
    )
    load_keys(args.api_key, args.api_key_file)  # a bad key file fails before the model loads
    sock = bind_socket(args.host, args.port)
    signal.signal(signal.SIGTERM, _terminate)  # uvicorn takes over once it runs
    children = None
    try:
        children, tokenizer = launch_with_tokenizer(args)
        tm = TokenizerManager(args, tokenizer, children.model_info, children.addrs, children.procs)
        app = create_app(tm, args, children=children)
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            access_log=args.log_level == "debug",
            timeout_graceful_shutdown=args.shutdown_grace + 5,  # fail_in_flight comes first
            timeout_keep_alive=KEEP_ALIVE_S,
        )
        server = _Server(config, app, args.url, args.shutdown_grace)
        # a dead child stops the server, and `plait serve` exits non-zero (launch.py)
        children.supervise(lambda _: setattr(server, "should_exit", True), CHILD_DEATH_EXIT_S)
        server.run(sockets=[sock])
        children.exit_if_failed()
    finally:
        sock.close()
        if children is not None:
            children.shutdown()
