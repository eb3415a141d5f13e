"""TokenizerManager: the frontend half of the runtime (asyncio).

Tokenizes and validates requests, sends them to the scheduler, receives text from the
detokenizer and hands each request's output to its waiting coroutine. Used by both the HTTP
server and the offline Engine. A dead child process fails every request in flight (503).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from plait.args import ServerArgs
from plait.messages import (
    AbortReq,
    AsyncMessageReceiver,
    BatchStrOut,
    FlushCacheOut,
    FlushCacheReq,
    GetStatsReq,
    MessageSender,
    RequestErrorOut,
    StatsOut,
    TokenizedGenerateReq,
)
from plait.sampling import SamplingParams

logger = logging.getLogger(__name__)


class RequestError(Exception):
    """A request that the runtime refused or could not serve; status is the HTTP code."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class ReqState:
    rid: str
    prompt_tokens: int
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    error: RequestError | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


@dataclass
class GenerateInput:
    """One prompt's request, already normalized (text or ids, sampling params as a dict)."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | SamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer, model_info: dict[str, Any], addrs, procs) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.context_length = model_info["context_length"]
        self.procs = procs  # name -> multiprocessing.Process, watched for crashes
        self._addrs = addrs
        self.states: dict[str, ReqState] = {}
        self.dead: str | None = None
        self._nonce = itertools.count()
        self._control: dict[Any, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.listeners: list = []  # callables(state) on finish, e.g. metrics

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self.sender = MessageSender(self._sync_ctx, self._addrs.scheduler_input, bind=False)
        self.receiver = AsyncMessageReceiver(self._ctx, self._addrs.tokenizer_input, bind=True)
        self._tasks = [
            asyncio.create_task(self._recv_loop()),
            asyncio.create_task(self._watch_children()),
        ]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        self.sender.close()
        self.receiver.close()

    # ------------------------------------------------------------------ generation
    def tokenize(self, inp: GenerateInput) -> list[int]:
        if inp.input_ids is not None:
            ids = list(inp.input_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise RequestError("input_ids: must be a list of integers", 400, "input_ids")
        elif inp.text is not None:
            if not isinstance(inp.text, str):
                raise RequestError("text: must be a string", 400, "text")
            ids = self.tokenizer.encode(inp.text, add_special_tokens=False)
        else:
            raise RequestError("text: one of text or input_ids is required", 400, "text")
        if not ids:
            raise RequestError("prompt: the prompt is empty", 400, "prompt")
        return ids

    def validate(self, ids: list[int], sp: SamplingParams) -> None:
        if len(ids) >= self.context_length:
            raise RequestError(
                f"prompt: {len(ids)} tokens, over the context length {self.context_length}",
                400, "prompt",
            )
        if len(ids) + sp.max_new_tokens > self.context_length:
            raise RequestError(
                f"max_new_tokens: {sp.max_new_tokens} new tokens after a {len(ids)}-token prompt "
                f"exceed the context length {self.context_length}",
                400, "max_new_tokens",
            )
        vocab = self.model_info["vocab_size"]
        if any(t < 0 or t >= vocab for t in ids):
            raise RequestError(f"input_ids: token ids must be in [0, {vocab})", 400, "input_ids")

    def check_alive(self) -> None:
        if self.dead:
            raise RequestError(f"server unavailable: {self.dead}", 503)

    def queue_full(self) -> bool:
        return len(self.states) >= self.args.max_queued_requests + self.args.max_running_requests

    async def generate(self, inp: GenerateInput) -> AsyncIterator[ReqState]:
        """Yields the request's state each time output arrives (every step when streaming,
        once at the end otherwise); the last one has finished_reason set."""
        self.check_alive()
        sp = _to_sampling(inp.sampling_params)
        ids = self.tokenize(inp)
        self.validate(ids, sp)
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError(f"rid: request id {rid!r} is already in use", 400, "rid")
        logprob_start = -1
        if inp.return_logprob:
            logprob_start = inp.logprob_start_len if inp.logprob_start_len is not None else -1
            if logprob_start is not None and logprob_start >= 0 and logprob_start > len(ids):
                raise RequestError("logprob_start_len: beyond the prompt", 400, "logprob_start_len")
        state = ReqState(rid, len(ids))
        if logprob_start >= 0:
            state.input_token_logprobs, state.input_top_logprobs = [], []
        self.states[rid] = state
        self.sender.send(
            TokenizedGenerateReq(
                rid=rid, input_ids=ids, sampling_params=sp.to_dict(),
                return_logprob=inp.return_logprob, logprob_start_len=logprob_start,
                top_logprobs_num=inp.top_logprobs_num or 0, stream=inp.stream,
                arrival_time=time.time(),
            )
        )
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                if state.error is not None:
                    raise state.error
                yield state
                if state.finished_reason is not None:
                    return
        finally:
            if self.states.pop(rid, None) is not None and state.finished_reason is None:
                self.abort(rid)  # the consumer went away (client disconnect, cancel)

    async def generate_one(self, inp: GenerateInput) -> ReqState:
        state = None
        async for state in self.generate(inp):
            pass
        return state

    def abort(self, rid: str) -> None:
        if not self.dead:
            self.sender.send(AbortReq(rid))

    # ------------------------------------------------------------------ control
    async def flush_cache(self) -> FlushCacheOut:
        return await self._control_call(FlushCacheReq(), FlushCacheReq)

    async def get_stats(self, timeout: float = 5.0) -> dict[str, Any]:
        nonce = next(self._nonce)
        out = await self._control_call(GetStatsReq(nonce), nonce, timeout)
        return out.stats

    async def _control_call(self, msg: Any, key: Any, timeout: float = 30.0):
        self.check_alive()
        fut = asyncio.get_running_loop().create_future()
        self._control[key] = fut
        self.sender.send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._control.pop(key, None)

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            msg = await self.receiver.recv()
            if isinstance(msg, BatchStrOut):
                self._on_output(msg)
            elif isinstance(msg, RequestErrorOut):
                state = self.states.get(msg.rid)
                if state is not None:
                    state.error = RequestError(msg.message, msg.status, msg.param)
                    state.event.set()
            elif isinstance(msg, FlushCacheOut):
                self._resolve(FlushCacheReq, msg)
            elif isinstance(msg, StatsOut):
                self._resolve(msg.nonce, msg)
            else:
                logger.error("frontend: unexpected message %s", type(msg).__name__)

    def _resolve(self, key: Any, value: Any) -> None:
        fut = self._control.get(key)
        if fut is not None and not fut.done():
            fut.set_result(value)

    def _on_output(self, msg: BatchStrOut) -> None:
        now = time.monotonic()
        for i, rid in enumerate(msg.rids):
            state = self.states.get(rid)
            if state is None:
                continue
            state.text += msg.text_deltas[i]
            state.output_ids.extend(msg.new_token_ids[i])
            if state.first_token_time is None and msg.new_token_ids[i]:
                state.first_token_time = now
            state.output_token_logprobs.extend(msg.output_token_logprobs[i])
            state.output_top_logprobs.extend(msg.output_top_logprobs[i])
            if msg.input_token_logprobs[i] and state.input_token_logprobs is not None:
                state.input_token_logprobs.extend(msg.input_token_logprobs[i])
                state.input_top_logprobs.extend(msg.input_top_logprobs[i] or [])
            state.meta = {
                "prompt_tokens": msg.prompt_tokens[i],
                "completion_tokens": msg.completion_tokens[i],
                "cached_tokens": msg.cached_tokens[i],
                **(msg.extra_meta[i] if msg.extra_meta else {}),
            }
            state.finished_reason = msg.finished_reasons[i]
            if state.finished_reason is not None:
                for listener in self.listeners:
                    listener(state)
            state.event.set()

    async def _watch_children(self) -> None:
        while not self.dead:
            for name, proc in self.procs.items():
                if not proc.is_alive():
                    self.dead = f"the {name} process died (exit code {proc.exitcode})"
                    logger.error("frontend: %s", self.dead)
                    for state in list(self.states.values()):
                        state.error = RequestError(f"server unavailable: {self.dead}", 503)
                        state.event.set()
                    for fut in self._control.values():
                        if not fut.done():
                            fut.set_exception(RequestError(self.dead, 503))
                    break
            await asyncio.sleep(0.25)


def _to_sampling(params: dict[str, Any] | SamplingParams | None) -> SamplingParams:
    if isinstance(params, SamplingParams):
        return params
    if params is not None and not isinstance(params, dict):
        raise RequestError("sampling_params: must be an object", 400, "sampling_params")
    try:
        return SamplingParams.from_dict(params)
    except (ValueError, TypeError) as e:
        raise RequestError(str(e), 400, str(e).split(":")[0]) from None
