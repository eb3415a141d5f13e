"""OpenAI: programs on any OpenAI-compatible server (/v1/chat/completions, /v1/completions).

A program that uses roles is sent as chat messages: a gen must open an assistant turn (the
API cannot continue a partly written message). A program without roles is a completion of
its text. What the API cannot express raises UnsupportedFeature naming it: select (needs
prompt log-probabilities), regex / ebnf / dtype constraints, and sampling fields outside the
OpenAI spec. `json_schema` becomes `response_format` (chat only).
"""

from __future__ import annotations

import asyncio
import json
import os
import weakref
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx

from plait.lang.backends.base import (
    Backend,
    BackendError,
    GenResult,
    LogprobOptions,
    UnsupportedFeature,
)
from plait.lang.backends.runtime_endpoint import KEEPALIVE_EXPIRY_S
from plait.lang.chat_template import ChatTemplate, PlainChatTemplate
from plait.sampling import SamplingParams

if TYPE_CHECKING:
    from plait.lang.executor import Executor

# SamplingParams field -> OpenAI request field
_OPENAI_FIELDS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "stop": "stop",
    "seed": "seed",
    "n": "n",
    "logit_bias": "logit_bias",
}
# fields the API has no way to express (beyond their defaults)
_UNSUPPORTED = (
    "min_new_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "regex",
    "ebnf",
    "choices",
)


class OpenAI(Backend):
    name = "openai"

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key: str | None = None,
        *,
        is_chat_model: bool | None = None,
        timeout: float = 600.0,
    ) -> None:
        self.model = model
        self.base_url = base_url.rstrip("/")
        api_key = api_key or os.environ.get("OPENAI_API_KEY")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.is_chat_model = is_chat_model  # None: chat when the program uses roles
        self._timeout = timeout
        self._template = PlainChatTemplate()
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    async def generate(
        self, s: Executor, params: SamplingParams, options: LogprobOptions
    ) -> GenResult:
        path, body = self._request(s, params, options)
        response = await self._client().post(self.base_url + path, json=body)
        if response.status_code != 200:
            raise _error(response, path)
        data = response.json()
        meta = _meta(data)
        s.usage.add(meta)
        texts = [_choice_text(c) for c in data["choices"]]
        if params.n > 1:
            return GenResult(texts, meta)
        meta["finish_reason"] = data["choices"][0].get("finish_reason")
        return GenResult(texts[0], meta)

    async def generate_stream(self, s: Executor, params: SamplingParams, options: LogprobOptions):
        if params.n != 1:
            raise ValueError("n: streaming generates one sample (use s.fork(n) for several)")
        path, body = self._request(s, params, options)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        meta: dict[str, Any] = {}
        async with self._client().stream("POST", self.base_url + path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise _error(r, path)
            async for data in _sse(r):
                if data.get("usage"):
                    meta.update(_meta(data))
                for choice in data.get("choices", []):
                    if choice.get("finish_reason"):
                        meta["finish_reason"] = choice["finish_reason"]
                    delta = choice.get("delta", {}).get("content") or choice.get("text") or ""
                    if delta:
                        yield delta, dict(meta)
        s.usage.add(meta)
        yield "", meta

    # ------------------------------------------------------------------ requests
    def _request(
        self, s: Executor, params: SamplingParams, options: LogprobOptions
    ) -> tuple[str, dict[str, Any]]:
        if options.return_logprob:
            raise UnsupportedFeature(self.name, "return_logprob", "use RuntimeEndpoint")
        body = {"model": self.model, **_sampling(params, self.name)}
        chat = (
            self.is_chat_model
            if self.is_chat_model is not None
            else bool(s.messages_ or s.cur_role)
        )
        if not chat:
            if params.json_schema is not None or params.json_object:
                raise UnsupportedFeature(
                    self.name,
                    "json_schema on /v1/completions",
                    "generate JSON inside an assistant role",
                )
            return "/completions", body | {"prompt": s.text_}
        if s.cur_role != "assistant" or s.text_[s.cur_role_begin_pos :].strip():
            raise UnsupportedFeature(
                self.name,
                "gen outside the start of an assistant turn",
                "chat APIs generate whole assistant messages: put the gen first in "
                "`with s.assistant(): ...`",
            )
        if params.json_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": "output",
                    "schema": json.loads(params.json_schema),
                    "strict": True,
                },
            }
        elif params.json_object:
            body["response_format"] = {"type": "json_object"}
        return "/chat/completions", body | {"messages": list(s.messages_)}

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(
                headers=self._headers, timeout=self._timeout,
                limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
            )
            self._clients[loop] = client
        return client


def _sampling(params: SamplingParams, backend: str) -> dict[str, Any]:
    default = SamplingParams()
    for name in _UNSUPPORTED:
        if getattr(params, name) != getattr(default, name):
            raise UnsupportedFeature(
                backend,
                f"{name} (or a dtype constraint)" if name == "regex" else name,
                "use RuntimeEndpoint or EngineBackend",
            )
    out = {}
    for ours, theirs in _OPENAI_FIELDS.items():
        value = getattr(params, ours)
        if ours == "stop" and not value:
            continue
        if ours in ("seed", "logit_bias") and value is None:
            continue
        out[theirs] = value
    return out


def _choice_text(choice: dict[str, Any]) -> str:
    if "message" in choice:
        return choice["message"].get("content") or ""
    return choice.get("text", "")


def _meta(data: dict[str, Any]) -> dict[str, Any]:
    usage = data.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    return {
        "id": data.get("id"),
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": details.get("cached_tokens", 0),
    }


async def _sse(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        obj = json.loads(data)
        if "error" in obj:
            raise BackendError(f"openai stream: {obj['error']}")
        yield obj


def _error(response: httpx.Response, path: str) -> BackendError:
    try:
        body = response.json()
        detail = (
            body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body
        )
    except ValueError:
        detail = response.text[:500]
    return BackendError(
        f"openai {path}: HTTP {response.status_code}: {detail}", response.status_code
    )
