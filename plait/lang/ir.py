"""The expressions of the language (SGLang's IR, without the `Sgl` prefix).

Programs build expressions with `gen`, `select`, roles and string concatenation and append
them to a state with `s += expr`; the interpreter (`executor.py`) runs them in order. Each
expression is a plain object compared by identity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.errors import RequestError
from plait.lang.choices import ChoicesSamplingMethod
from plait.sampling import MAX_INT, SamplingParams

if TYPE_CHECKING:
    from plait.lang.executor import Executor

# dtype -> the regex that constrains a gen to it (SGLang's REGEX_INT, ...)
REGEX_INT = r"[-+]?[0-9]+"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
DTYPE_REGEX = {
    int: REGEX_INT,
    "int": REGEX_INT,
    float: REGEX_FLOAT,
    "float": REGEX_FLOAT,
    bool: REGEX_BOOL,
    "bool": REGEX_BOOL,
    str: REGEX_STR,
    "str": REGEX_STR,
}

# Request options of a gen that are not sampling parameters (SGLang passes them beside).
LOGPROB_FIELDS = (
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
)
# SGLang's DSL names -> SamplingParams' names
SAMPLING_ALIASES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
GEN_ARG_NAMES = {v: k for k, v in SAMPLING_ALIASES.items()}
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class Expr:
    """Base of all expressions; `a + b` builds an ExprList, strings become Constants."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList.concat(self, to_expr(other))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList.concat(to_expr(other), self)


def to_expr(value: Any) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(
        f"cannot append a {type(value).__name__} to a program: append a str or an expression "
        "(gen, select, a role, ...); convert values with str()"
    )


@dataclass(eq=False)
class Constant(Expr):
    value: str


@dataclass(eq=False)
class ExprList(Expr):
    exprs: list[Expr]

    @staticmethod
    def concat(a: Expr, b: Expr) -> ExprList:
        left = a.exprs if isinstance(a, ExprList) else [a]
        right = b.exprs if isinstance(b, ExprList) else [b]
        return ExprList(left + right)


@dataclass(eq=False)
class Gen(Expr):
    """Generate text into variable `name`. `sampling` holds only the fields given to gen()
    (SamplingParams names); the rest come from run()'s defaults."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    dtype: Any = None

    def __post_init__(self) -> None:
        if self.name is not None and not isinstance(self.name, str):
            raise TypeError(f"gen: name must be a string or None, got {self.name!r}")
        if self.dtype is not None and self.dtype not in DTYPE_REGEX:
            raise ValueError(f"dtype: must be int, float, bool or str, got {self.dtype!r}")
        if self.dtype is not None and self.sampling.get("regex") is not None:
            raise ValueError("dtype and regex: give one of them (dtype is a regex constraint)")
        self._check_sampling()

    def _check_sampling(self) -> None:
        """The gen's own fields, checked at the call (the executor checks them again merged
        with run()'s defaults): a max_tokens the defaults may give stands in as the largest."""
        fields = {"max_new_tokens": MAX_INT, **self.sampling}
        if self.dtype is not None:
            fields["regex"] = DTYPE_REGEX[self.dtype]
        try:
            SamplingParams.from_dict(fields)
        except RequestError as e:
            arg = GEN_ARG_NAMES.get(e.field, e.field)
            raise ValueError(f"gen({self.name!r}): {arg}: {e.message}") from None


@dataclass(eq=False)
class Select(Expr):
    """Choose one of `choices` by the model's log-probabilities (see choices.py)."""

    name: str | None
    choices: list[str]
    temperature: float
    choices_method: ChoicesSamplingMethod

    def __post_init__(self) -> None:
        if not self.choices or not all(isinstance(c, str) and c for c in self.choices):
            raise ValueError("select: choices: must be a non-empty list of non-empty strings")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise TypeError(f"select: temperature: must be a number, got {self.temperature!r}")
        if not self.temperature >= 0:
            raise ValueError(f"select: temperature: must be >= 0, got {self.temperature}")
        if not isinstance(self.choices_method, ChoicesSamplingMethod):
            raise TypeError(
                "select: choices_method: must be a ChoicesSamplingMethod instance "
                "(pl.token_length_normalized, pl.greedy_token_selection, "
                f"pl.unconditional_likelihood_normalized), got {self.choices_method!r}"
            )


@dataclass(eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    name: str


@dataclass(eq=False)
class CommitLazy(Expr):
    """Send the text so far to the backend as a prompt (one prefill), so what follows
    hits the prefix cache."""


@dataclass(eq=False)
class ForkPoint(Expr):
    """Where `s.fork(n)` was called: commit the prefix, then start the children from here."""

    children: list[Executor]


@dataclass(eq=False)
class Join(Expr):
    """`forks.join(mode)`: wait for the children (up to what was submitted to them when join
    was called), then gather their variables or append their texts."""

    children: list[Executor]
    until: list[int]
    mode: str


def role_exprs(role: str, expr: Any = None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return ExprList([RoleBegin(role), to_expr(expr), RoleEnd(role)])


def names_defined(expr: Expr) -> list[str]:
    """Variables an expression sets (so a read of them waits for it)."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, VarScopeEnd):
        return [expr.name]
    if isinstance(expr, ExprList):
        return [n for e in expr.exprs for n in names_defined(e)]
    return []


def split_sampling_kwargs(kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """run()'s sampling keywords -> (SamplingParams fields, logprob options); an unknown
    name is a TypeError naming it."""
    sampling, logprobs = {}, {}
    for key, value in kwargs.items():
        name = SAMPLING_ALIASES.get(key, key)
        if name in SAMPLING_FIELDS:
            sampling[name] = value
        elif name in LOGPROB_FIELDS:
            logprobs[name] = value
        else:
            raise TypeError(f"unknown sampling parameter {key!r}")
    return sampling, logprobs


def is_sampling_kwarg(key: str) -> bool:
    return SAMPLING_ALIASES.get(key, key) in SAMPLING_FIELDS or key in LOGPROB_FIELDS
