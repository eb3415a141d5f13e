"""HTTP plumbing the native and OpenAI routes share: reading a bounded JSON body, admission
(queue slots, per-key rate limits, priority tiers), running a request's outputs with
abort-on-disconnect, SSE framing and OpenAI's error body.

Admission is synchronous: `admit()` checks and takes the request's slots with no `await` in
between, so a burst of simultaneous requests cannot all pass the check before any of them
counts. The returned `Ticket` gives the slots back exactly once, whatever way the request
ends (answer, error, disconnect, deadline): routes hold it in a `with` block, and a
streaming response takes it over (`TicketedStream` releases it when the response ends).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from plait.errors import RequestError
from plait.io_struct import GenerateInput, NormalizedInput, ReqInput, ReqState
from plait.tokenizer.tokenizer_manager import TokenizerManager

T = TypeVar("T")
MAX_JSON_DEPTH = 64  # deeper bodies are refused (json_schema nesting stays far below)
SCOPE_KEY = "plait.api_key"  # the caller's KeyPolicy, set by the gate


def tokenizer_manager(request: Request) -> TokenizerManager:
    return request.app.state.tokenizer_manager


# ---------------------------------------------------------------------- body
async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object. Over --max-request-bytes: 413 (read no further); malformed,
    too deep or not an object: 400 naming `body` (the connection stays usable)."""
    limit = request.app.state.args.max_request_bytes
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError("body", f"larger than {limit} bytes (--max-request-bytes)", 413)
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        data = json.loads(body) if body.strip() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError("body", f"invalid JSON ({e})") from None
    except RecursionError:
        raise RequestError("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not isinstance(data, dict):
        raise RequestError("body", "must be a JSON object")
    if _depth_over(data, MAX_JSON_DEPTH):
        raise RequestError("body", f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def _depth_over(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))
    return False


# ---------------------------------------------------------------------- keys and rate limits
class TokenBucket:
    """`per_minute` units a minute, bursting up to a minute's worth. A charge may overdraw
    it (tokens are known only when a request ends); it admits again once back above zero."""

    def __init__(self, per_minute: float) -> None:
        self.rate = per_minute / 60.0
        self.capacity = float(per_minute)
        self.level = float(per_minute)
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` units are there (0: now)."""
        self._refill()
        missing = amount - self.level
        return 0.0 if missing <= 0 else missing / self.rate

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount


@dataclass
class KeyPolicy:
    """One API key's limits: requests and tokens per minute (None: unlimited) and priority
    (the default for its requests and the highest they may ask; None: no cap)."""

    name: str
    rpm: float | None = None
    tpm: float | None = None
    priority: int | None = None

    def __post_init__(self) -> None:
        self.requests = TokenBucket(self.rpm) if self.rpm else None
        self.tokens = TokenBucket(self.tpm) if self.tpm else None

    def check(self) -> None:
        """429 with Retry-After from the bucket when a limit is spent; takes one request."""
        for limit, bucket, amount in (("rpm", self.requests, 1.0), ("tpm", self.tokens, 1e-9)):
            if bucket is None:
                continue
            wait = bucket.wait_for(amount)
            if wait > 0:
                raise RateLimited(self.name, limit, wait)
        if self.requests is not None:
            self.requests.take(1.0)

    def charge_tokens(self, n: int) -> None:
        if self.tokens is not None:
            self.tokens.take(n)


class RateLimited(RequestError):
    def __init__(self, key: str, limit: str, wait_s: float) -> None:
        retry = max(1, math.ceil(wait_s))
        what = "requests" if limit == "rpm" else "tokens"
        super().__init__(
            None,
            f"rate limit reached for API key '{key}': {what} per minute; retry in {retry} s",
            429,
            {"Retry-After": str(retry)},
        )
        self.key, self.limit = key, limit


def key_label(key: str) -> str:
    """A metrics / log label for a key that has no name: never the key itself."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:10]


def load_keys(api_key: str | None, api_key_file: str | None) -> dict[bytes, KeyPolicy]:
    """{key bytes: policy} from --api-key and --api-key-file (ValueError naming the problem)."""
    keys: dict[bytes, KeyPolicy] = {}
    if api_key:
        keys[api_key.encode()] = KeyPolicy("default")
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as e:
            raise ValueError(f"api_key_file: cannot read {api_key_file}: {e.strerror}") from None
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"api_key_file: {api_key_file} is not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ValueError(
                f"api_key_file: {api_key_file} must map each key to its settings"
            )
        for key, conf in data.items():
            conf = conf or {}
            unknown = set(conf) - {"name", "rpm", "tpm", "priority"}
            if unknown or not key:
                raise ValueError(f"{api_key_file}: bad entry (unknown settings {sorted(unknown)})")
            for name in ("rpm", "tpm"):
                v = conf.get(name)
                if v is not None and (
                    isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0
                ):
                    raise ValueError(f"{api_key_file}: {name} must be a positive number")
            prio = conf.get("priority")
            if prio is not None and (isinstance(prio, bool) or not isinstance(prio, int)):
                raise ValueError(f"{api_key_file}: priority must be an integer")
            keys[key.encode()] = KeyPolicy(
                str(conf.get("name") or key_label(key)), conf.get("rpm"), conf.get("tpm"), prio
            )
    return keys


# ---------------------------------------------------------------------- admission
def tier(priority: int) -> str:
    """Priority tiers: interactive (> 0), default (0), batch (< 0)."""
    return "interactive" if priority > 0 else "batch" if priority < 0 else "default"


class Admission:
    """Slots for generation requests: --max-running-requests + --max-queued-requests in all;
    batch-tier requests may not take the last --queue-reserve-fraction of the queue."""

    def __init__(self, max_running: int, max_queued: int, reserve_fraction: float) -> None:
        self.capacity = max_running + max_queued
        self.max_queued = max_queued
        self.batch_reserve = math.ceil(max_queued * reserve_fraction)
        self.in_flight = 0

    def reserve(self, n: int, priority: int) -> Ticket:
        limit = self.capacity - (self.batch_reserve if priority < 0 else 0)
        if self.in_flight + n > limit:
            waiting = max(0, self.in_flight - (self.capacity - self.max_queued))
            raise RequestError(
                None,
                f"server overloaded: {waiting} requests are waiting (--max-queued-requests "
                f"{self.max_queued}, {tier(priority)} tier); retry later",
                429,
                {"Retry-After": "1"},
            )
        self.in_flight += n
        return Ticket(self, n)


class Ticket:
    """Slots held by one HTTP request; released exactly once."""

    def __init__(self, admission: Admission, n: int) -> None:
        self._admission, self._n = admission, n
        self.handed_over = False

    def release(self) -> None:
        if self._n:
            self._admission.in_flight -= self._n
            self._n = 0

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        if not self.handed_over:
            self.release()


def admit(request: Request, reqs: list[ReqInput]) -> Ticket:
    """Synchronously: 503 once a child died, the caller's rate limits (429 + Retry-After),
    then queue slots (429). Sets each request's key label and caps its priority by the key's."""
    state = request.app.state
    tm = tokenizer_manager(request)
    tm.check_alive()
    policy: KeyPolicy | None = request.scope.get(SCOPE_KEY)
    metrics = state.metrics
    priority = max(r.priority for r in reqs)
    if policy is not None:
        try:
            policy.check()
        except RateLimited as e:
            metrics.observe_rate_limited(e.key, e.limit)
            raise
        for r in reqs:
            r.key = policy.name
            if policy.priority is not None:
                r.priority = min(r.priority, policy.priority)
        priority = max(r.priority for r in reqs)
    try:
        ticket = state.admission.reserve(len(reqs), priority)
    except RequestError:
        metrics.observe_admission(tier(priority), admitted=False)
        raise
    metrics.observe_admission(tier(priority), admitted=True)
    return ticket


def normalize(request: Request, inp: GenerateInput) -> NormalizedInput:
    """A route's GenerateInput validated under the server's limits, at its API key's priority
    when it names none."""
    inp.priority = request_priority(request, inp.priority)
    return inp.normalize(tokenizer_manager(request).limits)


def request_priority(request: Request, given: Any) -> Any:
    """The priority a request runs at when it names none: its key's (else the default)."""
    policy: KeyPolicy | None = request.scope.get(SCOPE_KEY)
    if given is None and policy is not None and policy.priority is not None:
        return policy.priority
    return given


class TicketedStream(StreamingResponse):
    """A streaming response that owns its request's admission ticket: released when the
    response ends in any way, and the body iterator closed (aborting unfinished requests)
    even when the client left before the first byte."""

    def __init__(self, content, ticket: Ticket, **kwargs) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        ticket.handed_over = True
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running in a task being cancelled: it ends there
                    pass


# ---------------------------------------------------------------------- running requests
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


async def prepare_all(tm: TokenizerManager, reqs: list[ReqInput]) -> list[list[int]]:
    """Every request's prompt ids, checked before any of them runs: a bad prompt in a batch is
    the request's error (a status), not an event in a stream that has begun. The samples of
    one prompt (n > 1) share its tokenizing."""
    ids_of: dict[int, list[int]] = {}
    prompts = []
    for req in reqs:
        prompt = req.text if req.text is not None else req.input_ids
        if id(prompt) not in ids_of:
            ids_of[id(prompt)] = await tm.tokenize(req)
        tm.validate(ids_of[id(prompt)], req)
        prompts.append(ids_of[id(prompt)])
    return prompts


async def run_streams(
    tm: TokenizerManager, reqs: list[ReqInput]
) -> AsyncIterator[tuple[int, ReqState]]:
    """Runs the requests concurrently; yields (index, state) as output arrives, nothing of a
    request after an item that was finished when yielded. A state moves on after it is
    yielded: a consumer that holds an item across awaits reads each request's last state once
    through each_last_once. The first error is raised and every other request aborted;
    closing the iterator early aborts the unfinished ones."""
    queue: asyncio.Queue = asyncio.Queue()
    prompts = await prepare_all(tm, reqs)

    async def pump(i: int, req: ReqInput) -> None:
        try:
            async for state in tm.generate(req, prompts[i]):
                queue.put_nowait((i, state, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.create_task(pump(i, req)) for i, req in enumerate(reqs)]
    finished: set[int] = set()
    try:
        while len(finished) < len(reqs):
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


async def each_last_once(
    first: tuple[int, ReqState],
    rest: AsyncIterator[tuple[int, ReqState]],
    on_last: Callable[[ReqState], None],
) -> AsyncIterator[tuple[int, ReqState]]:
    """`first` then `rest`, up to each request's last state (on_last called with it), once.
    A state is one object that moves on while a stream is written: an item queued before its
    request finished reads as finished when it is taken (`first` most often, taken before
    the 200 went out), and the items queued after it are that same last state again."""
    item, done = first, set()
    while True:
        i, state = item
        if i not in done:
            if state.finished_reason is not None:
                done.add(i)
                on_last(state)
            yield item
        try:
            item = await rest.__anext__()
        except StopAsyncIteration:
            return


async def run_all(tm: TokenizerManager, reqs: list[ReqInput]) -> list[ReqState]:
    """Every request's final state, in input order."""
    states: list[ReqState | None] = [None] * len(reqs)
    async for i, state in run_streams(tm, reqs):
        if state.finished_reason is not None:
            states[i] = state
    return states  # type: ignore[return-value]


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


async def run_to_end(request: Request, reqs: list[ReqInput]) -> list[ReqState]:
    """Run a route's requests to completion under one admission ticket; a client that
    disconnects aborts them."""
    with admit(request, reqs):
        return await until_disconnect(request, run_all(tokenizer_manager(request), reqs))


async def sse_response(
    request: Request,
    reqs: list[ReqInput],
    render: Callable[[AsyncIterator[tuple[int, ReqState]]], AsyncIterator[dict]],
    map_error: Callable[[RequestError], RequestError] | None = None,
) -> Response:
    """A streamed answer: admit `reqs`, wait for their first output (an error up to it is
    raised, through map_error, so that it gets its own status), then send the bodies
    `render(outputs)` makes as SSE events and `[DONE]`. `outputs` yields the (index, state)
    updates, each request's last state once (each_last_once), counted in the metrics; an
    error later is sent as an error event. The admission ticket is held until the stream ends."""
    with admit(request, reqs) as ticket:
        try:
            first, rest = await first_then_rest(
                request, run_streams(tokenizer_manager(request), reqs)
            )
        except RequestError as e:
            raise (map_error(e) if map_error else e) from None
        metrics = request.app.state.metrics

        async def events() -> AsyncIterator[bytes]:
            try:
                async for body in render(each_last_once(first, rest, metrics.observe_stream)):
                    yield sse(body)
            except Exception as e:
                if map_error is not None and isinstance(e, RequestError):
                    e = map_error(e)
                yield stream_error(e)
            finally:
                await rest.aclose()
            yield SSE_DONE

        return TicketedStream(events(), ticket)


# ---------------------------------------------------------------------- SSE and errors
def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "client_closed_request",
    503: "service_unavailable_error",
    504: "timeout_error",
}
ERROR_CODES = {
    401: "invalid_api_key",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "request_timeout",
}


def error_body(e: RequestError) -> dict[str, Any]:
    """OpenAI's error object (also used by the native endpoints)."""
    code = (
        "model_not_found" if e.status == 404 and e.field == "model" else ERROR_CODES.get(e.status)
    )
    return {
        "error": {
            "message": str(e),
            "type": ERROR_TYPES.get(e.status, "server_error"),
            "param": e.field,
            "code": code,
        }
    }


def stream_error(e: Exception) -> bytes:
    """An error after the stream's 200 header went out: one SSE event with the error body."""
    if not isinstance(e, RequestError):
        e = RequestError(None, f"internal error: {type(e).__name__}: {e}", 500)
    return sse(error_body(e))


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
