"""The one request shape: `GenerateInput` and its `normalize()`, the per-request state the
frontend keeps (`ReqState`), and the output object every entry point returns.

Every entry point builds a GenerateInput and calls `normalize(limits)` (SGLang's
`GenerateReqInput.normalize_batch_and_arguments()`): native `/generate` from its JSON body
(`GenerateInput.from_dict`), the OpenAI routes from their pydantic models, `plait.Engine`
from its arguments, the language backends through the Engine or `/generate`. normalize checks
every field (types, ranges, sizes, token ids in the vocabulary) and expands batches and `n`
into `ReqInput`s, one per output. What needs the tokenizer (a text prompt's token count
against the context) is checked by the TokenizerManager right after tokenizing; the scheduler
checks only what only it knows (KV pool capacity). Errors are `RequestError`s naming the field.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from plait.errors import RequestError
from plait.sampling import MAX_INT, SamplingParams

# Top-level /generate fields of SGLang that plait does not serve: accepted when empty
# (SGLang's own clients send several of them as null), a 400 naming them otherwise.
UNSUPPORTED_FIELDS = (
    "image_data",
    "video_data",
    "audio_data",
    "input_embeds",
    "lora_path",
    "session_id",
    "custom_logit_processor",
    "return_hidden_states",
    "token_ids_logprob",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "data_parallel_rank",
    "log_metrics",
    "modalities",
)
# SGLang sampling fields that plait ignores (detokenizer details) or does not serve.
IGNORED_SAMPLING_FIELDS = ("spaces_between_special_tokens", "stream_interval")
UNSUPPORTED_SAMPLING_FIELDS = (
    "stop_regex",
    "custom_params",
    "beam_width",
    "watermark",
)
MAX_PRIORITY = 1000
MAX_RID_CHARS = 256


@dataclass(frozen=True)
class InputLimits:
    """Bounds normalize() enforces; the server derives them from ServerArgs and the model."""

    vocab_size: int | None = None
    context_length: int | None = None
    max_batch_size: int = 256  # outputs of one request: prompts x n
    max_top_logprobs: int = 1000
    max_logprob_entries: int = 1 << 18  # (logprob rows) x (1 + top_logprobs_num), per request
    max_prompt_chars: int | None = None  # a text prompt longer than this is refused untokenized
    default_priority: int = 0
    max_priority: int = MAX_PRIORITY


DEFAULT_LIMITS = InputLimits()


@dataclass
class ReqInput:
    """One prompt x one sample, validated: what the TokenizerManager runs."""

    text: str | None
    input_ids: list[int] | None
    sampling_params: SamplingParams  # n == 1
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no input logprobs
    top_logprobs_num: int = 0
    stream: bool = False
    rid: str | None = None
    group: str | None = None  # the rid the client gave (n > 1 runs as group_0, group_1, ...)
    priority: int = 0
    key: str | None = None  # label of the API key that sent it (rate limits, metrics)
    prompt_field: str | None = None  # the prompt as the body names it ("text.1"; default: text)

    @property
    def prompt_name(self) -> str:
        """The field an error about the prompt names (a batch's entry with its index)."""
        return self.prompt_field or ("text" if self.text is not None else "input_ids")


@dataclass
class NormalizedInput:
    reqs: list[ReqInput]
    batched: bool  # the caller gets a list (a batch of prompts, or n > 1)
    stream: bool
    return_text_in_logprobs: bool


@dataclass
class GenerateInput:
    """A generation request as a caller states it: one prompt or a batch (`text` or
    `input_ids`), per-prompt or shared fields, SGLang's names."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: Any = None  # dict | SamplingParams | a list of them (one per prompt)
    return_logprob: Any = False
    logprob_start_len: Any = None
    top_logprobs_num: Any = None
    return_text_in_logprobs: Any = False
    stream: Any = False
    rid: Any = None
    priority: Any = None

    FIELDS = (
        "text",
        "input_ids",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "rid",
        "priority",
    )

    @classmethod
    def from_dict(cls, body: Any) -> GenerateInput:
        """A native /generate body; unknown fields and non-empty unsupported ones are refused."""
        if not isinstance(body, dict):
            raise RequestError("body", "must be a JSON object")
        unknown = sorted(set(body) - set(cls.FIELDS) - set(UNSUPPORTED_FIELDS))
        if unknown:
            raise RequestError(unknown[0], f"unknown field (known: {', '.join(cls.FIELDS)})")
        for name in UNSUPPORTED_FIELDS:
            if body.get(name):
                raise RequestError(name, "not supported by plait")
        return cls(**{k: v for k, v in body.items() if k in cls.FIELDS})

    # ------------------------------------------------------------------ normalize
    def normalize(self, limits: InputLimits | None = None) -> NormalizedInput:
        limits = limits or DEFAULT_LIMITS
        prompts, batched = _prompts(self.text, self.input_ids, limits)
        n = len(prompts)
        stream = _flag("stream", self.stream)
        priority = _priority(self.priority, limits)
        per = {
            name: _per_prompt(name, getattr(self, name), n, batched)
            for name in ("sampling_params", "rid", "return_logprob", "logprob_start_len")
        }
        per["top_logprobs_num"] = _per_prompt("top_logprobs_num", self.top_logprobs_num, n, batched)
        reqs: list[ReqInput] = []
        for i, (key, prompt) in enumerate(prompts):
            sp = _sampling(per["sampling_params"][i], limits.vocab_size)
            if len(reqs) + sp.n > limits.max_batch_size:
                raise RequestError(
                    "n" if n == 1 else key,
                    f"a request may produce at most {limits.max_batch_size} outputs (prompts x n)",
                )
            rid = _rid(per["rid"][i])
            return_logprob = _flag("return_logprob", per["return_logprob"][i])
            start = _int_or_none("logprob_start_len", per["logprob_start_len"][i], -1)
            top_n = _int_or_none("top_logprobs_num", per["top_logprobs_num"][i], 0) or 0
            if top_n > limits.max_top_logprobs:
                raise RequestError(
                    "top_logprobs_num", f"must be in [0, {limits.max_top_logprobs}], got {top_n}"
                )
            for j, sub in enumerate(_expand_n(sp)):
                reqs.append(
                    ReqInput(
                        text=prompt if key == "text" else None,
                        input_ids=prompt if key == "input_ids" else None,
                        sampling_params=sub,
                        return_logprob=return_logprob,
                        logprob_start_len=-1 if start is None or not return_logprob else start,
                        top_logprobs_num=top_n if return_logprob else 0,
                        stream=stream,
                        rid=rid if rid is None or sp.n == 1 else f"{rid}_{j}",
                        group=rid,
                        priority=priority,
                        prompt_field=f"{key}.{i}" if batched else key,
                    )
                )
        return NormalizedInput(
            reqs,
            batched or len(reqs) > n,
            stream,
            _flag("return_text_in_logprobs", self.return_text_in_logprobs),
        )


# ---------------------------------------------------------------------- field checks
def _prompts(text: Any, input_ids: Any, limits: InputLimits) -> tuple[list[tuple[str, Any]], bool]:
    """[("text" | "input_ids", prompt)], and whether the input is a batch."""
    if (text is None) == (input_ids is None):
        raise RequestError("text", "give exactly one of text or input_ids")
    if text is not None:
        batched = isinstance(text, list)
        items = text if batched else [text]
        if not items:
            raise RequestError("text", "the batch is empty")
        for i, t in enumerate(items):
            name = f"text.{i}" if batched else "text"
            if not isinstance(t, str):
                raise RequestError(name, "must be a string or a list of strings")
            if not t:
                raise RequestError(name, "the prompt is empty")
            if limits.max_prompt_chars is not None and len(t) > limits.max_prompt_chars:
                raise RequestError(
                    name,
                    f"{len(t)} characters, over the limit of {limits.max_prompt_chars} "
                    "(--max-prompt-chars; by default derived from the context length)",
                )
        return [("text", t) for t in items], batched
    if not isinstance(input_ids, list) or not input_ids:
        raise RequestError("input_ids", "must be a non-empty list of token ids")
    batched = isinstance(input_ids[0], list)
    if batched:
        for i, ids in enumerate(input_ids):
            if not isinstance(ids, list):
                raise RequestError(f"input_ids.{i}", "a batch must be a list of lists of token ids")
            _check_ids(f"input_ids.{i}", ids, limits.vocab_size)
        return [("input_ids", list(ids)) for ids in input_ids], True
    _check_ids("input_ids", input_ids, limits.vocab_size)
    return [("input_ids", list(input_ids))], False


def _check_ids(name: str, ids: list, vocab_size: int | None) -> None:
    if not ids:
        raise RequestError(name, "the prompt is empty")
    top = vocab_size if vocab_size is not None else MAX_INT + 1
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(name, f"token ids must be integers, got {type(t).__name__}")
        if not 0 <= t < top:
            shown = t if abs(t) < 10**12 else "a huge integer"
            raise RequestError(name, f"token id {shown} is outside the vocabulary [0, {top})")


def _flag(name: str, value: Any) -> bool:
    """A strict boolean: "false" or 0 is not one (null means false)."""
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(name, f"must be a boolean, got {type(value).__name__}")
    return value


def _int_or_none(name: str, value: Any, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"must be an integer, got {type(value).__name__}")
    if not minimum <= value <= MAX_INT:
        raise RequestError(name, f"must be in [{minimum}, {MAX_INT}]")
    return value


def _rid(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_RID_CHARS:
        raise RequestError("rid", f"must be a string of 1 to {MAX_RID_CHARS} characters")
    return value


def _priority(value: Any, limits: InputLimits) -> int:
    if value is None:
        return limits.default_priority
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError("priority", f"must be an integer, got {type(value).__name__}")
    if not -MAX_PRIORITY <= value <= MAX_PRIORITY:
        raise RequestError("priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}]")
    return min(value, limits.max_priority)


def _per_prompt(name: str, value: Any, n: int, batched: bool) -> list[Any]:
    """A field given once for all prompts, or (batch only) as a list with one entry each."""
    if (
        batched
        and isinstance(value, list)
        and (name != "sampling_params" or value == [] or not isinstance(value[0], (str, int)))
    ):
        if len(value) != n:
            raise RequestError(name, f"a list must have one entry per prompt ({n})")
        return value
    if isinstance(value, list) and name != "sampling_params":
        raise RequestError(name, "a list is only allowed for a batch, one entry per prompt")
    return [value] * n


def _sampling(params: Any, vocab_size: int | None) -> SamplingParams:
    """SGLang's sampling_params dict (null means 'default', as in SGLang) or a SamplingParams
    (its fields named as is). A dict's errors name the field `sampling_params.<name>`."""
    if isinstance(params, SamplingParams):
        if vocab_size is not None:
            params.check_vocab(vocab_size)
        return params
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError("sampling_params", "must be an object")
    d = {k: v for k, v in params.items() if v is not None and k not in IGNORED_SAMPLING_FIELDS}
    if "sampling_seed" in d:  # SGLang's newer name
        d.setdefault("seed", d.pop("sampling_seed"))
    for name in UNSUPPORTED_SAMPLING_FIELDS:
        if d.pop(name, None) not in (None, [], {}, ()):
            raise RequestError(f"sampling_params.{name}", "not supported by plait")
    for name in ("stop", "stop_token_ids"):
        if isinstance(d.get(name), tuple):
            d[name] = list(d[name])
    try:
        sp = SamplingParams.from_dict(d)
        if vocab_size is not None:
            sp.check_vocab(vocab_size)
        return sp
    except RequestError as e:
        raise e.renamed("sampling_params" + (f".{e.field}" if e.field else "")) from None
    except TypeError as e:  # a field the dataclass refuses by its signature
        raise RequestError("sampling_params", str(e)) from None


def _expand_n(sp: SamplingParams) -> list[SamplingParams]:
    """n > 1 -> n requests with n = 1 (seed + i when seeded); they share the prompt's KV."""
    if sp.n == 1:
        return [sp]
    return [sp.replace(n=1, seed=None if sp.seed is None else sp.seed + i) for i in range(sp.n)]


# ---------------------------------------------------------------------- state and output
@dataclass
class ReqState:
    """What the frontend knows of one running request; updated as output arrives."""

    rid: str
    prompt_tokens: int
    group: str | None = None
    key: str | None = None
    priority: int = 0
    event: asyncio.Event = field(default_factory=asyncio.Event)
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    finished_reason: dict | None = None
    error: RequestError | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    output_token_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    input_token_logprobs: list | None = None
    input_top_logprobs: list | None = None
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None


def format_output(state: ReqState, return_logprob: bool) -> dict[str, Any]:
    """SGLang's output object {text, output_ids, meta_info}; logprob entries are
    [logprob, token_id, None] (the HTTP layer fills token texts when asked)."""
    meta: dict[str, Any] = {
        "id": state.rid,
        "finish_reason": state.finished_reason,
        "prompt_tokens": state.meta.get("prompt_tokens", state.prompt_tokens),
        "completion_tokens": state.meta.get("completion_tokens", len(state.output_ids)),
        "cached_tokens": state.meta.get("cached_tokens", 0),
    }
    for key in ("forced_tokens", "spec_accepted_tokens"):
        if key in state.meta:
            meta[key] = state.meta[key]
    if state.finished_reason and state.finished_reason.get("incomplete"):
        meta["incomplete"] = True
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in state.output_token_logprobs]
        meta["output_top_logprobs"] = [
            [[lp, tok, None] for lp, tok in row] for row in state.output_top_logprobs
        ]
        meta["input_token_logprobs"] = [
            [lp, tok, None] for lp, tok in (state.input_token_logprobs or [])
        ]
        meta["input_top_logprobs"] = [
            None if row is None else [[lp, tok, None] for lp, tok in row]
            for row in (state.input_top_logprobs or [])
        ]
    return {"text": state.text, "output_ids": list(state.output_ids), "meta_info": meta}


def to_payload(inp: GenerateInput) -> dict[str, Any]:
    """The /generate JSON body of a GenerateInput (fields left at their defaults omitted)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(inp):
        value = getattr(inp, f.name)
        if value is None or value is False:
            continue
        if isinstance(value, SamplingParams):
            value = value.to_dict()
        elif isinstance(value, list) and value and isinstance(value[0], SamplingParams):
            value = [v.to_dict() for v in value]
        out[f.name] = value
    return out
