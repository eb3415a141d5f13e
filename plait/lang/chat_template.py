"""Role prefixes and suffixes from the model's own Hugging Face chat template.

`with s.user(): ...` needs the text the template puts before and after a message. Rather than a
hand-written table per model family, render the template with a sentinel message and cut the
text around it: the text the new message adds to the conversation, split at the sentinel, is
(prefix, suffix). The assistant prefix is the template's generation prompt (what the model is
served with). Templates that refuse a conversation shape (strict user/assistant alternation)
are retried on a canonical history of the same role.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from plait.matching import common_prefix_len

SENTINEL = "\u00a7PLAIT_MESSAGE\u00a7"
_FILLER = "x"
# Histories to fall back on when a template refuses the real one (strict alternation, ...).
_CANONICAL_HISTORY = {
    "system": ((),),
    "user": ((), ("system",), ("user", "assistant")),
    "assistant": (("user",), ("system", "user")),
}

Render = Callable[[list[dict[str, str]], bool], str]


class ChatTemplate:
    """`get_prefix_and_suffix(role, messages)` as SGLang's ChatTemplate has it, derived from
    `render(messages, add_generation_prompt) -> str`."""

    def __init__(
        self,
        render: Render,
        name: str = "hf",
        stop_token_ids: tuple[int, ...] = (),
        stop_str: tuple[str, ...] = (),
    ) -> None:
        self.render = render
        self.name = name
        self.stop_token_ids = tuple(stop_token_ids)  # end-of-turn tokens (stop gens in a role)
        self.stop_str = tuple(stop_str)
        self._derive = functools.lru_cache(maxsize=512)(self._derive_uncached)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tokenizer(cls, tokenizer: Any, template: str | None = None) -> ChatTemplate | None:
        """The tokenizer's template (or `template`, a Jinja string); None if it has none."""
        template = template or getattr(tokenizer, "chat_template", None)
        if not template:
            return None

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            return tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )

        name = getattr(tokenizer, "name_or_path", "") or "hf"
        out = cls(render, name=str(name))
        out.stop_token_ids = out._end_of_turn_ids(tokenizer)
        return out

    @classmethod
    def from_string(
        cls, template: str, special_tokens: dict[str, str] | None = None, name: str = "jinja"
    ) -> ChatTemplate:
        """A Jinja chat template without its tokenizer (e.g. sent by a server); special_tokens
        gives bos_token/eos_token as the template refers to them."""
        from transformers.utils.chat_template_utils import render_jinja_template

        extra = dict(special_tokens or {})

        def render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
            return rendered[0]

        return cls(render, name=name)

    # ------------------------------------------------------------------ SGLang's interface
    def get_prefix_and_suffix(self, role: str, history: list[dict[str, str]]) -> tuple[str, str]:
        return self._derive(role, tuple(m["role"] for m in history))

    @property
    def default_system_prompt(self) -> None:
        return None  # the template itself inserts one where the model expects it

    # ------------------------------------------------------------------ derivation
    def _derive_uncached(self, role: str, history: tuple[str, ...]) -> tuple[str, str]:
        errors = []
        for roles in (history, *_CANONICAL_HISTORY.get(role, ((),))):
            try:
                return self._split(role, list(roles))
            except Exception as e:  # jinja raise_exception(), a missing sentinel, ...
                errors.append(e)
        raise ValueError(
            f"chat template {self.name}: cannot render a {role!r} message "
            f"after {list(history)}: {errors[0]}"
        ) from errors[0]

    def _split(self, role: str, roles: list[str]) -> tuple[str, str]:
        history = [{"role": r, "content": _FILLER} for r in roles]
        before = self.render(history, False) if history else ""
        after = self.render(history + [{"role": role, "content": SENTINEL}], False)
        start = common_prefix_len(before, after)
        delta = after[start:]
        if SENTINEL not in delta:
            raise ValueError("the template drops or rewrites the message content")
        prefix, suffix = delta.split(SENTINEL, 1)
        if role == "assistant":
            generation_prompt = self.render(history, True)[len(before) :] if history else ""
            if generation_prompt:
                prefix = generation_prompt
        return prefix, suffix

    def _end_of_turn_ids(self, tokenizer: Any) -> tuple[int, ...]:
        """The special token that closes an assistant turn (e.g. <|im_end|>, <|eot_id|>)."""
        try:
            _, suffix = self.get_prefix_and_suffix("assistant", [{"role": "user", "content": ""}])
        except ValueError:
            return ()
        ids = tokenizer.encode(suffix.strip(), add_special_tokens=False) if suffix.strip() else []
        special = set(getattr(tokenizer, "all_special_ids", ()))
        special |= {
            i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special
        }
        return (ids[0],) if ids and ids[0] in special else ()


class PlainChatTemplate(ChatTemplate):
    """`ROLE: content` lines: for backends that take messages, not text (OpenAI), where the
    program's text is only a readable transcript."""

    def __init__(self) -> None:
        super().__init__(self._render, name="plain")

    @staticmethod
    def _render(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        text = "".join(f"{m['role'].upper()}: {m['content']}\n" for m in messages)
        return text + ("ASSISTANT: " if add_generation_prompt else "")
