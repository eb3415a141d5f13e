"""plait.Engine: the offline API (SGLang's Engine signature) over the same scheduler and
detokenizer processes the HTTP server uses, without HTTP.

The TokenizerManager lives on a private asyncio loop in a background thread; `generate`
blocks on it, `async_generate` awaits it from the caller's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import threading
from collections.abc import Iterator
from typing import Any

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.io_struct import GenerateInput, ReqInput, format_output
from plait.launch import launch_with_tokenizer
from plait.tokenizer.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

SHUT_DOWN = "the Engine is shut down"
# How long an interrupted call (Ctrl-C, a timeout) waits for its coroutine to end (abort).
CANCEL_WAIT_S = 10.0


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        try:
            self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        except TypeError as e:
            raise TypeError(f"Engine: {e}") from None
        self._children, self.tokenizer = launch_with_tokenizer(self.args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="plait-engine", daemon=True)
        self._thread.start()
        # _submit checks _closed under this lock: nothing reaches the loop once it stops
        self._lock = threading.Lock()
        self._closed = False
        children = self._children
        self.tokenizer_manager = TokenizerManager(
            self.args, self.tokenizer, children.model_info, children.addrs, children.procs
        )
        self._call(self.tokenizer_manager.start())
        atexit.register(self.shutdown)  # an Engine never shut down still stops its children

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._children.model_info)

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ):
        """A dict (one prompt) or a list of dicts (a list of prompts, or n > 1), in input
        order; with stream=True an iterator of incremental chunks (one prompt only)."""
        inputs, batched = self._normalize(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, stream)
        if stream:
            return self._stream(inputs[0])
        outs = self._call(self._generate_all(inputs))
        return outs if batched else outs[0]

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
    ):
        inputs, batched = self._normalize(prompt, input_ids, sampling_params, return_logprob,
                                          logprob_start_len, top_logprobs_num, stream)
        if stream:
            return self._astream(inputs[0])
        outs = await asyncio.wrap_future(self._submit(self._generate_all(inputs)))
        return outs if batched else outs[0]

    def _normalize(self, prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
                   top_logprobs_num, stream) -> tuple[list[ReqInput], bool]:
        """The arguments as a GenerateInput, normalized as every entry point does (a
        RequestError, which is a ValueError, naming the field)."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("prompt", "give exactly one of prompt or input_ids")
        inp = GenerateInput(
            text=prompt, input_ids=input_ids, sampling_params=sampling_params,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, stream=stream,
        )
        try:
            norm = inp.normalize(self.tokenizer_manager.limits)
        except RequestError as e:
            raise _engine_error(e) from None
        if stream and (norm.batched or len(norm.reqs) != 1):
            raise RequestError("stream", "streaming takes a single prompt with n = 1")
        return norm.reqs, norm.batched

    async def _generate_all(self, inputs: list[ReqInput]) -> list[dict]:
        tm = self.tokenizer_manager
        states = await asyncio.gather(*(tm.generate_one(i) for i in inputs), return_exceptions=True)
        for s in states:
            if isinstance(s, BaseException):
                raise _engine_error(s) if isinstance(s, RequestError) else s
        return [format_output(s, i.return_logprob) for s, i in zip(states, inputs)]

    def _stream(self, inp: ReqInput) -> Iterator[dict]:
        agen = self.tokenizer_manager.generate(inp)
        sent = [0, 0]  # text, output ids

        async def next_chunk() -> dict | None:
            # read on the loop's thread: the state moves on there as output arrives, and a
            # chunk cut from it elsewhere could drop what came between two reads
            try:
                state = await agen.__anext__()
            except StopAsyncIteration:
                return None
            chunk = format_output(state, inp.return_logprob)
            chunk["text"] = state.text[sent[0]:]
            chunk["output_ids"] = state.output_ids[sent[1]:]
            sent[:] = len(state.text), len(state.output_ids)
            return chunk

        try:
            while True:
                try:
                    chunk = self._call(next_chunk())
                except RequestError as e:
                    raise _engine_error(e) from None
                if chunk is None:
                    return
                yield chunk
        finally:
            if not self._closed:
                self._call(agen.aclose())

    async def _astream(self, inp: ReqInput):
        it = self._stream(inp)
        while True:
            chunk = await asyncio.to_thread(next, it, None)
            if chunk is None:
                return
            yield chunk

    # ------------------------------------------------------------------ control
    def flush_cache(self) -> bool:
        return self._call(self.tokenizer_manager.flush_cache()).success

    def get_server_info(self) -> dict[str, Any]:
        stats = self._call(self.tokenizer_manager.get_stats())
        return {**self.model_info, **stats}

    def shutdown(self) -> None:
        """Stop the children. Calls still running (other threads' generate, streams) end
        with an error saying so, as does every later call."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        atexit.unregister(self.shutdown)
        try:
            asyncio.run_coroutine_threadsafe(self._end_calls(), self._loop).result(10)
        except Exception:  # shutting down regardless; what is left is cancelled below
            logger.warning("Engine shutdown: ending the calls in flight failed", exc_info=True)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():  # whatever _end_calls missed is cancelled, not left
            self._loop.run_until_complete(_cancel_other_tasks())
            self._loop.close()
        self._children.shutdown()

    async def _end_calls(self) -> None:
        """Fail every unfinished request, let the calls waiting on them raise, then close
        the TokenizerManager."""
        tm = self.tokenizer_manager
        for state in list(tm.states.values()):
            if state.finished_reason is None and state.error is None:
                state.error = RequestError(None, SHUT_DOWN, 503)
                state.event.set()
        calls = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()
                 and t not in tm._tasks]
        if calls:
            await asyncio.wait(calls, timeout=5)
        await tm.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, coro, timeout: float | None = None):
        """Run coro on the engine's loop and wait for its result. A wait that ends early
        (KeyboardInterrupt, the timeout) cancels the coroutine and waits until it has ended,
        so that its request is aborted, not left decoding, before the exception goes on (and
        a stream's generator is free to be closed)."""
        done = threading.Event()
        box: list[asyncio.Task] = []

        def start() -> None:
            box.append(self._loop.create_task(coro))
            box[0].add_done_callback(lambda _: done.set())

        def cancel() -> None:  # callbacks run in order: start() has run if it was queued
            if box:
                box[0].cancel()
            else:
                coro.close()
                done.set()

        def stop() -> None:
            try:
                self._loop.call_soon_threadsafe(cancel)
            except RuntimeError:  # the loop is closed: shut down meanwhile, nothing runs
                pass
            else:
                done.wait(CANCEL_WAIT_S)

        with self._lock:
            if self._closed:
                coro.close()
                raise RequestError(None, SHUT_DOWN, 503)
            try:
                self._loop.call_soon_threadsafe(start)
            except BaseException:  # a Ctrl-C inside the call may come after start() is queued
                stop()
                raise
        try:
            if not done.wait(timeout):
                raise TimeoutError(f"plait.Engine: no answer within {timeout} s")
        except BaseException:
            stop()
            raise
        if box[0].cancelled() and self._closed:
            raise RequestError(None, SHUT_DOWN, 503)
        return box[0].result()

    def _submit(self, coro) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                coro.close()
                raise RequestError(None, SHUT_DOWN, 503)
            return asyncio.run_coroutine_threadsafe(coro, self._loop)


async def _cancel_other_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _engine_error(e: RequestError) -> RequestError:
    """The Engine calls a text prompt `prompt` (normalize and the tokenizer say `text`)."""
    if e.field == "text" or (e.field or "").startswith("text."):
        return e.renamed("prompt" + e.field[4:])
    return e
