"""Function: what `@pl.function` makes (SGLang's SglFunction), with sync and async entry points.

    @pl.function
    def qa(s, question):
        s += "Q: " + question + "\\nA: " + pl.gen("answer", max_tokens=32, stop="\\n")

    state = qa.run(question="...", temperature=0)              # sync
    state = await qa.arun(question="...")                      # async
    states = qa.run_batch([{"question": q} for q in qs], progress_bar=True)
    states = await qa.arun_batch(...)
    for state in qa.run_batch_iter(...): ...                   # as they finish
    async for state in qa.arun_batch_iter(...): ...

Keyword arguments that are sampling parameters (SamplingParams names, or max_tokens /
min_tokens, and the logprob options) are defaults for every gen of the call, unless the
program itself has a parameter of that name.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

from plait.lang.backends.base import Backend
from plait.lang.backends.default import resolve_backend
from plait.lang.executor import Defaults
from plait.lang.ir import is_sampling_kwarg, split_sampling_kwargs
from plait.lang.runner import (
    BatchConfig,
    BatchResult,
    BatchSummary,
    _blocking_entry,
    arun_program,
    iter_batch,
    resolve_concurrency,
    run_program,
)
from plait.lang.state import ProgramState
from plait.lang.tracer import TracerState
from plait.sampling import SamplingParams


class Function:
    def __init__(
        self,
        func,
        bind_arguments: dict[str, Any] | None = None,
        num_api_spec_tokens: int | None = None,
    ) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].kind not in (
            params[0].POSITIONAL_ONLY,
            params[0].POSITIONAL_OR_KEYWORD,
        ):
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state `s`")
        self.func = func
        self.is_async = inspect.iscoroutinefunction(func)
        self.arg_names = [p.name for p in params[1:]]
        self.bind_arguments = dict(bind_arguments or {})
        self.num_api_spec_tokens = num_api_spec_tokens
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Function:
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"{self.__name__}.bind: no parameter {unknown[0]!r}")
        return Function(self.func, {**self.bind_arguments, **kwargs}, self.num_api_spec_tokens)

    # ------------------------------------------------------------------ one call
    def run(
        self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any
    ) -> ProgramState:
        """Run once and return the finished state (with stream=True: return at once; read it
        with state.text_iter()). An exception in the body is raised; a failed request is
        on state.error()."""
        program_args, defaults = self._split(kwargs)
        return run_program(self, resolve_backend(backend), args, program_args, defaults, stream)

    async def arun(
        self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any
    ) -> ProgramState:
        program_args, defaults = self._split(kwargs)
        backend = resolve_backend(backend)
        return await arun_program(self, backend, args, program_args, defaults, stream)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """`prog(...)` is `prog.run(...)`; inside a program, `prog(s, ...)` on a state runs
        prog's body on that state (a sub-program: its text and variables go to `s`) and
        returns what the body returns (a coroutine to await for an `async def` body)."""
        if args and isinstance(args[0], (ProgramState, TracerState)):
            return self.func(args[0], *args[1:], **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    # ------------------------------------------------------------------ batches
    def run_batch(
        self,
        batch_kwargs: list,
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        max_concurrency: int | None = None,
        progress_bar: bool = False,
        plan_prefix: bool = True,
        **sampling: Any,
    ) -> BatchResult:
        """Run every item (a dict of arguments, or a list/tuple of positional ones); states in
        input order with `.summary`. At most `num_threads` (alias `max_concurrency`) programs
        are in flight; a failing item's error is on its state and the batch goes on.
        `plan_prefix` traces the items to prefill their shared prefixes once first (each body
        runs up to its first model call on a deep copy of its arguments)."""
        loop = _blocking_entry("run_batch")
        coro = self.arun_batch(
            batch_kwargs,
            backend=backend,
            num_threads=num_threads,
            max_concurrency=max_concurrency,
            progress_bar=progress_bar,
            plan_prefix=plan_prefix,
            **sampling,
        )
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    async def arun_batch(
        self,
        batch_kwargs: list,
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        max_concurrency: int | None = None,
        progress_bar: bool = False,
        plan_prefix: bool = True,
        **sampling: Any,
    ) -> BatchResult:
        items = self._batch_items(batch_kwargs)
        out: list[ProgramState | None] = [None] * len(items)
        summary = BatchSummary()
        cfg = self._batch_config(
            backend, len(items), num_threads, max_concurrency, progress_bar, plan_prefix, sampling
        )
        async for state in iter_batch(self, items, cfg, summary):
            out[state.index] = state
        result = BatchResult(out)
        result.summary = summary
        return result

    def run_batch_iter(self, batch_kwargs: list, **options: Any) -> Iterator[ProgramState]:
        """run_batch, yielding states as they finish (`state.index`: position in the input)."""
        loop = _blocking_entry("run_batch_iter")
        agen = self.arun_batch_iter(batch_kwargs, **options)
        try:
            while True:
                try:
                    yield asyncio.run_coroutine_threadsafe(_next(agen), loop).result()
                except StopAsyncIteration:
                    return
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), loop).result()

    async def arun_batch_iter(
        self,
        batch_kwargs: list,
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        max_concurrency: int | None = None,
        progress_bar: bool = False,
        plan_prefix: bool = True,
        summary: BatchSummary | None = None,
        **sampling: Any,
    ) -> AsyncIterator[ProgramState]:
        items = self._batch_items(batch_kwargs)
        cfg = self._batch_config(
            backend, len(items), num_threads, max_concurrency, progress_bar, plan_prefix, sampling
        )
        async for state in iter_batch(self, items, cfg, summary or BatchSummary()):
            yield state

    # ------------------------------------------------------------------ helpers
    def _split(self, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Defaults]:
        program_args = dict(self.bind_arguments)
        sampling = {}
        for key, value in kwargs.items():
            if key not in self.arg_names and is_sampling_kwarg(key):
                sampling[key] = value
            else:
                program_args[key] = value
        return program_args, _defaults(sampling)

    def _batch_items(self, batch_kwargs: list) -> list[dict[str, Any]]:
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(
                "run_batch: batch_kwargs must be a list of dicts (or of argument lists)"
            )
        items = []
        for i, item in enumerate(batch_kwargs):
            if isinstance(item, (list, tuple)):
                if len(item) > len(self.arg_names):
                    raise TypeError(
                        f"run_batch: item {i} has {len(item)} arguments, "
                        f"{self.__name__} takes {len(self.arg_names)}"
                    )
                item = dict(zip(self.arg_names, item))
            elif not isinstance(item, dict):
                raise TypeError(f"run_batch: item {i} is a {type(item).__name__}, not a dict")
            items.append({**self.bind_arguments, **item})
        return items

    def _batch_config(
        self, backend, n, num_threads, max_concurrency, progress_bar, plan_prefix, sampling
    ) -> BatchConfig:
        return BatchConfig(
            backend=resolve_backend(backend),
            defaults=_defaults(sampling),
            concurrency=resolve_concurrency(num_threads, max_concurrency, max(n, 1)),
            progress_bar=progress_bar,
            plan_prefix=plan_prefix,
        )

    def __repr__(self) -> str:
        return f"<plait function {self.__name__}>"


def _defaults(sampling: dict[str, Any]) -> Defaults:
    fields, logprobs = split_sampling_kwargs(sampling)
    SamplingParams.from_dict(fields)  # a bad default fails here, at the call
    return Defaults(fields, logprobs)


async def _next(agen: AsyncIterator[Any]) -> Any:
    return await agen.__anext__()
