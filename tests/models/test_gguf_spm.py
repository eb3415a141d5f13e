"""GGUF files with a SentencePiece vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral 7B
v0.1, TinyLlama): the tokenizer plait rebuilds, and the whole load, against transformers' own
GGUF loader (the oracle), on GGUF files written here (tests/models/gguf_files.py)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import plait
from plait.lang.backends.engine import EngineBackend
from plait.models.gguf import (
    build_tokenizer,
    convert_gguf,
    gguf_checkpoint,
    read_gguf,
    write_tokenizer,
)
from plait.models.tokenizer import load_tokenizer
from tests.models.gguf_files import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    build_hf_checkpoint,
    hf_greedy,
    spm_tokenizer_metadata,
    spm_vocabulary,
    write_gguf,
    write_spm_tokenizer_only_gguf,
)

T = gguf.GGMLQuantizationType

TEXTS = [
    "Hello, world! This is a test.",
    "The quick brown fox jumps over the lazy dog; the theater, thereafter.",
    "  two leading spaces",
    " one leading space",
    "trailing spaces   ",
    "runs  of   spaces    and     more",
    "Line one\nLine two\r\nLine three\n\n\nafter blank lines\n",
    "\ttabs\tand\t\ttabs",
    "def fibonacci(number):\n    return number if number < 2 else fibonacci(number - 1)\n",
    "12345678901234567890 and 3.14159, 1,000,000; 7 and 8 are not pieces",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어",
    "Emoji 🤖🎉👍🏽 and symbols ©®™ ∑∫√ → ✓",
    "I'm sure you'll agree it's fine; we've DONE it.",
    "<s>hello</s>world<unk>",
    " <s> spaced </s> ",
    "[INST] What is 2+2? [/INST] 4</s>",
    "text<|sep|>glued[INST]to specials",
    "\u2581already a piece space",
    "",
    " ",
    "\n",
]


@pytest.fixture(scope="module")
def vocabulary() -> tuple[list[str], list[float], list[int]]:
    return spm_vocabulary()


@pytest.fixture(scope="module")
def hf_spm(tmp_path_factory, vocabulary) -> Path:
    """The test model with embeddings for the SentencePiece vocabulary."""
    out = tmp_path_factory.mktemp("hf") / "spm"
    return build_hf_checkpoint(out, tied=True, vocab_size=len(vocabulary[0]))


def assert_same_tokenizer(mine, ref, texts=TEXTS) -> None:
    """`mine` (a transformers tokenizer) encodes and decodes `texts` as `ref` does."""
    for text in texts:
        for special in (True, False):
            ids = ref.encode(text, add_special_tokens=special)
            assert mine.encode(text, add_special_tokens=special) == ids, (text, special)
            for skip in (False, True):
                expected = ref.decode(ids, skip_special_tokens=skip)
                assert mine.decode(ids, skip_special_tokens=skip) == expected, (text, skip)


@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"add_bos": None},  # older files: no flag, BOS is added
        {"add_bos": False, "add_eos": True},
        {"add_space_prefix": True},
    ],
    ids=["bos", "no-flag", "eos", "space-prefix"],
)
def test_spm_tokenizer_matches_transformers(vocabulary, tmp_path, flags):
    path = write_spm_tokenizer_only_gguf(
        tmp_path / "t.gguf", spm_tokenizer_metadata(*vocabulary, **flags)
    )
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    built = build_tokenizer(read_gguf(path))
    for text in TEXTS:
        expected = ref.encode(text, add_special_tokens=True)
        assert built.encode(text).ids == expected, text
        assert built.decode(expected, skip_special_tokens=False) == ref.decode(expected)
    # what plait's processes load: tokenizer.json + tokenizer_config.json of the conversion
    out = tmp_path / "hf"
    out.mkdir()
    write_tokenizer(read_gguf(path), out, model_max_length=1024)
    mine = load_tokenizer(str(out))
    assert_same_tokenizer(mine, ref)
    assert mine.special_tokens_map == ref.special_tokens_map
    assert sorted(mine.all_special_ids) == sorted(ref.all_special_ids)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert mine.apply_chat_template(chat, tokenize=False) == ref.apply_chat_template(
        chat, tokenize=False
    )


def test_spm_tokenizer_with_equal_scores_matches_transformers(vocabulary, tmp_path):
    """llama.cpp's converter gives every piece the score -1000 when it reads the vocabulary
    from a tokenizer.json: the order of merges is then all in how ties are broken."""
    tokens, scores, types = vocabulary
    flat = [-1000.0 if kind == NORMAL else score for score, kind in zip(scores, types)]
    path = write_spm_tokenizer_only_gguf(
        tmp_path / "t.gguf", spm_tokenizer_metadata(tokens, flat, types)
    )
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    built = build_tokenizer(read_gguf(path))
    for text in TEXTS:
        assert built.encode(text).ids == ref.encode(text), text


def tiny_vocabulary(ab: float, bc: float) -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the byte pieces, '▁', 'a', 'b', 'c', and 'bc' and 'ab' scored `bc` and
    `ab` ('bc' has the lower id)."""
    pieces = [("bc", bc), ("ab", ab), ("\u2581", -9.0), ("a", -9.0), ("b", -9.0), ("c", -9.0)]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [p for p, _ in pieces]
    scores = [0.0] * 259 + [s for _, s in pieces]
    types = [UNKNOWN, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * len(pieces)]
    return tokens, scores, types


@pytest.mark.parametrize(("ab", "bc", "pieces"), [
    (-1.0, -2.0, ["ab", "c"]),
    (-2.0, -1.0, ["a", "bc"]),
])
def test_spm_merges_follow_scores(tmp_path, ab, bc, pieces):
    """Of two overlapping merges in 'abc' the better-scored one wins, whatever the ids."""
    tokens, scores, types = tiny_vocabulary(ab, bc)
    path = write_spm_tokenizer_only_gguf(
        tmp_path / "t.gguf", spm_tokenizer_metadata(tokens, scores, types)
    )
    ids = build_tokenizer(read_gguf(path)).encode("abc", add_special_tokens=False).ids
    assert [tokens[i] for i in ids] == ["\u2581", *pieces]
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="t.gguf")
    assert ref.encode("abc", add_special_tokens=False) == ids


def test_add_space_prefix_false_is_followed(vocabulary, tmp_path):
    """A file that says add_space_prefix false gets no '▁' before its text, as in llama.cpp and
    the model's own SentencePiece model (transformers ignores the flag: a known difference)."""
    path = write_spm_tokenizer_only_gguf(
        tmp_path / "t.gguf", spm_tokenizer_metadata(*vocabulary, add_space_prefix=False)
    )
    tokenizer = build_tokenizer(read_gguf(path))
    tokens = vocabulary[0]
    ids = tokenizer.encode("the fox", add_special_tokens=False).ids
    assert "".join(tokens[i] for i in ids) == "the\u2581fox"
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        # a '▁' in the text reads back as the space it stands for
        assert tokenizer.decode(ids, skip_special_tokens=False) == text.replace("\u2581", " ")


def test_character_without_byte_pieces_is_unknown(tmp_path):
    """A vocabulary without byte pieces cannot spell 'é': it becomes <unk>, as in SentencePiece
    (transformers' GGUF tokenizer drops it)."""
    tokens, scores, types = tiny_vocabulary(-1.0, -2.0)
    keep = [i for i, t in enumerate(types) if t != BYTE]
    tokens, scores, types = ([v[i] for i in keep] for v in (tokens, scores, types))
    path = write_spm_tokenizer_only_gguf(
        tmp_path / "t.gguf", spm_tokenizer_metadata(tokens, scores, types)
    )
    ids = build_tokenizer(read_gguf(path)).encode("abééc", add_special_tokens=False).ids
    assert [tokens[i] for i in ids] == ["\u2581", "ab", "<unk>", "c"]


def test_unsupported_tokenizer_model_is_named(hf_spm, vocabulary, tmp_path):
    bert = spm_tokenizer_metadata(*vocabulary, model="bert")
    path = write_gguf(hf_spm, tmp_path / "m.gguf", T.Q8_0, tokenizer_metadata=bert)
    with pytest.raises(ValueError, match=r"tokenizer model 'bert' is not supported.*gpt2.*llama"):
        gguf_checkpoint(path, cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").iterdir())


def test_spm_checkpoint_files(hf_spm, vocabulary, tmp_path):
    path = write_gguf(
        hf_spm, tmp_path / "m.gguf", T.Q8_0, tokenizer_metadata=spm_tokenizer_metadata(*vocabulary)
    )
    convert_gguf(path, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (
        len(vocabulary[0]), 1, 2
    )
    tok_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is True and tok_config["add_eos_token"] is False
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["unk_token"]) == (
        "<s>", "</s>", "<unk>"
    )
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


@pytest.mark.model
def test_spm_greedy_output_matches_transformers(hf_spm, vocabulary, tmp_path, monkeypatch):
    """Text prompts through plait's tokenizer and model equal transformers' tokenizer and model
    from the same GGUF: same prompt ids (BOS added as transformers adds it, and not a second
    time to a prompt that writes it), same 16 greedy tokens."""
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(
        hf_spm, tmp_path / "m.gguf", T.Q4_0, tokenizer_metadata=spm_tokenizer_metadata(*vocabulary)
    )
    tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare 16 tokens whatever they are
    prompts = [
        "<s>The quick brown fox",
        "  Ünïcödé 🤖 and [INST] tokens [/INST]",
        "def fibonacci(number):\n    return",
    ]
    prompt_ids = [tokenizer.encode(p, add_special_tokens=not p.startswith("<s>"))
                  for p in prompts]
    for ids in prompt_ids:  # one BOS each: added, or written by the first prompt
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    expected = hf_greedy(model, prompt_ids)
    assert len({tuple(e) for e in expected}) == len(expected)  # the prompts matter
    with plait.Engine(str(path), max_total_tokens=4096) as engine:
        outs = engine.generate(
            prompt=prompts, sampling_params={"max_new_tokens": 16, "temperature": 0.0,
                                             "ignore_eos": True},
        )
        # the language's local encoding (select's token ids) agrees with the server's
        local = [EngineBackend(engine)._encode(p) for p in prompts]
    assert local == prompt_ids
    assert [o["output_ids"] for o in outs] == expected
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(ids) for ids in prompt_ids]
    assert [o["text"] for o in outs] == [tokenizer.decode(e) for e in expected]
