"""Messages between plait's processes, their one serializer, and the one ZMQ wrapper.

frontend (TokenizerManager) --TokenizedGenerateReq/AbortReq/FlushCacheReq/...--> scheduler
scheduler --BatchTokenOut (and control replies)--> detokenizer
detokenizer --BatchStrOut (and the control replies, passed through)--> frontend

Every message is a dataclass of plain values (ints, floats, strings, lists, dicts, None),
encoded with msgpack as [type name, field dict]. Nothing else is pickled across processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio

# ------------------------------------------------------------------ frontend -> scheduler


@dataclass
class TokenizedGenerateReq:
    rid: str
    input_ids: list[int]
    sampling_params: dict[str, Any]  # SamplingParams.to_dict(), validated by the frontend
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    arrival_time: float = 0.0
    priority: int = 0  # higher is scheduled sooner (waiting requests age; see schedule_policy)


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class GetStatsReq:
    """Scheduler statistics (KV usage, queue lengths, cache hit rate); also the health probe."""

    nonce: int = 0


# ------------------------------------------------------------------ scheduler -> detokenizer


@dataclass
class BatchTokenOut:
    """New output of several requests since the previous message, one list entry per request."""

    rids: list[str]
    new_token_ids: list[list[int]]  # tokens produced since the last message
    finished_reasons: list[dict[str, Any] | None]  # None while running
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    no_stop_trim: list[bool]
    # logprobs (empty lists when not requested): per token (logprob, token_id)
    output_token_logprobs: list[list[list[Any]]]
    output_top_logprobs: list[list[list[list[Any]]]]
    input_token_logprobs: list[list[list[Any]] | None]
    input_top_logprobs: list[list[list[list[Any]]] | None]
    # per-request meta_info extras (forced_tokens, queue_time), merged into the response as is
    extra_meta: list[dict[str, Any]] = field(default_factory=list)
    include_stop_str: list[bool] = field(default_factory=list)  # (empty: none of them)
    stop_strs: list[list[str]] = field(default_factory=list)  # for trimming and hold-back


# ------------------------------------------------------------------ detokenizer -> frontend


@dataclass
class BatchStrOut:
    rids: list[str]
    text_deltas: list[str]  # text produced since the previous message (stop strings trimmed)
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[list[Any]]]
    output_top_logprobs: list[list[list[list[Any]]]]
    input_token_logprobs: list[list[list[Any]] | None]
    input_top_logprobs: list[list[list[list[Any]]] | None]
    extra_meta: list[dict[str, Any]] = field(default_factory=list)


# ------------------------------------------------------------------ control replies


@dataclass
class RequestErrorOut:
    """A request refused by the scheduler (bad constraint, too long, ...). status: HTTP code."""

    rid: str
    message: str
    status: int = 400
    param: str | None = None


@dataclass
class FlushCacheOut:
    success: bool
    message: str = ""


@dataclass
class StatsOut:
    nonce: int
    stats: dict[str, Any]


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReq,
        AbortReq,
        FlushCacheReq,
        GetStatsReq,
        BatchTokenOut,
        BatchStrOut,
        RequestErrorOut,
        FlushCacheOut,
        StatsOut,
    )
}


def encode(msg: Any) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise TypeError(f"not a plait message: {type(msg)!r}")
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}
    return msgpack.packb([name, fields], use_bin_type=True)


def decode(data: bytes) -> Any:
    name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    cls = MESSAGE_TYPES.get(name)
    if cls is None:
        raise TypeError(f"unknown message type {name!r}")
    return cls(**fields)


# ------------------------------------------------------------------ sockets (the only place)


class MessageSender:
    """PUSH socket sending plait messages."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr) if bind else self._sock.connect(addr)

    def send(self, msg: Any) -> None:
        self._sock.send(encode(msg))

    def send_many(self, msgs: list[Any]) -> None:
        """Several messages as one ZMQ message (a frame each): the receiver gets them all in
        one receive. A batch of requests sent one by one reached the scheduler in parts (it
        started prefilling the first few while the rest were still being sent)."""
        if msgs:
            self._sock.send_multipart([encode(m) for m in msgs])

    def close(self) -> None:
        self._sock.close()


class MessageReceiver:
    """PULL socket receiving plait messages (blocking API, used by the child processes)."""

    def __init__(self, ctx: zmq.Context, addr: str, bind: bool) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr) if bind else self._sock.connect(addr)

    def recv(self, timeout_ms: int | None = None) -> list[Any]:
        """The messages of the next ZMQ message (one, or those of a send_many), or [] if none
        arrived within timeout_ms (None: wait forever)."""
        if timeout_ms is not None and not self._sock.poll(timeout_ms):
            return []
        return [decode(frame) for frame in self._sock.recv_multipart()]

    def recv_all(self) -> list[Any]:
        """Every message already queued, without blocking."""
        out = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.extend(decode(frame) for frame in frames)

    def close(self) -> None:
        self._sock.close()


class AsyncMessageReceiver:
    """PULL socket for asyncio code (the frontend)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, bind: bool) -> None:
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(addr) if bind else self._sock.connect(addr)

    async def recv(self) -> list[Any]:
        """The messages of the next ZMQ message (one, or those of a send_many)."""
        return [decode(frame) for frame in await self._sock.recv_multipart()]

    def close(self) -> None:
        self._sock.close()
