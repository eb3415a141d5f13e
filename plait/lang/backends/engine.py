"""EngineBackend: programs on an in-process `plait.Engine` (no HTTP).

    backend = EngineBackend(plait.Engine(model_path))  # or EngineBackend(model_path, **args)
    pl.set_default_backend(backend)

`engine.async_generate` hops to the engine's own loop, so programs may run on any loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from plait.io_struct import GenerateInput
from plait.lang.backends.base import BackendError
from plait.lang.backends.native import NativeBackend
from plait.lang.chat_template import ChatTemplate

_LOGPROB_KEYS = ("input_token_logprobs", "output_token_logprobs")


class EngineBackend(NativeBackend):
    name = "engine"

    def __init__(
        self,
        engine: Any = None,
        *,
        chat_template: str | None = None,
        **server_args: Any,
    ) -> None:
        """`engine`: a plait.Engine, or a model path (None: the default model, SmolLM2) for
        an Engine this backend starts with `server_args` and stops in shutdown()."""
        from plait.engine import Engine

        self._owns_engine = not isinstance(engine, Engine)
        if self._owns_engine:
            engine = Engine(engine, **server_args)
        elif server_args:
            raise TypeError("EngineBackend: server arguments go to the Engine you pass, not here")
        self.engine = engine
        template = ChatTemplate.from_tokenizer(engine.tokenizer, chat_template)
        super().__init__(tokenizer=engine.tokenizer, chat_template=template)

    async def request(self, inp: GenerateInput) -> dict[str, Any] | list[dict[str, Any]]:
        try:
            out = await self.engine.async_generate(**_engine_kwargs(inp))
        except ValueError as e:
            raise BackendError(f"engine: {e}", getattr(e, "status", None)) from e
        if inp.return_text_in_logprobs:
            for o in out if isinstance(out, list) else [out]:
                self._add_token_texts(o["meta_info"])
        return out

    async def request_stream(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        try:
            chunks = await self.engine.async_generate(**_engine_kwargs(inp), stream=True)
            text = ""
            async for chunk in chunks:
                text += chunk["text"]  # the engine streams increments; the protocol is cumulative
                yield {**chunk, "text": text}
        except ValueError as e:
            raise BackendError(f"engine: {e}", getattr(e, "status", None)) from e

    def _add_token_texts(self, meta: dict[str, Any]) -> None:
        for key in _LOGPROB_KEYS:
            if key in meta:
                meta[key] = [self._with_text(e) for e in meta[key]]

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()


def _engine_kwargs(inp: GenerateInput) -> dict[str, Any]:
    """The Engine's arguments (it builds the same GenerateInput and normalizes it)."""
    return {
        "prompt": inp.text,
        "input_ids": inp.input_ids,
        "sampling_params": inp.sampling_params,
        "return_logprob": bool(inp.return_logprob),
        "logprob_start_len": inp.logprob_start_len,
        "top_logprobs_num": inp.top_logprobs_num,
    }
