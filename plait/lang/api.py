"""The public functions of the language (SGLang's `sgl.*` names)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from plait.lang.backends.base import UnsupportedFeature
from plait.lang.backends.default import resolve_backend
from plait.lang.choices import ChoicesSamplingMethod, token_length_normalized
from plait.lang.ir import Gen, RoleBegin, RoleEnd, Select, role_exprs
from plait.lang.program import Function
from plait.sampling import schema_to_json


def function(func=None, *, num_api_spec_tokens: int | None = None):
    """Decorator: `@function def prog(s, ...)` (sync or `async def`)."""
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)


def flush_cache(backend: Any = None) -> None:
    resolve_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()


# ---------------------------------------------------------------------- expressions
def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    repetition_penalty: float | None = None,
    ignore_eos: bool | None = None,
    seed: int | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: Any = None,
    ebnf: str | None = None,
    json_object: bool | None = None,
    logit_bias: dict[int | str, float] | None = None,
) -> Gen | Select:
    """Generate into variable `name`. Fields left None take run()'s defaults. `json_schema`
    is a dict, a JSON string or a Pydantic model class; `dtype` (int, float, bool, str)
    constrains the text to parse as that type (the variable holds the text, as in SGLang); an
    int or float ends where the model would go on with other text (end_on_exit: `27` where it
    would write `27.`, not `271`).
    With `choices`, this is `select(name, choices, ...)`."""
    if choices is not None:
        return select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as e:
            raise ValueError(f"regex: invalid regular expression ({e})") from None
    if json_schema is not None:
        json_schema = schema_to_json(json_schema)
    sampling = _given(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        repetition_penalty=repetition_penalty,
        ignore_eos=ignore_eos,
        seed=seed,
        regex=regex,
        json_schema=json_schema,
        ebnf=ebnf,
        json_object=json_object,
        logit_bias=logit_bias,
    )
    logprobs = _given(
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
    )
    return Gen(name, sampling, logprobs, dtype)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """gen constrained to an integer (`int(s[name])` parses)."""
    return gen(name, max_tokens, dtype=int, **kwargs)


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Gen:
    """gen constrained to a double-quoted string of word characters and spaces."""
    return gen(name, max_tokens, dtype=str, **kwargs)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Select:
    """Append the choice the model finds most likely. Every choice is scored by its token
    log-probabilities in one batched request; `get_meta_info(name)` has the scores."""
    if choices is None:
        raise ValueError("select: choices is required")
    if isinstance(choices, (str, bytes)) or not isinstance(choices, Iterable):
        raise TypeError(
            f"select: choices: must be a list of strings, got a {type(choices).__name__}"
        )
    return Select(name, list(choices), temperature, choices_method)


def image(path: str) -> None:
    """SGLang's `sgl.image`: not supported (plait serves text-only models)."""
    raise UnsupportedFeature(
        "plait", "image input (sgl.image)", "plait serves text-only models; describe it in text"
    )


def video(path: str, num_frames: int) -> None:
    """SGLang's `sgl.video`: not supported (plait serves text-only models)."""
    raise UnsupportedFeature(
        "plait", "video input (sgl.video)", "plait serves text-only models; describe it in text"
    )


def system(expr: Any = None):
    return role_exprs("system", expr)


def user(expr: Any = None):
    return role_exprs("user", expr)


def assistant(expr: Any = None):
    return role_exprs("assistant", expr)


def system_begin() -> RoleBegin:
    return RoleBegin("system")


def system_end() -> RoleEnd:
    return RoleEnd("system")


def user_begin() -> RoleBegin:
    return RoleBegin("user")


def user_end() -> RoleEnd:
    return RoleEnd("user")


def assistant_begin() -> RoleBegin:
    return RoleBegin("assistant")


def assistant_end() -> RoleEnd:
    return RoleEnd("assistant")


def _given(**fields: Any) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}
