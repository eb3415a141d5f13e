"""GGUF -> Hugging Face checkpoint: dequantized tensors, config, tokenizer and greedy output
against transformers' own GGUF loader (the oracle), on GGUF files written here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import plait
from plait.models.gguf import build_tokenizer, convert_gguf, gguf_checkpoint, read_gguf
from plait.models.resolve import resolve_model_path
from tests.models.gguf_files import (
    build_hf_checkpoint,
    hf_greedy,
    hf_tokenizer,
    without_digit_merges,
    write_gguf,
    write_tokenizer_only_gguf,
)

T = gguf.GGMLQuantizationType
QTYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


@pytest.fixture(scope="module")
def hf_untied(tmp_path_factory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("hf") / "untied")


@pytest.fixture(scope="module")
def hf_tied(tmp_path_factory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("hf") / "tied", tied=True)


def transformers_state(gguf_path: Path) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantized_tensors_match_transformers(hf_untied, tmp_path, qtype):
    path = write_gguf(hf_untied, tmp_path / "m.gguf", T[qtype])
    convert_gguf(path, tmp_path / "hf")
    mine = load_file(tmp_path / "hf" / "model.safetensors")
    ref = transformers_state(path)
    assert set(mine) == set(ref)
    for name, value in mine.items():
        assert torch.equal(value.float(), ref[name].float()), name
    if qtype == "F32":  # lossless: the un-permuted q/k rows are exactly the original ones
        original = load_file(hf_untied / "model.safetensors")
        for name, value in original.items():
            assert torch.equal(value, mine[name]), name
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["torch_dtype"] == ("float16" if qtype == "F16" else "float32")


def test_config_tokenizer_files_and_tied_embeddings(hf_tied, tmp_path):
    path = write_gguf(hf_tied, tmp_path / "m.gguf", T.Q8_0)
    convert_gguf(path, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    original = json.loads((hf_tied / "config.json").read_text())
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
        "rope_theta", "architectures", "tie_word_embeddings",
    ):
        assert config[key] == original[key], key
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_file(tmp_path / "hf" / "model.safetensors")
    assert abs(config["rms_norm_eps"] - original["rms_norm_eps"]) < 1e-9
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_unsupported_quant_type_is_named(hf_untied, tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    bytes_per_row = 128 // 32 * gguf.GGML_QUANT_SIZES[T.Q8_1][1]
    writer.add_tensor("token_embd.weight", np.zeros((4, bytes_per_row), np.uint8), raw_dtype=T.Q8_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    contents = read_gguf(path)
    from plait.models.gguf import dequantize

    with pytest.raises(ValueError, match="token_embd.weight.*Q8_1"):
        dequantize(contents.tensors[0])


def test_unsupported_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported.*llama"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file_is_a_clear_error(hf_untied, tmp_path, keep):
    path = write_gguf(hf_untied, tmp_path / "m.gguf", T.Q8_0)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated|not a readable GGUF"):
        gguf_checkpoint(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written left in the cache


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"definitely not gguf" * 100)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        gguf_checkpoint(path, cache_dir=tmp_path / "cache")


CORPUS = [
    "Hello, world! This is a test.",
    "The year 2024 had 365 days; 3.14159 and 1,000,000 and 42nd street.",
    "  Leading spaces,   runs of   spaces,\ttabs\t\tand trailing spaces   ",
    "Line one\nLine two\r\nLine three\n\n\n\nafter blank lines\n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // "quoted"',
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, عربى",
    "Emoji 🤖🎉👍🏽 and symbols ©®™ ∑∫√ → ← ✓",
    "I'm sure you'll agree it's fine; we've DONE it. THEY'LL see. 'quoted'",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|endoftext|>",
    "text<|im_end|>glued<|im_start|>to specials",
    "12345678901234567890 a1b2c3 x86_64 v0.1.2",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2", "smollm"])
def test_tokenizer_matches_transformers(hf_untied, tmp_path, pre):
    tokens, merges, types = hf_tokenizer(hf_untied)
    if pre == "smollm":
        # SmolLM splits digits one by one before the GPT-2 regex; transformers ignores that, so
        # the two agree only on a vocabulary without digit merges (which SmolLM's is)
        tokens, merges, types = without_digit_merges(tokens, merges, types)
    path = write_tokenizer_only_gguf(tmp_path / "t.gguf", tokens, merges, types, pre=pre)
    mine = build_tokenizer(read_gguf(path))
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    for text in CORPUS:
        expected = ref.encode(text, add_special_tokens=True)
        assert mine.encode(text).ids == expected, (pre, text)
        assert mine.decode(expected, skip_special_tokens=False) == ref.decode(expected)


def test_smollm_splits_digits_one_by_one(hf_untied, tmp_path):
    tokens, merges, types = hf_tokenizer(hf_untied)  # cl100k ranks: has "202" and " 2024"-ish
    path = write_tokenizer_only_gguf(tmp_path / "t.gguf", tokens, merges, types, pre="smollm")
    ids = build_tokenizer(read_gguf(path)).encode("in 2024").ids
    assert [tokens[i] for i in ids] == ["in", "Ġ", "2", "0", "2", "4"]


def test_directory_with_one_gguf_resolves(hf_untied, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    d = tmp_path / "model"
    d.mkdir()
    write_gguf(hf_untied, d / "a.gguf", T.Q8_0)
    first = resolve_model_path(str(d))
    assert Path(first).parent == tmp_path / "cache"
    assert resolve_model_path(str(d / "a.gguf")) == first  # same bytes, same entry
    shutil.copy(d / "a.gguf", tmp_path / "renamed.gguf")
    assert Path(resolve_model_path(str(tmp_path / "renamed.gguf"))).name.split("-")[2] == (
        Path(first).name.split("-")[2]
    )  # keyed by content, not by name
    shutil.copy(d / "a.gguf", d / "b.gguf")
    with pytest.raises(ValueError, match="several GGUF files.*a.gguf, b.gguf"):
        resolve_model_path(str(d))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


@pytest.mark.model
def test_greedy_output_matches_transformers(hf_tied, tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(hf_tied, tmp_path / "m.gguf", T.Q4_1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare 16 tokens whatever they are
    prompts = [[5, 17, 300, 1024, 9], [2047], list(range(100, 160))]
    expected = hf_greedy(model, prompts)
    with plait.Engine(str(path), max_total_tokens=4096) as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                                "ignore_eos": True},
        )
    assert [o["output_ids"] for o in outs] == expected


# offsets of the float16 scale fields in a block (the rest of a block is bit-packed values, so
# random bytes there are valid; random float16 scales could be inf/nan)
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


@pytest.mark.parametrize("qtype", sorted(K_QUANT_SCALES))
def test_k_quants_match_transformers_dequantizer(tmp_path, qtype):
    """`gguf` cannot write K-quants: random valid blocks are written raw, and the values plait
    reads back are compared with transformers' own (torch) dequantizer."""
    from transformers.integrations.gguf.dequant import dequantize as hf_dequantize

    from plait.models.gguf import dequantize

    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[T[qtype]]
    rows, cols = 6, 2 * block_elems
    raw = np.random.default_rng(0).integers(0, 256, (rows * cols // block_elems, block_bytes))
    raw = raw.astype(np.uint8)
    for offset in K_QUANT_SCALES[qtype]:
        scales = np.random.default_rng(1).uniform(1e-3, 0.1, len(raw)).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", raw.reshape(rows, -1), raw_dtype=T[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = read_gguf(tmp_path / "k.gguf").tensors
    mine = dequantize(tensor)
    expected = hf_dequantize(torch.from_numpy(raw.reshape(-1)), int(T[qtype])).reshape(rows, cols)
    assert mine.shape == (rows, cols) and np.isfinite(mine).all() and np.abs(mine).max() > 0
    np.testing.assert_allclose(mine, expected.numpy(), rtol=1e-6, atol=1e-7)
