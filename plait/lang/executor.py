"""The interpreter: runs one program state's expressions, in order, on an asyncio loop.

`s += expr` never waits: it numbers the expression and queues it on the state's loop, where a
drain task runs the queue one expression after another (a task while there is work, nothing
when idle: no thread per state). A read (`s["x"]`, `await s.aget("x")`) waits until the
expression that sets x has run, or, for a name no queued expression sets (variables gathered
by a join), until everything queued before the read has run. A sync program body runs in a
worker thread and blocks on such reads; an async body awaits them on the loop.

`fork` is queued like any expression: when the parent reaches it, it commits its text (one
prefill) and only then releases the children, whose own queues wait behind that gate; so
branches start from a cached prefix and the program body never blocks to fork.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from plait.lang.backends.base import Backend, LogprobOptions, Usage
from plait.lang.chat_template import ChatTemplate
from plait.lang.ir import (
    DTYPE_REGEX,
    CommitLazy,
    Constant,
    Expr,
    ExprList,
    ForkPoint,
    Gen,
    Join,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    names_defined,
)
from plait.sampling import SamplingParams

logger = logging.getLogger(__name__)

BLOCKING_READ = (
    "this would block the event loop the program runs on: in an `async def` program (or any "
    "coroutine) use `await s.aget(name)`, `await s.atext()`, `await s.wait()`"
)


class ProgramError(RuntimeError):
    """A read of a program whose execution failed (the cause is chained)."""


@dataclass
class Defaults:
    """run()'s sampling defaults: SamplingParams fields and logprob options."""

    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)


def on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class TextState:
    """What a program's state is without a model: text, variables, messages and roles."""

    def __init__(self, chat_template: ChatTemplate | None = None) -> None:
        self.text_ = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages_: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self._chat_template = chat_template

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = self._load_chat_template()
        return self._chat_template

    def _load_chat_template(self) -> ChatTemplate:
        raise ValueError("roles need a chat template")

    def execute_local(self, expr: Expr) -> bool:
        """Run `expr` if it needs no model; False if it does."""
        if isinstance(expr, Constant):
            self.fill(expr.value)
        elif isinstance(expr, RoleBegin):
            self.role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self.role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self.variables[expr.name] = self.text_[self.variables[expr.name] :]
        else:
            return False
        return True

    def fill(self, value: str) -> None:
        self.text_ += value

    def role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(
                f"role {role!r} begins inside role {self.cur_role!r}: roles do not nest"
            )
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self.fill(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the current role is {self.cur_role!r}")
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None
        self.cur_role_begin_pos = None


class Executor(TextState):
    """One program state (SGLang's StreamExecutor) bound to an event loop."""

    def __init__(
        self,
        backend: Backend,
        arguments: dict[str, Any],
        defaults: Defaults,
        *,
        stream: bool,
        loop: asyncio.AbstractEventLoop,
        usage: Usage,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.defaults = defaults
        self.stream = stream
        self.loop = loop
        self.usage = usage  # shared by the program's forks
        self.error_: BaseException | None = None
        self.committed_len = 0  # text_[:committed_len] was last sent to the backend whole
        self.fork_start_text_pos: int | None = None
        self.closed_reason: str | None = None  # a joined branch: why nothing more may be added
        self.stale_names: set[str] = set()  # set again by joined branches, not gathered
        # ordering: expressions are numbered 1, 2, ... as submitted; `done` is the last run
        self._seq = itertools.count(1)
        self.submitted = 0
        self.done = 0
        self._var_seq: dict[str, int] = {}
        self._pending: deque[tuple[int, Expr]] = deque()
        self._drain_task: asyncio.Task | None = None
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._gate_open = not gated
        self._gate: asyncio.Future | None = None
        self._ended = False
        self.finished = False
        self.version = 0  # bumped on every change (streaming readers wait on it)
        self._change_waiters: list[asyncio.Future] = []

    def _load_chat_template(self) -> ChatTemplate:
        return self.backend.get_chat_template()

    # ------------------------------------------------------------------ caller side (any thread)
    def submit(self, expr: Expr) -> None:
        if self.closed_reason is not None:
            raise ValueError(self.closed_reason)
        seq = next(self._seq)
        self.submitted = seq
        for name in names_defined(expr):
            self._var_seq[name] = seq
        self.call_soon(self._enqueue, seq, expr)

    def seq_for(self, name: str | None) -> int:
        """What a read of `name` waits for."""
        return self._var_seq.get(name, self.submitted) if name is not None else self.submitted

    def var_done(self, name: str) -> bool:
        """An expression setting `name` was submitted and has run."""
        return name in self._var_seq and self.done >= self._var_seq[name]

    def end(self) -> None:
        """The program body returned: nothing more will be submitted."""
        self.call_soon(self._end)

    def fail(self, error: BaseException) -> None:
        """Record a failure (the body raised): queued expressions are skipped."""
        if self.error_ is None:
            self.error_ = error

    def child(self) -> Executor:
        """A fork branch: it starts when this executor reaches the ForkPoint."""
        return Executor(
            self.backend,
            self.arguments,
            self.defaults,
            stream=self.stream,
            loop=self.loop,
            usage=self.usage,
            gated=True,
        )

    def call_soon(self, fn, *args) -> None:
        if on_loop(self.loop):
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def wait_sync(self, seq: int) -> None:
        """Block this (non-loop) thread until expression `seq` has run."""
        if self.done >= seq:
            return
        if on_loop(self.loop):
            raise RuntimeError(BLOCKING_READ)
        asyncio.run_coroutine_threadsafe(self.wait_seq(seq), self.loop).result()

    async def await_seq(self, seq: int) -> None:
        """Wait for expression `seq` from any event loop."""
        if self.done >= seq:
            return
        await await_on(self.loop, self.wait_seq(seq))

    def read_var(self, name: str) -> Any:
        if name in self.stale_names:
            self.stale_names.discard(name)
            logger.warning(
                "variable %r: a join did not gather the branches' new values, since the "
                "program already had it (SGLang's rule); this is the value from before the "
                "fork: read forks[i][%r], or give the branches' variable a new name",
                name,
                name,
            )
        if name in self.variables:
            return self.variables[name]
        if self.error_ is not None:
            raise ProgramError(
                f"variable {name!r} was not set: the program failed "
                f"({type(self.error_).__name__}: {self.error_})"
            ) from self.error_
        raise KeyError(name)

    # ------------------------------------------------------------------ loop side
    async def wait_seq(self, seq: int) -> None:
        if self.done >= seq:
            return
        fut = self.loop.create_future()
        self._waiters.append((seq, fut))
        await fut

    async def wait_change(self, version: int) -> None:
        if self.version != version or self.finished:
            return
        fut = self.loop.create_future()
        self._change_waiters.append(fut)
        await fut

    def _enqueue(self, seq: int, expr: Expr) -> None:
        self._pending.append((seq, expr))
        if self._drain_task is None:
            self._drain_task = self.loop.create_task(self._drain())

    def _end(self) -> None:
        self._ended = True
        if self._drain_task is None:
            self._finish()

    def _open_gate(self) -> None:
        self._gate_open = True
        if self._gate is not None and not self._gate.done():
            self._gate.set_result(None)

    async def _drain(self) -> None:
        try:
            if not self._gate_open:
                self._gate = self.loop.create_future()
                await self._gate
            while self._pending:
                seq, expr = self._pending.popleft()
                await self._run_one(expr)
                self.done = seq
                self._wake()
        finally:
            self._drain_task = None
            if self._ended and not self._pending:
                self._finish()

    async def _run_one(self, expr: Expr) -> None:
        if self.error_ is not None:
            if isinstance(expr, ForkPoint):  # its children would wait forever
                self._abort_children(expr.children, self.error_)
            return
        try:
            await self._execute(expr)
        except Exception as e:
            if self.error_ is None:
                logger.warning("program %s failed: %s: %s", self.sid[:8], type(e).__name__, e)
                self.error_ = e
            if isinstance(expr, ForkPoint):
                self._abort_children(expr.children, e)

    def _wake(self) -> None:
        keep = []
        for seq, fut in self._waiters:
            if seq <= self.done:
                if not fut.done():
                    fut.set_result(None)
            else:
                keep.append((seq, fut))
        self._waiters = keep
        self._notify()

    def _notify(self) -> None:
        self.version += 1
        waiters, self._change_waiters = self._change_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def _finish(self) -> None:
        self.finished = True
        self._notify()

    # ------------------------------------------------------------------ expressions
    async def _execute(self, expr: Expr) -> None:
        self.stale_names.difference_update(names_defined(expr))
        if self.execute_local(expr):
            pass
        elif isinstance(expr, ExprList):
            for sub in expr.exprs:
                await self._execute(sub)
        elif isinstance(expr, Gen):
            await self._execute_gen(expr)
        elif isinstance(expr, Select):
            await self._execute_select(expr)
        elif isinstance(expr, CommitLazy):
            await self.commit()
        elif isinstance(expr, ForkPoint):
            await self._execute_fork(expr)
        elif isinstance(expr, Join):
            await self._execute_join(expr)
        else:
            raise TypeError(f"unknown expression {type(expr).__name__}")
        self._notify()

    def resolve_sampling(self, expr: Gen) -> tuple[SamplingParams, LogprobOptions]:
        """run()'s defaults overridden by the gen's own fields, as one SamplingParams."""
        fields = {**self.defaults.sampling, **expr.sampling}
        if expr.dtype is not None:
            fields["regex"] = DTYPE_REGEX[expr.dtype]
            if expr.dtype in (int, "int", float, "float"):  # `14` ends where the model writes `.`
                fields.setdefault("end_on_exit", True)
        if self.cur_role is not None and self._chat_template is not None:
            stops = list(fields.get("stop_token_ids") or [])
            fields["stop_token_ids"] = stops + [
                t for t in self._chat_template.stop_token_ids if t not in stops
            ]
        try:
            params = SamplingParams.from_dict(fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"gen({expr.name!r}): {e}") from None
        return params, LogprobOptions.from_dict({**self.defaults.logprobs, **expr.logprobs})

    async def _execute_gen(self, expr: Gen) -> None:
        params, options = self.resolve_sampling(expr)
        name = expr.name
        if self.stream:
            self.variables[name] = ""
            async for delta, meta in self.backend.generate_stream(self, params, options):
                self.text_ += delta
                self.variables[name] += delta
                self.meta_info[name] = meta
                self._notify()
        else:
            result = await self.backend.generate(self, params, options)
            text = result.text
            self.text_ += text[0] if isinstance(text, list) else text
            self.variables[name] = text
            self.meta_info[name] = result.meta_info
        self.committed_len = len(self.text_)  # prompt + output are in the runtime's cache

    async def _execute_select(self, expr: Select) -> None:
        decision = await self.backend.select(
            self, expr.choices, expr.temperature, expr.choices_method
        )
        self.text_ += decision.decision
        if expr.name is not None:
            self.variables[expr.name] = decision.decision
            self.meta_info[expr.name] = decision.meta_info
        self.committed_len = len(self.text_)  # text + decision was one of the scored prompts

    async def commit(self) -> None:
        """Prefill the text so far once (SGLang's commit_lazy_operations)."""
        if len(self.text_) > self.committed_len:
            await self.backend.cache_prefix(self, self.text_)
            self.committed_len = len(self.text_)

    async def _execute_fork(self, expr: ForkPoint) -> None:
        if len(expr.children) > 1:
            await self.commit()
        for child in expr.children:
            child._start_from(self)

    def _start_from(self, parent: Executor) -> None:
        self.text_ = parent.text_
        self.variables = dict(parent.variables)
        self.meta_info = dict(parent.meta_info)
        self.messages_ = list(parent.messages_)
        self.cur_role = parent.cur_role
        self.cur_role_begin_pos = parent.cur_role_begin_pos
        self._chat_template = parent._chat_template
        self.committed_len = parent.committed_len
        self.fork_start_text_pos = len(parent.text_)
        self._open_gate()

    def _abort_children(self, children: list[Executor], error: BaseException) -> None:
        for child in children:
            child.fail(error)
            child._open_gate()

    async def _execute_join(self, expr: Join) -> None:
        for child, until in zip(expr.children, expr.until):
            await child.wait_seq(until)
        for child in expr.children:
            child._end()
        failed = next((c.error_ for c in expr.children if c.error_ is not None), None)
        if failed is not None:
            raise ProgramError(
                f"a forked branch failed: {type(failed).__name__}: {failed}"
            ) from failed
        if expr.mode == "gather_variable":
            before = set(self.variables)
            # SGLang's rule, kept: only names new to the parent are gathered; a read of one
            # the branches set again warns (stale_names)
            self.stale_names |= {n for c in expr.children for n in c._var_seq} & before
            for child in expr.children:
                for name, value in child.variables.items():
                    if name not in before:
                        self.variables.setdefault(name, []).append(value)
                        self.meta_info.setdefault(name, []).append(child.meta_info.get(name))
        else:  # concate_and_append: the branches' new text, in order (as text: no KV splicing)
            for child in expr.children:
                self.fill(child.text_[child.fork_start_text_pos :])


async def await_on(loop: asyncio.AbstractEventLoop, coro) -> Any:
    """Await a coroutine that must run on `loop`, from whichever loop is running."""
    if on_loop(loop):
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))
