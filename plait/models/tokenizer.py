"""The one way plait's processes load a checkpoint's tokenizer, and encode a text prompt.

`AutoTokenizer.from_pretrained` reads config.json to pick a class, and in transformers 5 that
imports the model's configuration module, which pulls in torch.distributed and the kernel hub:
3.5 s per process, measured here, paid by the tokenizer manager, the scheduler and the
detokenizer at every start. A checkpoint whose tokenizer_config.json names the generic fast
class (every checkpoint plait writes: the embedded test models and converted GGUF files) is
loaded as exactly that class straight from tokenizer.json (0.2 s); any other checkpoint goes
through AutoTokenizer as before, so its class-specific behaviour is kept.
"""

from __future__ import annotations

import json
import os
from typing import Any

_GENERIC = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """The tokenizer of the checkpoint directory (or hub id) `path`."""
    config = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(config) and os.path.isfile(os.path.join(path, "tokenizer.json")):
        with open(config, encoding="utf-8") as f:
            cls = json.load(f).get("tokenizer_class")
        if cls in _GENERIC:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, **kwargs)


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """A text prompt's token ids as SGLang and vLLM make them: with the special tokens the
    tokenizer puts around a sequence (Llama's and Mistral's BOS; nothing for SmolLM2 or
    ChatML test models), unless the text already begins with the BOS token (a chat template's
    output, or a program that wrote it), so that a prompt never starts with two. Every entry
    point that takes text (native /generate, /v1/completions, plait.Engine, the language's
    local encoding for `select`) encodes through here, so their ids agree."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos)))
