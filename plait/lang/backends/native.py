"""What every backend speaking SGLang's native /generate protocol shares: gen, streaming,
prefix caching, and `select` scored by prompt log-probabilities.

Subclasses (EngineBackend in-process, RuntimeEndpoint over HTTP) only move a GenerateInput
(plait/io_struct.py: the request shape every entry point normalizes) to the runtime and back.

select, with the model's tokenizer (exact):
  1. tokenize the prompt and prompt+choice for each choice; a choice's scored tokens start
     where its tokenization leaves the prompt's. When the prompt ends inside a token that the
     choice completes (a trailing space: "Answer: " + "yes" is "Answer:", " yes"), the boundary
     token is scored as part of the choice: token healing.
  2. commit the prefix every choice shares (one prefill, max_new_tokens 0), pipelined with
  3. ONE batched request, prompt+choice for all choices, max_new_tokens 0, logprobs from the
     earliest choice start; each choice keeps the logprobs of its own tokens. The runtime
     defers requests sharing an uncached prefix with one in its batch, so the prefix is
     computed once and the choices hit the cache, without a round trip in between;
  4. for unconditional_likelihood_normalized, one more batch of the choices' tokens alone.
Without a tokenizer (a remote server whose model is not on this machine) it falls back to
SGLang's text protocol: logprobs from the last prompt token, dropped unless healing merged it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from abc import abstractmethod
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from plait.io_struct import GenerateInput
from plait.lang.backends.base import Backend, GenResult, LogprobOptions
from plait.lang.chat_template import ChatTemplate
from plait.lang.choices import ChoicesDecision, ChoicesSamplingMethod, mean_logprob
from plait.matching import common_prefix_len
from plait.models.tokenizer import encode_prompt
from plait.sampling import SamplingParams

if TYPE_CHECKING:
    from plait.lang.executor import Executor


class NativeBackend(Backend):
    def __init__(self, tokenizer: Any = None, chat_template: ChatTemplate | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        if self.chat_template is None and tokenizer is not None:
            self.chat_template = ChatTemplate.from_tokenizer(tokenizer)

    # ------------------------------------------------------------------ transport
    @abstractmethod
    async def request(self, inp: GenerateInput) -> dict[str, Any] | list[dict[str, Any]]:
        """One generation request (the runtime normalizes it as every entry point does); a
        list of outputs when it holds a batch or n > 1."""

    @abstractmethod
    def request_stream(self, inp: GenerateInput) -> AsyncIterator[dict[str, Any]]:
        """A streaming request: outputs whose `text` is cumulative."""

    # ------------------------------------------------------------------ Backend
    def get_chat_template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ValueError(
                f"{self.name} backend: roles need a chat template, and the model's tokenizer "
                "has none; pass chat_template=... (a Jinja template string)"
            )
        return self.chat_template

    async def generate(
        self, s: Executor, params: SamplingParams, options: LogprobOptions
    ) -> GenResult:
        out = await self.request(_gen_payload(s.text_, params, options))
        outs = out if isinstance(out, list) else [out]
        for o in outs:
            s.usage.add(o["meta_info"])
        if isinstance(out, list):
            return GenResult([o["text"] for o in out], [o["meta_info"] for o in out])
        return GenResult(out["text"], out["meta_info"])

    async def generate_stream(self, s: Executor, params: SamplingParams, options: LogprobOptions):
        if params.n != 1:
            raise ValueError("n: streaming generates one sample (use s.fork(n) for several)")
        inp = dataclasses.replace(_gen_payload(s.text_, params, options), stream=True)
        sent, meta = 0, None
        async for out in self.request_stream(inp):
            meta = out["meta_info"]
            delta = out["text"][sent:]
            sent = len(out["text"])
            yield delta, meta
        s.usage.add(meta)

    async def cache_prefix(self, s: Executor | None, text: str) -> dict[str, Any] | None:
        if not text:
            return None
        out = await self.request(GenerateInput(text=text, sampling_params={"max_new_tokens": 0}))
        if s is not None:
            s.usage.add(out["meta_info"])
        return out["meta_info"]

    # ------------------------------------------------------------------ select
    async def select(
        self, s: Executor, choices: list[str], temperature: float, method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        if self.tokenizer is not None:
            scored = await self._score_by_tokens(s, choices)
        else:
            scored = await self._score_by_text(s, choices)
        cond, outputs = scored
        uncond = None
        if method.requires_unconditional_logprobs:
            uncond = await self._unconditional(s, [[e[1] for e in lps] for lps in cond])
        decision = method(
            choices=choices,
            normalized_prompt_logprobs=[mean_logprob(lps) for lps in cond],
            input_token_logprobs=cond,
            output_token_logprobs=outputs,
            unconditional_token_logprobs=uncond,
        )
        meta = dict(decision.meta_info or {})
        meta.setdefault("choices_method", getattr(method, "name", type(method).__name__))
        meta.setdefault("scores", meta.get("normalized_prompt_logprobs"))
        if temperature > 1e-5:
            decision = ChoicesDecision(_sample(choices, meta["scores"], temperature), meta)
        else:
            decision = ChoicesDecision(decision.decision, meta)
        return decision

    async def _score_by_tokens(self, s: Executor, choices: list[str]):
        encode = self._encode
        prompt_ids = encode(s.text_)
        fulls = [encode(s.text_ + c) for c in choices]
        # a choice's scored tokens start where its tokenization leaves the prompt's
        starts = [common_prefix_len(prompt_ids, ids) for ids in fulls]
        shared = min(starts)
        batch = GenerateInput(
            input_ids=fulls,
            sampling_params={"max_new_tokens": 0, "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=shared,
        )
        if shared > 0 and s.committed_len < len(s.text_):
            commit = GenerateInput(
                input_ids=prompt_ids[:shared], sampling_params={"max_new_tokens": 0}
            )
            committed, outs = await _pipelined(self.request(commit), self.request(batch))
            s.usage.add(committed["meta_info"])
        else:
            outs = await self.request(batch)
        cond, outputs = [], []
        for out, start in zip(outs, starts):
            s.usage.add(out["meta_info"])
            entries = out["meta_info"]["input_token_logprobs"][start - shared :]
            cond.append([self._with_text(e) for e in entries])
            outputs.append(out["meta_info"].get("output_token_logprobs", []))
        return cond, outputs

    async def _score_by_text(self, s: Executor, choices: list[str]):
        commit = await self.request(
            GenerateInput(text=s.text_, sampling_params={"max_new_tokens": 0})
        )
        s.usage.add(commit["meta_info"])
        start = max(commit["meta_info"]["prompt_tokens"] - 1, 0)
        outs = await self.request(
            GenerateInput(
                text=[s.text_ + c for c in choices],
                sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                return_logprob=True,
                return_text_in_logprobs=True,
                logprob_start_len=start,
            )
        )
        cond, outputs = [], []
        for out in outs:
            s.usage.add(out["meta_info"])
            entries = [list(e) for e in out["meta_info"]["input_token_logprobs"]]
            # the first entry is the last prompt token unless the choice merged into it
            if len(entries) > 1 and entries[0][2] is not None and s.text_.endswith(entries[0][2]):
                entries = entries[1:]
            cond.append(entries)
            outputs.append(out["meta_info"].get("output_token_logprobs", []))
        return cond, outputs

    async def _unconditional(self, s: Executor, token_ids: list[list[int]]) -> list[list[list]]:
        outs = await self.request(
            GenerateInput(
                input_ids=token_ids,
                sampling_params={"max_new_tokens": 0, "temperature": 0.0},
                return_logprob=True,
                logprob_start_len=0,
            )
        )
        result = []
        for ids, out in zip(token_ids, outs):
            s.usage.add(out["meta_info"])
            entries = [list(e) for e in out["meta_info"]["input_token_logprobs"]]
            # the first token has no context (None); a server may omit it for 1-token inputs
            missing = [[None, t, None] for t in ids[: len(ids) - len(entries)]]
            result.append([self._with_text(e) for e in missing + entries])
        return result

    def _encode(self, text: str) -> list[int]:
        return encode_prompt(self.tokenizer, text)  # as the server encodes the same text

    def _with_text(self, entry: list) -> list:
        logprob, token_id = entry[0], entry[1]
        text = entry[2] if len(entry) > 2 and entry[2] is not None else None
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode([token_id])
        return [logprob, token_id, text]


async def _pipelined(first, second) -> tuple[Any, Any]:
    """Send `first`, then `second` without waiting for `first` to finish: the runtime prefills
    the shared prefix once (its scheduler defers requests that share an uncached prefix with
    one already in the batch), so the choices hit the cache without a round trip in between."""
    task = asyncio.ensure_future(first)
    await asyncio.sleep(0)  # let the commit go out first
    try:
        second_out = await second
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    return await task, second_out


def _gen_payload(text: str, params: SamplingParams, options: LogprobOptions) -> GenerateInput:
    inp = GenerateInput(text=text, sampling_params=_sampling_dict(params))
    if options.return_logprob:
        inp.return_logprob = True
        inp.logprob_start_len = options.logprob_start_len
        inp.top_logprobs_num = options.top_logprobs_num or None
        inp.return_text_in_logprobs = bool(options.return_text_in_logprobs)
    return inp


def _sampling_dict(params: SamplingParams) -> dict[str, Any]:
    """The fields that differ from the defaults (short requests; servers fill the rest)."""
    default = SamplingParams()
    out = {k: v for k, v in params.to_dict().items() if v != getattr(default, k)}
    out["max_new_tokens"] = params.max_new_tokens
    return out


def _sample(choices: list[str], scores: list[float], temperature: float) -> str:
    top = max(scores)
    weights = [math.exp((x - top) / temperature) for x in scores]
    return random.choices(choices, weights=weights)[0]
