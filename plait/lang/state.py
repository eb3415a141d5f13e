"""ProgramState: the `s` a program body receives and `run()` returns (SGLang's names).

Building (`s += ...`, roles, `fork`) never blocks. Reading blocks in sync code (`s["x"]`,
`s.text()`) and is awaited in async code (`await s.aget("x")`, `await s.atext()`); a blocking
read on the loop that runs the program raises instead of deadlocking.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from plait.lang.backends.base import Usage
from plait.lang.executor import BLOCKING_READ, Executor, await_on, on_loop
from plait.lang.ir import (
    ExprList,
    ForkPoint,
    Join,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    to_expr,
)

JOIN_MODES = ("gather_variable", "concate_and_append")


class ProgramState:
    def __init__(self, executor: Executor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None
        self.index: int | None = None  # position in the batch, for run_batch results

    # ------------------------------------------------------------------ building
    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(to_expr(other))
        return self

    def _role_common(self, role: str, expr: Any = None):
        if expr is not None:
            self.stream_executor.submit(ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)]))
            return None

        @contextmanager
        def scope():
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Any = None):
        return self._role_common("system", expr)

    def user(self, expr: Any = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Any = None):
        return self._role_common("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, number: int = 1, position_ids_offset: Any = None) -> ProgramStateGroup:
        """`number` branches starting from the text so far, which is committed to the runtime
        first (one prefill) so every branch reuses its KV cache."""
        if isinstance(number, bool) or not hasattr(number, "__index__"):
            raise TypeError(f"fork: number must be an integer, got {number!r}")
        number = operator.index(number)
        if number < 1:
            raise ValueError(f"fork: number must be >= 1, got {number}")
        ex = self.stream_executor
        children = [ex.child() for _ in range(number)]
        ex.submit(ForkPoint(children))
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextmanager
    def copy(self, position_ids_offset: Any = None):
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.variables[name] = value
        self.stream_executor.stale_names.discard(name)

    __setitem__ = set_var

    # ------------------------------------------------------------------ reading (sync)
    def get_var(self, name: str) -> Any:
        ex = self.stream_executor
        ex.wait_sync(ex.seq_for(name))
        return ex.read_var(name)

    __getitem__ = get_var

    def __contains__(self, name: str) -> bool:
        """`"x" in s`: whether variable x is set, once what would set it has run (without
        this, `in` falls back to `s[0]`, `s[1]`, ... and raises KeyError)."""
        ex = self.stream_executor
        ex.wait_sync(ex.seq_for(name))
        return name in ex.variables

    def get_meta_info(self, name: str) -> Any:
        ex = self.stream_executor
        ex.wait_sync(ex.seq_for(name))
        return ex.meta_info.get(name)

    def sync(self) -> None:
        """Wait until everything appended so far has run."""
        ex = self.stream_executor
        ex.wait_sync(ex.submitted)

    def text(self) -> str:
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return self.stream_executor.messages_

    def error(self) -> BaseException | None:
        """The exception that stopped the program (its body or a request), or None."""
        return self.stream_executor.error_

    @property
    def usage(self) -> Usage:
        """Tokens over every request this program (and its forks) made."""
        return self.stream_executor.usage

    # ------------------------------------------------------------------ reading (async)
    async def aget(self, name: str) -> Any:
        ex = self.stream_executor
        await ex.await_seq(ex.seq_for(name))
        return ex.read_var(name)

    async def aget_meta_info(self, name: str) -> Any:
        ex = self.stream_executor
        await ex.await_seq(ex.seq_for(name))
        return ex.meta_info.get(name)

    async def wait(self) -> None:
        """`sync()` for async code."""
        ex = self.stream_executor
        await ex.await_seq(ex.submitted)

    async def atext(self) -> str:
        await self.wait()
        return self.stream_executor.text_

    async def amessages(self) -> list[dict[str, str]]:
        await self.wait()
        return self.stream_executor.messages_

    # ------------------------------------------------------------------ streaming
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The program's text (or one variable's) piece by piece as it is generated (with
        run(stream=True); otherwise the whole text once it is complete)."""
        ex = self.stream_executor
        if on_loop(ex.loop):
            raise RuntimeError(BLOCKING_READ.replace("s.aget(name)", "s.text_async_iter()"))
        chunks = self._chunks(var_name, False)
        while True:
            try:
                yield asyncio.run_coroutine_threadsafe(_next(chunks), ex.loop).result()
            except StopAsyncIteration:
                return

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        ex = self.stream_executor
        chunks = self._chunks(var_name, return_meta_data)
        while True:
            try:
                yield await await_on(ex.loop, _next(chunks))
            except StopAsyncIteration:
                return

    async def _chunks(self, var_name: str | None, with_meta: bool) -> AsyncIterator[Any]:
        """Runs on the program's loop: new text each time the executor changes."""
        ex = self.stream_executor
        sent = 0
        while True:
            version = ex.version
            value = ex.text_ if var_name is None else ex.variables.get(var_name, "")
            if isinstance(value, list):
                raise ValueError(
                    f"text_iter({var_name!r}): the variable holds a list (one value per forked "
                    f"branch, gathered by join), not text to stream; read s[{var_name!r}], or "
                    "stream each branch's state")
            complete = ex.finished or (var_name is not None and ex.var_done(var_name))
            if isinstance(value, str) and len(value) > sent:
                chunk, sent = value[sent:], len(value)
                yield (chunk, ex.meta_info.get(var_name)) if with_meta else chunk
            if complete or ex.error_ is not None:
                return
            await ex.wait_change(version)

    def __repr__(self) -> str:
        ex = self.stream_executor
        return f"ProgramState(text={ex.text_!r}, error={ex.error_!r})"


class ProgramStateGroup:
    """The branches of `s.fork(n)`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state
        self.joined = False

    def join(self, mode: str = "gather_variable") -> None:
        """Back into the parent: `gather_variable` puts each variable the branches created into
        the parent as a list (one entry per branch); `concate_and_append` appends the text
        each branch added, in order. A fork joins once; its branches stay readable
        (`forks[i]["x"]`) but take no more expressions."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join: mode must be one of {', '.join(JOIN_MODES)}, got {mode!r}")
        if self.joined:
            raise ValueError(
                "join: this fork was already joined; call s.fork(n) again for more branches"
            )
        self.joined = True
        children = [s.stream_executor for s in self.states]
        until = [c.submitted for c in children]
        for i, child in enumerate(children):
            child.closed_reason = (
                f"fork: branch {i} was joined, so nothing appended to it would reach the "
                "parent; append to the parent state, or fork again"
            )
        self.src_state.stream_executor.submit(Join(children, until, mode))

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:
            raise ValueError("fork: assign a branch only to itself (forks[i] += ...)")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not hasattr(other, "exprs"):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"fork: {len(other)} expressions for {len(self.states)} branches")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            for state in self.states:
                state += other
        return self


async def _next(agen: AsyncIterator[Any]) -> Any:
    return await agen.__anext__()


Callback = Callable[[int], Any]
