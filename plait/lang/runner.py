"""Running programs: one call (sync or async), and batches with bounded concurrency.

Threads: sync entry points (`run`, `run_batch`) drive one shared background event loop
("plait-lang"); async ones run on the caller's loop. Async program bodies run on the loop
itself. Sync bodies run in the calling thread for `run()`, and otherwise in a small bounded
pool (at most MAX_BODY_THREADS threads), since they block on reads. No thread per program.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.lang.backends.base import Backend, Usage
from plait.lang.executor import Defaults, Executor, on_loop
from plait.lang.state import ProgramState
from plait.lang.tracer import BatchPlan, plan_batch

if TYPE_CHECKING:
    from plait.lang.program import Function

logger = logging.getLogger(__name__)

MAX_BODY_THREADS = 16  # sync program bodies in flight at once (each blocks a thread on reads)
AUTO_CONCURRENCY = 128  # num_threads="auto": programs in flight in a batch

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_body_pool: ThreadPoolExecutor | None = None


def interpreter_loop() -> asyncio.AbstractEventLoop:
    """The background loop that sync entry points run programs on (started on first use)."""
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="plait-lang", daemon=True).start()
            _loop = loop
        return _loop


def body_pool() -> ThreadPoolExecutor:
    """Shared pool for sync bodies outside batches (arun, stream=True)."""
    global _body_pool
    with _loop_lock:
        if _body_pool is None:
            _body_pool = ThreadPoolExecutor(MAX_BODY_THREADS, thread_name_prefix="plait-body")
        return _body_pool


def _blocking_entry(name: str) -> asyncio.AbstractEventLoop:
    loop = interpreter_loop()
    if on_loop(loop):
        raise RuntimeError(f"{name}() blocks; inside a program or coroutine use `await a{name}()`")
    return loop


# ---------------------------------------------------------------------- one program
def _body_sync(fn: Function, state: ProgramState, args: tuple, kwargs: dict) -> None:
    try:
        state.ret_value = fn.func(state, *args, **kwargs)
    except BaseException as e:
        state.stream_executor.fail(e)
        raise
    finally:
        state.stream_executor.end()


async def _body_async(fn: Function, state: ProgramState, args: tuple, kwargs: dict) -> None:
    try:
        state.ret_value = await fn.func(state, *args, **kwargs)
    except BaseException as e:
        state.stream_executor.fail(e)
        raise
    finally:
        state.stream_executor.end()


def _new_state(
    backend: Backend,
    kwargs: dict,
    defaults: Defaults,
    stream: bool,
    loop: asyncio.AbstractEventLoop,
) -> ProgramState:
    return ProgramState(
        Executor(backend, kwargs, defaults, stream=stream, loop=loop, usage=Usage())
    )


def run_program(
    fn: Function, backend: Backend, args: tuple, kwargs: dict, defaults: Defaults, stream: bool
) -> ProgramState:
    loop = _blocking_entry("run")
    state = _new_state(backend, kwargs, defaults, stream, loop)
    if fn.is_async:
        future = asyncio.run_coroutine_threadsafe(_body_async(fn, state, args, kwargs), loop)
        if stream:
            return state
        future.result()
    elif stream:
        body_pool().submit(_body_sync, fn, state, args, kwargs)
        return state
    else:
        _body_sync(fn, state, args, kwargs)
    state.sync()
    return state


async def arun_program(
    fn: Function, backend: Backend, args: tuple, kwargs: dict, defaults: Defaults, stream: bool
) -> ProgramState:
    loop = asyncio.get_running_loop()
    state = _new_state(backend, kwargs, defaults, stream, loop)
    if fn.is_async:
        body = _body_async(fn, state, args, kwargs)
    else:
        body = loop.run_in_executor(body_pool(), _body_sync, fn, state, args, kwargs)
    if stream:
        state._body_task = asyncio.ensure_future(body)  # kept alive by the state
        return state
    await body
    await state.wait()
    return state


# ---------------------------------------------------------------------- batches
@dataclass
class BatchSummary:
    num_items: int = 0
    num_failed: int = 0
    wall_time_s: float = 0.0
    usage: Usage = field(default_factory=Usage)
    common_prefix_chars: int = 0
    prefix_groups: int = 0

    @property
    def cached_token_fraction(self) -> float:
        """Prompt tokens served from the prefix cache / all prompt tokens, over every request
        of the batch (the prefix prefills included)."""
        return self.usage.cached_token_fraction

    def __str__(self) -> str:
        u = self.usage
        return (
            f"{self.num_items} programs ({self.num_failed} failed) in {self.wall_time_s:.2f} s: "
            f"{u.requests} requests, {u.prompt_tokens} prompt tokens "
            f"({self.cached_token_fraction:.1%} cached), {u.completion_tokens} generated"
        )


class BatchResult(list):
    """run_batch's states in input order, with `.summary` (a BatchSummary)."""

    summary: BatchSummary


@dataclass
class BatchConfig:
    backend: Backend
    defaults: Defaults
    concurrency: int
    progress_bar: bool = False
    plan_prefix: bool = True


def resolve_concurrency(num_threads: int | str, max_concurrency: int | None, n: int) -> int:
    value = max_concurrency if max_concurrency is not None else num_threads
    if value == "auto":
        value = AUTO_CONCURRENCY
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"num_threads/max_concurrency: must be a positive integer or 'auto', got {value!r}"
        )
    return max(1, min(value, n))


async def iter_batch(
    fn: Function, items: list[dict[str, Any]], cfg: BatchConfig, summary: BatchSummary
) -> AsyncIterator[ProgramState]:
    """Runs the items with at most cfg.concurrency in flight; yields each state as it
    finishes (`state.index` is its position in `items`). A failing item is a state whose
    error() is set; the batch goes on."""
    start = time.perf_counter()
    loop = asyncio.get_running_loop()
    summary.num_items = len(items)
    plan = await _plan(fn, items, cfg, summary)
    pool = (
        None
        if fn.is_async
        else ThreadPoolExecutor(
            min(cfg.concurrency, MAX_BODY_THREADS), thread_name_prefix="plait-batch"
        )
    )
    group_commits: dict[str, asyncio.Future] = {}
    pbar = _progress_bar(len(items)) if cfg.progress_bar else None
    results: asyncio.Queue = asyncio.Queue()
    pending = iter(plan.order)

    async def worker() -> None:
        for index in pending:  # workers share one iterator: items start in plan order
            prefix = plan.group_prefix.get(index)
            if prefix:
                await _group_commit(prefix, group_commits, cfg.backend, summary)
            state = await _run_item(fn, items[index], cfg, loop, pool)
            state.index = index
            results.put_nowait(state)

    workers = [asyncio.ensure_future(worker()) for _ in range(min(cfg.concurrency, len(items)))]
    try:
        for _ in range(len(items)):
            state = await results.get()
            summary.usage.merge(state.usage)
            summary.num_failed += state.error() is not None
            if pbar is not None:
                pbar.update()
            yield state
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        if pool is not None:
            pool.shutdown(wait=False)
        if pbar is not None:
            pbar.close()
        summary.wall_time_s = time.perf_counter() - start


async def _plan(
    fn: Function, items: list[dict[str, Any]], cfg: BatchConfig, summary: BatchSummary
) -> BatchPlan:
    if not cfg.plan_prefix or len(items) < 2:
        return BatchPlan(list(range(len(items))))
    plan = plan_batch(fn, cfg.backend, items)
    summary.prefix_groups = plan.num_groups
    if plan.common_prefix:
        summary.common_prefix_chars = len(plan.common_prefix)
        await _cache(cfg.backend, plan.common_prefix, summary)
    return plan


async def _cache(backend: Backend, text: str, summary: BatchSummary) -> None:
    try:
        summary.usage.add(await backend.cache_prefix(None, text))
    except Exception as e:  # an optimization: the items still run without it
        logger.warning("caching a shared prefix failed: %s: %s", type(e).__name__, e)


async def _group_commit(
    prefix: str, commits: dict[str, asyncio.Future], backend: Backend, summary: BatchSummary
) -> None:
    if prefix not in commits:
        commits[prefix] = asyncio.ensure_future(_cache(backend, prefix, summary))
    await asyncio.shield(commits[prefix])


async def _run_item(
    fn: Function,
    kwargs: dict[str, Any],
    cfg: BatchConfig,
    loop: asyncio.AbstractEventLoop,
    pool: ThreadPoolExecutor | None,
) -> ProgramState:
    state = _new_state(cfg.backend, kwargs, cfg.defaults, False, loop)
    ex = state.stream_executor
    try:
        if fn.is_async:
            await _body_async(fn, state, (), kwargs)
        else:
            await loop.run_in_executor(pool, functools.partial(_body_sync, fn, state, (), kwargs))
    except Exception:
        pass  # recorded on the state by the body wrapper
    await ex.wait_seq(ex.submitted)
    return state


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="programs", unit="prog")
