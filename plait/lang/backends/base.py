"""The contract between the interpreter and a model backend.

Every method is a coroutine run on the program's event loop; `s` is the program's Executor
(its `text_`, `messages_`, `cur_role` are the prompt). Each request a backend makes reports
its meta_info to `s.usage.add(meta)`, which is how a batch learns its cached-token fraction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from plait.sampling import SamplingParams

if TYPE_CHECKING:
    from plait.lang.chat_template import ChatTemplate
    from plait.lang.choices import ChoicesDecision, ChoicesSamplingMethod
    from plait.lang.executor import Executor


class UnsupportedFeature(NotImplementedError):
    """A program asked a backend for something it cannot serve; the message names both."""

    def __init__(self, backend: str, feature: str, hint: str = "") -> None:
        message = f"{backend} backend: {feature} is not supported"
        super().__init__(message + (f"; {hint}" if hint else ""))
        self.feature = feature


class BackendError(RuntimeError):
    """A request the server refused or failed (the message carries the server's)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class LogprobOptions:
    """The request options of a gen beside its sampling parameters (SGLang's names)."""

    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LogprobOptions:
        return cls(**{k: v for k, v in d.items() if v is not None})


@dataclass
class Usage:
    """Token counts over every request a program (or a batch) made."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, meta: dict[str, Any] | None) -> None:
        if not meta:
            return
        self.requests += 1
        self.prompt_tokens += int(meta.get("prompt_tokens") or 0)
        self.cached_tokens += int(meta.get("cached_tokens") or 0)
        self.completion_tokens += int(meta.get("completion_tokens") or 0)

    def merge(self, other: Usage) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens

    @property
    def cached_token_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class GenResult:
    text: str | list[str]  # a list when n > 1
    meta_info: dict[str, Any] | list[dict[str, Any]] = field(default_factory=dict)


class Backend(ABC):
    """A model the interpreter can run programs on."""

    name = "backend"
    support_concate_and_append = False  # KV-level concatenation; plait appends text instead

    @abstractmethod
    def get_chat_template(self) -> ChatTemplate: ...

    @abstractmethod
    async def generate(
        self, s: Executor, params: SamplingParams, options: LogprobOptions
    ) -> GenResult: ...

    @abstractmethod
    def generate_stream(
        self, s: Executor, params: SamplingParams, options: LogprobOptions
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yields (new text, meta_info so far); the last meta_info is the final one."""

    async def select(
        self, s: Executor, choices: list[str], temperature: float, method: ChoicesSamplingMethod
    ) -> ChoicesDecision:
        raise UnsupportedFeature(
            self.name,
            "select (scoring choices by prompt log-probabilities)",
            "use RuntimeEndpoint or EngineBackend",
        )

    async def cache_prefix(self, s: Executor | None, text: str) -> dict[str, Any] | None:
        """Prefill `text` (no generation) so later requests sharing it hit the prefix cache;
        backends without a prefix cache do nothing."""
        return None

    def flush_cache(self) -> None:
        """Drop the server's prefix cache (no-op where there is none)."""

    def get_server_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """Release what the backend started (a server, an engine); no-op by default."""
