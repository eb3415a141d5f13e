"""plait.Engine: the offline API (SGLang's Engine signature) over the same scheduler and
detokenizer processes the HTTP server uses, without HTTP.

The TokenizerManager lives on a private asyncio loop in a background thread; `generate`
blocks on it, `async_generate` awaits it from the caller's loop.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Iterator
from typing import Any

from plait.args import ServerArgs
from plait.frontend.launch import launch_with_tokenizer
from plait.frontend.tokenizer_manager import GenerateInput, ReqState, RequestError, TokenizerManager
from plait.sampling import SamplingParams


class Engine:
    def __init__(self, model_path: str | None = None, **server_args: Any) -> None:
        try:
            self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        except TypeError as e:
            raise TypeError(f"Engine: {e}") from None
        self._runtime, self.tokenizer = launch_with_tokenizer(self.args)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="plait-engine", daemon=True)
        self._thread.start()
        self.tokenizer_manager = TokenizerManager(
            self.args, self.tokenizer, self._runtime.model_info, self._runtime.addrs, self._runtime.procs
        )
        self._call(self.tokenizer_manager.start())
        self._closed = False
        atexit.register(self.shutdown)  # an Engine never shut down still stops its children

    @property
    def model_info(self) -> dict[str, Any]:
        return dict(self._runtime.model_info)

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
        inputs, batched = _normalize(prompt, input_ids, sampling_params, return_logprob,
                                     logprob_start_len, top_logprobs_num, stream)
        if stream:
            if batched or len(inputs) != 1:
                raise ValueError("stream: streaming takes a single prompt with n = 1")
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
        inputs, batched = _normalize(prompt, input_ids, sampling_params, return_logprob,
                                     logprob_start_len, top_logprobs_num, stream)
        if stream:
            if batched or len(inputs) != 1:
                raise ValueError("stream: streaming takes a single prompt with n = 1")
            return self._astream(inputs[0])
        fut = asyncio.run_coroutine_threadsafe(self._generate_all(inputs), self._loop)
        outs = await asyncio.wrap_future(fut)
        return outs if batched else outs[0]

    async def _generate_all(self, inputs: list[GenerateInput]) -> list[dict]:
        tm = self.tokenizer_manager
        states = await asyncio.gather(*(tm.generate_one(i) for i in inputs), return_exceptions=True)
        for s in states:
            if isinstance(s, BaseException):
                raise _to_value_error(s)
        return [format_output(s, i.return_logprob) for s, i in zip(states, inputs)]

    def _stream(self, inp: GenerateInput) -> Iterator[dict]:
        agen = self.tokenizer_manager.generate(inp)
        sent_text, sent_ids = 0, 0
        try:
            while True:
                try:
                    state = self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                except RequestError as e:
                    raise _to_value_error(e) from None
                chunk = format_output(state, inp.return_logprob)
                chunk["text"] = state.text[sent_text:]
                chunk["output_ids"] = state.output_ids[sent_ids:]
                sent_text, sent_ids = len(state.text), len(state.output_ids)
                yield chunk
        finally:
            self._call(agen.aclose())

    async def _astream(self, inp: GenerateInput):
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
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self._call(self.tokenizer_manager.close(), timeout=5)
        except Exception:
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._runtime.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


def _to_value_error(e: BaseException) -> BaseException:
    if isinstance(e, RequestError):
        err = ValueError(str(e))
        err.status = e.status  # type: ignore[attr-defined]
        return err
    return e


def _normalize(prompt, input_ids, sampling_params, return_logprob, logprob_start_len,
               top_logprobs_num, stream) -> tuple[list[GenerateInput], bool]:
    if (prompt is None) == (input_ids is None):
        raise ValueError("prompt: give exactly one of prompt or input_ids")
    if prompt is not None:
        batched = isinstance(prompt, list)
        items = [("text", p) for p in (prompt if batched else [prompt])]
        if not all(isinstance(p, str) for _, p in items):
            raise ValueError("prompt: must be a string or a list of strings")
    else:
        batched = bool(input_ids) and isinstance(input_ids[0], list)
        items = [("input_ids", p) for p in (input_ids if batched else [input_ids])]
    if isinstance(sampling_params, list):
        if len(sampling_params) != len(items):
            raise ValueError("sampling_params: a list must have one entry per prompt")
        params = sampling_params
    else:
        params = [sampling_params] * len(items)
    inputs = []
    for (key, value), sp in zip(items, params):
        base = SamplingParams.from_dict(sp)
        for sub in expand_n(base):
            inputs.append(GenerateInput(
                **{key: value}, sampling_params=sub, return_logprob=return_logprob,
                logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num or 0,
                stream=stream,
            ))
    return inputs, batched or len(inputs) > len(items)


def expand_n(sp: SamplingParams) -> list[SamplingParams]:
    """n > 1 -> n requests with n = 1 (seed + i when seeded); they share the prompt's KV."""
    if sp.n == 1:
        return [sp]
    return [sp.replace(n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


def format_output(state: ReqState, return_logprob: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": state.finished_reason,
        "prompt_tokens": state.meta.get("prompt_tokens", state.prompt_tokens),
        "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
        "cached_tokens": state.meta.get("cached_tokens", 0),
    }
    if "forced_tokens" in state.meta:
        meta["forced_tokens"] = state.meta["forced_tokens"]
    if state.finished_reason and state.finished_reason.get("incomplete"):
        meta["incomplete"] = True
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in state.output_token_logprobs]
        meta["output_top_logprobs"] = [
            [[lp, tok, None] for lp, tok in row] for row in state.output_top_logprobs
        ]
        meta["input_token_logprobs"] = [
            [lp, tok, None] for lp, tok in (state.input_token_logprobs or [])
        ]
        meta["input_top_logprobs"] = [
            None if row is None else [[lp, tok, None] for lp, tok in row]
            for row in (state.input_top_logprobs or [])
        ]
    return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}
