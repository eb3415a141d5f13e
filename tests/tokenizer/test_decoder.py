"""The detokenizer's decoder (plait.models.tokenizer.load_decoder): on the checkpoints plait
writes, the `tokenizers` library's decode without transformers, and exactly transformers'
decode; a checkpoint where the two could differ gets transformers' tokenizer."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import gguf
import pytest

from plait.models.gguf import convert_gguf
from plait.models.tokenizer import RawDecoder, load_decoder, load_tokenizer
from tests.models.gguf_files import build_hf_checkpoint, write_gguf


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    """A GGUF file converted by plait (its tokenizer files are plait's GGUF writer's)."""
    root = tmp_path_factory.mktemp("gguf")
    path = write_gguf(build_hf_checkpoint(root / "hf", tied=True), root / "m.gguf",
                      gguf.GGMLQuantizationType.Q8_0)
    convert_gguf(path, root / "converted")
    return str(root / "converted")


@pytest.mark.parametrize("which", ["embedded", "converted"])
def test_raw_decoder_decodes_as_transformers_does(which, tiny_llama, converted):
    path = tiny_llama if which == "embedded" else converted
    decoder, reference = load_decoder(path), load_tokenizer(path)
    assert isinstance(decoder, RawDecoder)
    vocab = len(reference)
    specials = list(reference.all_special_ids)
    assert specials
    rng = random.Random(0)
    sequences = [[i] for i in range(vocab)]
    for _ in range(300):  # texts with special tokens among them, and byte-level fragments
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        seq.insert(rng.randrange(len(seq) + 1), rng.choice(specials))
        sequences.append(seq)
    for seq in sequences:
        for skip in (False, True):
            assert decoder.decode(seq, skip_special_tokens=skip) == reference.decode(
                seq, skip_special_tokens=skip), (seq, skip)


def _copy(path: str, dest: Path, **changes) -> str:
    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(path) / name, dest / name)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    config.update(changes)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return str(dest)


def test_decoder_is_transformers_where_its_decode_could_differ(tiny_llama, tmp_path):
    assert isinstance(load_decoder(_copy(tiny_llama, tmp_path / "same")), RawDecoder)
    for name, changes in {
        "cleanup": {"clean_up_tokenization_spaces": True},
        "cleanup_default": {"clean_up_tokenization_spaces": None},
        # a token transformers makes special that tokenizer.json holds as a plain one
        "special": {"additional_special_tokens": ["hello"]},
        "class": {"tokenizer_class": "GPT2TokenizerFast"},
    }.items():
        decoder = load_decoder(_copy(tiny_llama, tmp_path / name, **changes))
        assert not isinstance(decoder, RawDecoder), name
        assert callable(decoder.decode), name
