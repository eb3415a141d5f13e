"""Fixtures for the grammar tests: the tiny-llama tokenizer (byte-level BPE, 8.2k tokens, model
vocab 8256 so 61 padded ids exist) and one instance of each backend."""

from __future__ import annotations

import json

import pytest

from plait.grammar.vocab import token_bytes

BACKENDS = ("xgrammar", "outlines")


@pytest.fixture(scope="session")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.fixture(scope="session")
def vocab_size(tiny_llama) -> int:
    with open(f"{tiny_llama}/config.json") as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="session")
def eos_ids(tokenizer) -> list[int]:
    return [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.fixture(scope="session")
def spelled(tokenizer) -> list[bytes | None]:
    return token_bytes(tokenizer)


@pytest.fixture(scope="session")
def backends(tokenizer, vocab_size, eos_ids) -> dict:
    from plait.grammar.manager import create_grammar_backend

    return {name: create_grammar_backend(name, tokenizer, vocab_size, eos_ids) for name in BACKENDS}


@pytest.fixture(scope="session")
def walker(tokenizer, vocab_size, eos_ids, spelled):
    from tests.grammar.walker import Walker

    return Walker(spelled, vocab_size, eos_ids)
