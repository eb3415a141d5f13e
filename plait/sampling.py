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

from plait.errors import RequestError

# Kinds of output constraint; at most one per request.
CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf", "choices", "json_object", "structural_tag")

# Bounds (documented in the README). A value outside them is a RequestError naming the field.
MAX_INT = 2**31 - 1  # token counts, top_k, token ids before the vocabulary check
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; seed + i for n > 1 stays below
MAX_TEMPERATURE = 100.0  # past this the distribution is uniform to float precision
GREEDY_TEMPERATURE = 1e-5  # below this (but > 0) sampling is greedy, as in SGLang
MIN_REPETITION_PENALTY = 0.01  # logits / penalty must stay finite
MAX_N = 128
MAX_STOP = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_CHOICES = 4096
MAX_SPEC_CHARS = 1 << 20  # regex / ebnf / json_schema text
MAX_LOGIT_BIAS = 1024  # biased token ids per request
LOGIT_BIAS_RANGE = 100.0  # as OpenAI's API: each bias in [-100, 100]


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
    # vLLM's: the stop string that ended the output is kept in its text (no_stop_trim keeps
    # the whole last token, which may run past it)
    include_stop_str_in_output: bool = False
    n: int = 1
    seed: int | None = None
    # constraints (see plait.grammar)
    regex: str | None = None
    json_schema: str | None = None  # canonical JSON text of the schema
    ebnf: str | None = None
    choices: list[str] | None = None
    json_object: bool = False
    # xgrammar's structural tag (JSON text, as SGLang takes it): free text with tagged parts
    # held to their formats (plait's tool calls with --tool-call-parser use it)
    structural_tag: str | None = None
    # where the constraint's text is complete, the probability of the tokens it forbids goes
    # to EOS: the output ends where the model would go on with other text (`14` then `.`),
    # rather than being held to the constraint's longer texts (`1411`). plait's own (not
    # SGLang's); the language sets it for gen(dtype=int/float)
    end_on_exit: bool = False
    # {token id: bias} added to the logits before penalties, masks and sampling (OpenAI's and
    # SGLang's logit_bias; JSON object keys are the ids as strings)
    logit_bias: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.json_schema is not None and not isinstance(self.json_schema, str):
            self.json_schema = schema_to_json(self.json_schema)
        if isinstance(self.structural_tag, dict):
            try:
                # (keys keep their order: a schema's properties are generated in it)
                self.structural_tag = json.dumps(self.structural_tag, allow_nan=False)
            except (TypeError, ValueError, RecursionError) as e:
                raise RequestError("structural_tag", f"not serializable as JSON ({e})") from None
        self.validate()
        if self.logit_bias is not None:  # canonical: "id" -> float, or None when empty
            self.logit_bias = {str(int(k)): float(v) for k, v in self.logit_bias.items()} or None
        if 0.0 < self.temperature < GREEDY_TEMPERATURE:
            # dividing logits by a tiny temperature overflows; the intent is greedy
            self.temperature = 0.0

    # ----------------------------------------------------------------- validation
    def validate(self) -> None:
        """Every field typed and bounded (RequestError naming it): a value that passes cannot
        make the sampler produce NaN or inf, nor a response or a loop without bound."""
        _check_int("max_new_tokens", self.max_new_tokens, 0, MAX_INT)
        _check_int("min_new_tokens", self.min_new_tokens, 0, MAX_INT)
        if self.min_new_tokens > self.max_new_tokens:
            raise RequestError(
                "min_new_tokens",
                f"must not exceed the maximum of new tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}",
            )
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1, MAX_INT)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 2.0)
        _check_int("n", self.n, 1, MAX_N)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED - self.n)
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP:
            raise RequestError("stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_CHARS:
                raise RequestError(
                    "stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters"
                )
        if not isinstance(self.stop_token_ids, list) or not all(
            _is_int(t) and 0 <= t <= MAX_INT for t in self.stop_token_ids
        ):
            raise RequestError("stop_token_ids", "must be a list of non-negative token ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim", "json_object",
                     "end_on_exit", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(name, f"must be a boolean, got {getattr(self, name)!r}")
        for name in ("regex", "ebnf", "json_schema", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise RequestError(name, "must be a non-empty string")
            if value is not None and len(value) > MAX_SPEC_CHARS:
                raise RequestError(name, f"longer than {MAX_SPEC_CHARS} characters")
        if self.choices is not None:
            if (
                not isinstance(self.choices, list)
                or not self.choices
                or not all(isinstance(c, str) and c for c in self.choices)
            ):
                raise RequestError("choices", "must be a non-empty list of non-empty strings")
            if len(self.choices) > MAX_CHOICES or sum(map(len, self.choices)) > MAX_SPEC_CHARS:
                raise RequestError(
                    "choices", f"at most {MAX_CHOICES} choices of {MAX_SPEC_CHARS} characters"
                )
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        given = [name for name in CONSTRAINT_FIELDS if self._constraint_value(name)]
        if len(given) > 1:
            raise RequestError(
                given[1], f"only one constraint per request is allowed, got {', '.join(given)}"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids named by the parameters exist in the model's vocabulary."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise RequestError(
                    "stop_token_ids", f"token id {t} is outside the vocabulary [0, {vocab_size})"
                )
        for t in self.logit_bias_ids:
            if t >= vocab_size:
                raise RequestError(
                    "logit_bias", f"token id {t} is outside the vocabulary [0, {vocab_size})"
                )

    @property
    def logit_bias_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias] if self.logit_bias else []

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
        if self.structural_tag is not None:
            return ("structural_tag", self.structural_tag)
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
        """Build from a SGLang-style dict; an unknown key is a RequestError naming it."""
        if d is not None and not isinstance(d, dict):
            kind = type(d).__name__
            raise RequestError(None, f"sampling parameters must be an object, got {kind}")
        d = dict(d or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known, key=str)
        if unknown:
            raise RequestError(
                str(unknown[0]),
                f"unknown sampling parameter (known: {', '.join(sorted(known))})",
            )
        if "max_new_tokens" in d and d["max_new_tokens"] is None:
            del d["max_new_tokens"]
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> SamplingParams:
        return dataclasses.replace(self, **changes)


def schema_to_json(schema: Any) -> str:
    """A JSON schema given as a dict, a JSON string or a Pydantic model class -> compact JSON.
    Keys keep their order: the output's properties come in the schema's order (a model's
    `reasoning` field before its `answer`), as in vLLM and SGLang; sorted, `answer` came first."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError) as e:
            raise RequestError("json_schema", f"not valid JSON ({e})") from None
    elif isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if not isinstance(schema, (dict, bool)):
        raise RequestError(
            "json_schema", "must be a JSON object, a JSON string or a Pydantic model"
        )
    try:
        return json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise RequestError("json_schema", f"not serializable as JSON ({e})") from None


def _check_logit_bias(bias: Any) -> None:
    """{token id: bias}: ids as integers or decimal strings (JSON object keys), each bias a
    finite number in [-100, 100], at most MAX_LOGIT_BIAS entries."""
    if not isinstance(bias, dict):
        raise RequestError("logit_bias", f"must be an object of token id -> bias, got {_short(bias)}")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError("logit_bias", f"at most {MAX_LOGIT_BIAS} token ids, got {len(bias)}")
    seen: set[int] = set()
    for key, value in bias.items():
        if _is_int(key):
            token = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
            token = int(key)
        else:
            raise RequestError("logit_bias", f"keys must be token ids, got {_short(key)}")
        if not 0 <= token <= MAX_INT:
            raise RequestError("logit_bias", f"token id {_short(token)} is out of range")
        if token in seen:
            raise RequestError("logit_bias", f"token id {token} is given twice")
        seen.add(token)
        try:
            _check_float("logit_bias", value, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)
        except RequestError as e:
            raise RequestError("logit_bias", f"token {token}: {e.message}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, maximum: int) -> None:
    if not _is_int(value):
        raise RequestError(name, f"must be an integer, got {_short(value)}")
    if not minimum <= value <= maximum:
        raise RequestError(name, f"must be in [{minimum}, {maximum}], got {_short(value)}")


def _check_float(
    name: str, value: Any, lo: float, hi: float, lo_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(name, f"must be a number, got {_short(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise RequestError(name, f"must be a finite number, got {_short(value)}")
    if value < lo or (lo_open and value == lo) or value > hi:
        low = "(" if lo_open else "["
        raise RequestError(name, f"must be in {low}{lo}, {hi}], got {_short(value)}")


def _short(value: Any) -> str:
    """repr of a value, cut short (a hostile value can be megabytes long)."""
    text = repr(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge integer"
    return text if len(text) <= 64 else text[:61] + "..."
