"""SamplingParams: the one list of sampling parameters, validated once, shared by every layer.

Field names follow SGLang's `sampling_params` so that requests move between the two unchanged.
The HTTP layers, the DSL and the backends convert to and from this class instead of restating
the fields.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

# Kinds of output constraint; at most one per request.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices", "json_object")


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no top-k restriction
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    seed: int | None = None
    # constraints (see plait.grammar)
    regex: str | None = None
    json_schema: str | None = None  # canonical JSON text of the schema
    ebnf: str | None = None
    choices: list[str] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_to_json(self.json_schema)
        self.validate()

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        _check_int("min_new_tokens", self.min_new_tokens, minimum=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                f"({self.max_new_tokens})"
            )
        _check_float("temperature", self.temperature, lo=0.0)
        _check_float("top_p", self.top_p, lo=0.0, lo_open=True, hi=1.0)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_float("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _check_float("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_float("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True, hi=2.0)
        _check_int("n", self.n, minimum=1, maximum=128)
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("stop: must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: empty stop strings are not allowed")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids: must be a list of non-negative integers")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "json_object"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean")
        for name in ("regex", "ebnf"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}: must be a non-empty string")
        if self.choices is not None:
            if (
                not isinstance(self.choices, list)
                or not self.choices
                or not all(isinstance(c, str) and c for c in self.choices)
            ):
                raise ValueError("choices: must be a non-empty list of non-empty strings")
        given = [name for name in CONSTRAINT_FIELDS if self._constraint_value(name)]
        if len(given) > 1:
            raise ValueError(
                f"{given[1]}: only one constraint per request is allowed, got {', '.join(given)}"
            )

    def _constraint_value(self, name: str) -> Any:
        value = getattr(self, name)
        return value if name != "json_object" else (value or None)

    # ----------------------------------------------------------------- derived
    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, spec) of the output constraint, or None. `spec` is a string (choices: JSON list)."""
        if self.regex is not None:
            return ("regex", self.regex)
        if self.json_schema is not None:
            return ("json_schema", self.json_schema)
        if self.ebnf is not None:
            return ("ebnf", self.ebnf)
        if self.choices is not None:
            return ("choices", json.dumps(self.choices))
        if self.json_object:
            return ("json_object", "")
        return None

    @property
    def has_penalties(self) -> bool:
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    # ----------------------------------------------------------------- conversion
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a SGLang-style dict; an unknown key is a ValueError naming it."""
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"sampling_params.{unknown[0]}: unknown sampling parameter "
                f"(known: {', '.join(sorted(known))})"
            )
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            del d["max_new_tokens"]
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def schema_to_json(schema: Any) -> str:
    """A JSON schema given as a dict, a JSON string or a Pydantic model class -> canonical JSON."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON ({e})") from None
    elif isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: must be a JSON object, a JSON string or a Pydantic model")
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def _check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None):
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            raise ValueError(f"{name}: must be an integer, got {value!r}")
        raise ValueError(f"{name}: must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name}: must be <= {maximum}, got {value}")


def _check_float(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name}: must be a number, got {value!r}")
    if lo is not None and (value < lo or (lo_open and value == lo)):
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ValueError(f"{name}: must be {bound}, got {value}")
    if hi is not None and value > hi:
        raise ValueError(f"{name}: must be <= {hi}, got {value}")
