"""Prefix tracing and batch planning.

`trace_prefix` runs a program body against a TracerState that executes only what needs no
model (text, roles, variable scopes) and stops at the first gen/select/fork/read: the text
built up to there is the static prefix of that call. `plan_batch` traces every item of a
batch, orders the items by prefix (so items sharing a long prefix run side by side), and
finds the prefix common to all items, and the longer prefixes shared by runs of adjacent
items, to prefill once each before the items that share them.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.lang.executor import TextState
from plait.lang.ir import Expr, ExprList, to_expr
from plait.matching import common_prefix_len

if TYPE_CHECKING:
    from plait.lang.backends.base import Backend
    from plait.lang.program import Function

# A prefix worth prefilling on its own: shorter ones cost a round trip for little reuse.
MIN_PREFIX_CHARS = 64
# A group prefix must extend the common prefix by this much to get its own prefill.
MIN_GROUP_EXTRA_CHARS = 64
_WORD_START = re.compile(r"\s+\S*$")


class StopTracing(Exception):
    """The traced program reached something that needs the model."""


class TracerState(TextState):
    """Stands in for ProgramState while tracing."""

    def __init__(self, backend: Backend) -> None:
        super().__init__()
        self._backend = backend

    def _load_chat_template(self):
        return self._backend.get_chat_template()

    def __iadd__(self, other: Any) -> TracerState:
        self._run(to_expr(other))
        return self

    def _run(self, expr: Expr) -> None:
        if isinstance(expr, ExprList):
            for sub in expr.exprs:
                self._run(sub)
        elif not self.execute_local(expr):
            raise StopTracing()

    def _role(self, role: str, expr: Any = None):
        from contextlib import contextmanager

        from plait.lang.ir import role_exprs

        if expr is not None:
            self._run(role_exprs(role, expr))
            return None

        @contextmanager
        def scope():
            self._run(role_exprs(role).exprs[0])
            yield
            self._run(role_exprs(role).exprs[1])

        return scope()

    def system(self, expr: Any = None):
        return self._role("system", expr)

    def user(self, expr: Any = None):
        return self._role("user", expr)

    def assistant(self, expr: Any = None):
        return self._role("assistant", expr)

    def __getattr__(self, name: str):
        # any other use of the state (reads, fork, var_scope, ...) ends the trace
        raise StopTracing()

    def __getitem__(self, name: str):
        raise StopTracing()


def trace_prefix(fn: Function, backend: Backend, kwargs: dict[str, Any]) -> str:
    """The text a call of `fn` builds before it first needs the model. The body runs on a deep
    copy of the arguments, so one that updates them (`history.append(...)`) does so once, in
    its real run; arguments that cannot be copied are not traced (no shared prefix)."""
    try:
        kwargs = copy.deepcopy(kwargs)
    except Exception:  # noqa: BLE001 - any argument deepcopy refuses: trace nothing
        return ""
    state = TracerState(backend)
    try:
        if fn.is_async:
            coro = fn.func(state, **kwargs)
            try:
                coro.send(None)  # runs up to the first real await (or StopTracing)
            except StopIteration:
                pass
            finally:
                coro.close()
        else:
            fn.func(state, **kwargs)
    except Exception:  # StopTracing, or the body needed a generated value
        pass
    return state.text_


@dataclass
class BatchPlan:
    order: list[int]  # item indices in the order to start them
    common_prefix: str = ""  # shared by every item: prefilled once before the batch
    group_prefix: dict[int, str] = field(default_factory=dict)  # item -> prefix of its group
    num_groups: int = 0


def plan_batch(fn: Function, backend: Backend, items: list[dict[str, Any]]) -> BatchPlan:
    prefixes = [trace_prefix(fn, backend, kwargs) for kwargs in items]
    order = sorted(range(len(items)), key=prefixes.__getitem__)
    if len(order) < 2:
        return BatchPlan(order)
    common = prefixes[order[0]][: common_prefix_len(prefixes[order[0]], prefixes[order[-1]])]
    plan = BatchPlan(order, _word_boundary(common))
    if len(plan.common_prefix) < MIN_PREFIX_CHARS:
        plan.common_prefix = ""
    floor = len(common) + MIN_GROUP_EXTRA_CHARS
    start, shared = 0, len(prefixes[order[0]])
    for j in range(1, len(order) + 1):
        lcp = -1
        if j < len(order):
            lcp = common_prefix_len(prefixes[order[j - 1]], prefixes[order[j]])
        if min(shared, lcp) >= floor:
            shared = min(shared, lcp)
            continue
        if j - start >= 2 and shared >= floor:
            prefix = _word_boundary(prefixes[order[start]][:shared])
            plan.num_groups += 1
            for k in order[start:j]:
                plan.group_prefix[k] = prefix
        start, shared = j, len(prefixes[order[j]]) if j < len(order) else 0
    return plan


def _word_boundary(prefix: str) -> str:
    """Cut a shared prefix before its last partial word: the items' prompts tokenize the text
    after it differently (" word" is one token), so only whole tokens can be reused."""
    match = _WORD_START.search(prefix)
    return prefix[: match.start()] if match else prefix
