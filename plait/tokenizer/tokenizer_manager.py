"""TokenizerManager: the frontend process's half of serving (asyncio).

Tokenizes requests (on a worker thread: a long prompt must not stall the event loop), makes
the checks that need the token ids (prompt length against the context, logprob volume),
sends them to the scheduler, receives text from the detokenizer and hands each request's
output to its waiting coroutine. Used by both the HTTP server and the offline Engine. A dead
child process fails every request in flight (503); a request past --request-timeout is
aborted (504). Field-level validation happened before, in `GenerateInput.normalize()`.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.io_struct import InputLimits, ReqInput, ReqState
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
from plait.models.tokenizer import encode_prompt

logger = logging.getLogger(__name__)

# Prompts shorter than this are tokenized on the loop (a thread hop costs more than them).
INLINE_TOKENIZE_CHARS = 4096
# A token rarely spans more characters than this: a text prompt longer than context x this
# cannot fit and is refused before it costs a tokenization (--max-prompt-chars overrides).
CHARS_PER_TOKEN_BOUND = 32


class TokenizerManager:
    def __init__(self, args: ServerArgs, tokenizer, model_info: dict[str, Any], addrs, procs) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.context_length = model_info["context_length"]
        self.kv_pool_size = model_info["max_total_tokens"]
        self.procs = procs  # name -> multiprocessing.Process, watched for crashes
        self._addrs = addrs
        self.states: dict[str, ReqState] = {}
        self.dead: str | None = None
        self.last_progress = time.monotonic()  # last message from the scheduler side
        self._nonce = itertools.count()
        self._control: dict[Any, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.listeners: list = []  # callables(state) on finish, e.g. metrics
        self._outbox: list[Any] = []  # messages to the scheduler, sent together (_send)

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
        self._flush_outbox()  # the aborts of requests that ended just before
        # nothing is sent on the closed sockets after (a stream dropped later still aborts)
        self.dead = self.dead or "shut down"
        self.sender.close()
        self.receiver.close()

    # ------------------------------------------------------------------ generation
    @functools.cached_property
    def limits(self) -> InputLimits:
        """The bounds every entry point's normalize() checks against (model and server)."""
        args = self.args
        max_chars = getattr(args, "max_prompt_chars", None)
        if max_chars is None:
            max_chars = self.context_length * CHARS_PER_TOKEN_BOUND
        return InputLimits(
            vocab_size=self.model_info.get("vocab_size"),
            context_length=self.context_length,
            max_prompt_chars=max_chars,
        )

    async def tokenize(self, req: ReqInput) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        if len(req.text) < INLINE_TOKENIZE_CHARS:
            return encode_prompt(self.tokenizer, req.text)
        # a long prompt takes the tokenizer seconds (it releases the GIL): off the loop
        return await asyncio.to_thread(encode_prompt, self.tokenizer, req.text)

    def validate(self, ids: list[int], req: ReqInput) -> None:
        """The checks that need the token ids; the fields were checked by normalize()."""
        field = req.prompt_name
        sp = req.sampling_params
        if not ids:
            raise RequestError(field, "the prompt is empty")
        if len(ids) >= self.context_length:
            raise RequestError(
                field, f"{len(ids)} tokens, over the context length {self.context_length}"
            )
        if len(ids) + sp.max_new_tokens > self.context_length:
            raise RequestError(
                "max_new_tokens",
                f"{sp.max_new_tokens} new tokens after a {len(ids)}-token prompt exceed the "
                f"context length {self.context_length}",
            )
        # the KV pool may hold fewer tokens than the context (--max-total-tokens); the
        # scheduler refuses such a request too, but only here is the prompt's field known
        if len(ids) > self.kv_pool_size:
            raise RequestError(
                field, f"{len(ids)} tokens, over the KV pool of {self.kv_pool_size} tokens "
                "(--max-total-tokens)",
            )
        if len(ids) + sp.max_new_tokens > self.kv_pool_size:
            raise RequestError(
                "max_new_tokens",
                f"{sp.max_new_tokens} new tokens after a {len(ids)}-token prompt exceed the "
                f"KV pool of {self.kv_pool_size} tokens (--max-total-tokens)",
            )
        if req.return_logprob:
            if req.logprob_start_len > len(ids):
                raise RequestError(
                    "logprob_start_len",
                    f"{req.logprob_start_len} is beyond the prompt ({len(ids)} tokens)",
                )
            rows = sp.max_new_tokens + (
                len(ids) - req.logprob_start_len if req.logprob_start_len >= 0 else 0
            )
            limit = self.limits.max_logprob_entries
            if rows * (1 + req.top_logprobs_num) > limit:
                raise RequestError(
                    "top_logprobs_num",
                    f"{rows} logprob rows x {1 + req.top_logprobs_num} entries exceed the limit "
                    f"of {limit} per request; ask for fewer top logprobs, tokens or input rows",
                )

    def check_alive(self) -> None:
        if self.dead:
            raise RequestError(None, f"server unavailable: {self.dead}", 503)

    async def generate(
        self, req: ReqInput, ids: list[int] | None = None
    ) -> AsyncIterator[ReqState]:
        """Yields the request's state each time output arrives (every step when streaming,
        once at the end otherwise); the last one has finished_reason set. `ids`: the prompt,
        already tokenized and validated (http_common.prepare_all), else done here."""
        self.check_alive()
        started = time.monotonic()
        if ids is None:
            ids = await self.tokenize(req)
            self.validate(ids, req)
        rid = req.rid or uuid.uuid4().hex
        if rid in self.states:
            raise RequestError("rid", f"request id {rid!r} is already in use")
        state = ReqState(rid, len(ids), group=req.group, key=req.key, priority=req.priority)
        if req.return_logprob and req.logprob_start_len >= 0:
            state.input_token_logprobs, state.input_top_logprobs = [], []
        self.states[rid] = state
        try:
            self._send(
                TokenizedGenerateReq(
                    rid=rid, input_ids=ids, sampling_params=req.sampling_params.to_dict(),
                    return_logprob=req.return_logprob, logprob_start_len=req.logprob_start_len,
                    top_logprobs_num=req.top_logprobs_num, stream=req.stream,
                    arrival_time=time.time(), priority=req.priority,
                )
            )
            while True:
                await self._wait(state, started)
                state.event.clear()
                if state.error is not None:
                    raise state.error
                # finished as yielded: the state moves on while the consumer holds it, and a
                # last output that arrived meanwhile must be yielded too (an Engine stream,
                # which cuts each chunk when it is yielded, lost its last tokens when the
                # request's final output came in between two chunks)
                done = state.finished_reason is not None
                yield state
                if done:
                    return
        finally:
            if self.states.pop(rid, None) is not None and state.finished_reason is None:
                self.abort(rid)  # the consumer went away (disconnect, cancel, deadline)

    async def _wait(self, state: ReqState, started: float) -> None:
        """Wait for the request's next output. --request-timeout bounds how long a request
        waits while the scheduler makes no progress at all (no message from it for any
        request): a stalled scheduler does not hang clients forever, while a request queued
        behind thousands of others in a long batch job is not aborted."""
        timeout = self.args.request_timeout
        if not timeout:
            await state.event.wait()
            return
        while True:
            quiet_since = max(started, self.last_progress)
            remaining = quiet_since + timeout - time.monotonic()
            try:
                await asyncio.wait_for(state.event.wait(), max(0.0, remaining))
                return
            except asyncio.TimeoutError:
                if self.last_progress > quiet_since:
                    continue  # the scheduler answered meanwhile: keep waiting
                raise RequestError(
                    None,
                    f"request timed out: the scheduler made no progress for {timeout:g} s "
                    "(--request-timeout); it was aborted",
                    504,
                ) from None

    async def generate_one(self, req: ReqInput) -> ReqState:
        state = None
        async for state in self.generate(req):
            pass
        return state

    def abort(self, rid: str) -> None:
        if not self.dead:
            self._send(AbortReq(rid))

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
        self._send(msg)
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._control.pop(key, None)

    def _send(self, msg: Any) -> None:
        """Queue msg for the scheduler; the queue goes out as one ZMQ message once the
        coroutines that are ready have run. A batch (Engine.generate with a list, a batched
        /generate, n > 1) thus reaches the scheduler whole, and its first prefill takes every
        prompt, not the few that had arrived when the scheduler woke up (a 32-prompt batch was
        prefilled in three forwards of 6, 16 and 10 prompts). Order is kept: everything goes
        through the one queue."""
        self._outbox.append(msg)
        if len(self._outbox) > 1:
            return  # a flush is scheduled
        try:
            asyncio.get_running_loop().call_soon(self._flush_outbox)
        except RuntimeError:  # no loop running (shutdown): send now
            self._flush_outbox()

    def _flush_outbox(self) -> None:
        msgs, self._outbox = self._outbox, []
        if msgs and not self.dead:
            self.sender.send_many(msgs)

    # ------------------------------------------------------------------ receiving
    async def _recv_loop(self) -> None:
        while True:
            for msg in await self.receiver.recv():
                self._on_message(msg)

    def _on_message(self, msg: Any) -> None:
        self.last_progress = time.monotonic()
        if isinstance(msg, BatchStrOut):
            self._on_output(msg)
        elif isinstance(msg, RequestErrorOut):
            state = self.states.get(msg.rid)
            if state is not None:
                state.error = _scheduler_error(msg)
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
                        state.error = RequestError(None, f"server unavailable: {self.dead}", 503)
                        state.event.set()
                    for fut in self._control.values():
                        if not fut.done():
                            fut.set_exception(RequestError(None, self.dead, 503))
                    break
            await asyncio.sleep(0.25)


def _scheduler_error(msg: RequestErrorOut) -> RequestError:
    """A request the scheduler refused (a constraint that does not compile, KV capacity)."""
    message = msg.message
    if msg.param and message.startswith(msg.param + ": "):
        message = message[len(msg.param) + 2 :]
    return RequestError(msg.param, message, msg.status)
