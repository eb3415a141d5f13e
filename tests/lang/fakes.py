"""A model-free backend for interpreter tests: deterministic text, a simulated prefix cache,
records of every request, optional delays and failures."""

from __future__ import annotations

import asyncio
import threading

from plait.lang.backends.base import Backend, BackendError, GenResult
from plait.lang.chat_template import ChatTemplate
from plait.lang.choices import ChoicesDecision

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class FakeBackend(Backend):
    name = "fake"

    def __init__(self, delay: float = 0.0, fail_marker: str | None = None) -> None:
        self.delay = delay
        self.fail_marker = fail_marker
        self.prompts: list[str] = []  # every generate/select prompt, in arrival order
        self.cached: list[str] = []  # cache_prefix texts
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_threads = 0
        self._template = ChatTemplate.from_string(CHATML)

    def get_chat_template(self) -> ChatTemplate:
        return self._template

    def _meta(self, prompt: str, completion: int) -> dict:
        cached = max(
            (len(p) for p in self.cached + self.prompts if prompt.startswith(p)), default=0
        )
        return {
            "prompt_tokens": len(prompt),
            "cached_tokens": cached,
            "completion_tokens": completion,
        }

    async def _request(self, prompt: str) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.max_threads = max(self.max_threads, threading.active_count())
        try:
            await asyncio.sleep(self.delay)
            if self.fail_marker and self.fail_marker in prompt:
                raise BackendError(f"fake: refused a prompt containing {self.fail_marker!r}", 400)
        finally:
            self.in_flight -= 1

    async def generate(self, s, params, options):
        await self._request(s.text_)
        text = f"<{len(s.text_)}>"[: max(params.max_new_tokens, 0)]
        meta = self._meta(s.text_, len(text))
        self.prompts.append(s.text_)
        s.usage.add(meta)
        if params.n > 1:
            return GenResult([text + str(i) for i in range(params.n)], meta)
        return GenResult(text, meta)

    async def generate_stream(self, s, params, options):
        prompt = s.text_
        await self._request(prompt)
        text = f"<{len(prompt)}>"
        for i, ch in enumerate(text):
            await asyncio.sleep(0.005)  # a visible pause between pieces
            yield ch, self._meta(prompt, i + 1)
        self.prompts.append(prompt)
        s.usage.add(self._meta(prompt, len(text)))

    async def select(self, s, choices, temperature, method):
        await self._request(s.text_)
        self.prompts.append(s.text_)
        scores = [-float(len(c)) for c in choices]  # shortest choice wins
        best = choices[scores.index(max(scores))]
        s.usage.add(self._meta(s.text_, 0))
        return ChoicesDecision(best, {"scores": scores, "choices_method": "fake"})

    async def cache_prefix(self, s, text):
        meta = self._meta(text, 0)
        self.cached.append(text)
        if s is not None:
            s.usage.add(meta)
        return meta
