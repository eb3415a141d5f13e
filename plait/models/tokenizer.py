"""The one way plait's processes load a checkpoint's tokenizer, and encode a text prompt.

`AutoTokenizer.from_pretrained` reads config.json to pick a class, and in transformers 5 that
imports the model's configuration module, which pulls in torch.distributed and the kernel hub:
3.5 s per process, measured here, paid by the tokenizer manager, the scheduler and the
detokenizer at every start. A checkpoint whose tokenizer_config.json names the generic fast
class (every checkpoint plait writes: the embedded test models and converted GGUF files) is
loaded as exactly that class straight from tokenizer.json (0.2 s); any other checkpoint goes
through AutoTokenizer as before, so its class-specific behaviour is kept. The detokenizer
needs only `decode`, and on such checkpoints gets it without transformers (load_decoder).
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import Future
from typing import Any

_GENERIC = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """The tokenizer of the checkpoint directory (or hub id) `path`; one that cannot be
    loaded is a ValueError naming the path."""
    try:
        return _load_tokenizer(path, **kwargs)
    except (OSError, ValueError) as e:
        reason = " ".join(str(e).split())  # transformers' messages span lines
        raise ValueError(
            f"cannot load a tokenizer from {path} ({type(e).__name__}: {reason})"
        ) from None


def _load_tokenizer(path: str, **kwargs: Any) -> Any:
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        with open(config, encoding="utf-8") as f:
            cls = json.load(f).get("tokenizer_class")
        if cls in _GENERIC:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


class RawDecoder:
    """decode(ids, skip_special_tokens) straight from the `tokenizers` library's Tokenizer:
    what transformers' decode of a generic fast tokenizer calls, without its clean-up."""

    def __init__(self, tokenizer: Any) -> None:
        self.backend = tokenizer

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_decoder(path: str) -> Any:
    """What the detokenizer needs of the checkpoint's tokenizer, `decode(ids,
    skip_special_tokens)`. Importing transformers costs that process ~1 s of CPU at every
    start, beside the scheduler's own start-up on the same cores, for one method: where
    transformers' decode is exactly the `tokenizers` library's (a generic fast tokenizer with
    no space clean-up, whose tokenizer_config.json adds or marks no token that tokenizer.json
    does not already hold as such), a RawDecoder on tokenizer.json; else load_tokenizer."""
    raw = _raw_tokenizer(path)
    return RawDecoder(raw) if raw is not None else load_tokenizer(path)


class DeferredTokenizer:
    """The checkpoint's transformers tokenizer for the scheduler, which needs it only for
    constrained requests (grammar vocabularies, jump-forward's re-encoding): loaded on a
    background thread from start() on (called once the process reported ready: importing
    transformers took ~0.8 s of every start-up before it), while `len()` and `decode` (the
    sampler's vocabulary bound, stop strings) come from the tokenizers library, which on these
    checkpoints answers exactly as transformers does (load_decoder's conditions). Any other
    attribute waits for the load; resolve_tokenizer gives the transformers object itself."""

    def __init__(self, path: str, raw: Any) -> None:
        self._path = path
        self._raw = raw
        self._lock = threading.Lock()
        self._future: Future | None = None

    def start(self) -> None:
        with self._lock:
            if self._future is not None:
                return
            self._future = Future()
        threading.Thread(target=self._load, name="plait-tokenizer", daemon=True).start()

    def _load(self) -> None:
        try:
            self._future.set_result(load_tokenizer(self._path))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for it
            self._future.set_exception(e)

    def resolved(self) -> Any:
        self.start()
        return self._future.result()

    def __len__(self) -> int:
        return self._raw.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._raw.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.resolved(), name)


def load_scheduler_tokenizer(path: str) -> Any:
    """A DeferredTokenizer where load_decoder's conditions hold, else load_tokenizer's."""
    raw = _raw_tokenizer(path)
    return DeferredTokenizer(path, raw) if raw is not None else load_tokenizer(path)


def resolve_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer itself (waiting for a DeferredTokenizer's load)."""
    return tokenizer.resolved() if isinstance(tokenizer, DeferredTokenizer) else tokenizer


def _raw_tokenizer(path: str) -> Any | None:
    config_path = os.path.join(path, "tokenizer_config.json")
    file = os.path.join(path, "tokenizer.json")
    if not (os.path.isfile(config_path) and os.path.isfile(file)):
        return None
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if config.get("tokenizer_class") not in _GENERIC:
        return None
    if config.get("clean_up_tokenization_spaces") is not False:  # defaults differ by version
        return None
    with open(file, encoding="utf-8") as f:
        added = {t["content"]: t for t in json.load(f).get("added_tokens", [])}
    for entry in config.get("added_tokens_decoder", {}).values():
        held = added.get(entry.get("content"))
        if held is None or bool(held.get("special")) != bool(entry.get("special")):
            return None
    named = [config.get(k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")]
    named += list(config.get("additional_special_tokens") or [])
    for token in named:
        content = token.get("content") if isinstance(token, dict) else token
        if content is not None and not added.get(content, {}).get("special"):
            return None  # transformers would make it special: skip_special_tokens then differs
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's token ids as SGLang and vLLM make them: with the special tokens the
    tokenizer puts around a sequence (Llama's and Mistral's BOS; nothing for SmolLM2 or
    ChatML test models), unless the text already begins with the BOS token (a chat template's
    output, or a program that wrote it), so that a prompt never starts with two. Every entry
    point that takes text (native /generate, /v1/completions, plait.Engine, the language's
    local encoding for `select`) encodes through here, so their ids agree."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
