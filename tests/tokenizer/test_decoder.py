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


@pytest.mark.parametrize("which", ["embedded", "converted"])
def test_deferred_tokenizer_is_transformers_without_loading_it_for_len_and_decode(
        which, tiny_llama, converted):
    from plait.models.tokenizer import (
        DeferredTokenizer,
        load_scheduler_tokenizer,
        resolve_tokenizer,
    )

    path = tiny_llama if which == "embedded" else converted
    deferred, reference = load_scheduler_tokenizer(path), load_tokenizer(path)
    assert isinstance(deferred, DeferredTokenizer)
    assert len(deferred) == len(reference)
    ids = reference.encode("Hello, world! 2024", add_special_tokens=False)
    ids += list(reference.all_special_ids)
    for skip in (False, True):
        assert deferred.decode(ids, skip_special_tokens=skip) == reference.decode(
            ids, skip_special_tokens=skip)
    # anything else is transformers' own, loaded on first use
    assert deferred.encode("Hello", add_special_tokens=False) == reference.encode(
        "Hello", add_special_tokens=False)
    assert deferred.get_vocab() == reference.get_vocab()
    assert type(resolve_tokenizer(deferred)) is type(reference)
    assert resolve_tokenizer(reference) is reference


def test_deferred_tokenizer_imports_transformers_only_when_asked(tiny_llama, tmp_path):
    """len() and decode() (the scheduler's start-up and stop strings) do not import
    transformers; start() loads it in the background; a checkpoint outside load_decoder's
    conditions gets transformers' tokenizer at once."""
    import subprocess
    import sys

    other = _copy(tiny_llama, tmp_path / "other", clean_up_tokenization_spaces=True)
    code = (
        "import sys, time\n"
        "from plait.models.tokenizer import load_scheduler_tokenizer\n"
        f"t = load_scheduler_tokenizer({tiny_llama!r})\n"
        "n = len(t); t.decode([1, 2, 3])\n"
        "before = 'transformers' in sys.modules\n"
        "t.start()\n"
        "t.resolved()\n"
        "after = 'transformers' in sys.modules\n"
        f"eager = type(load_scheduler_tokenizer({other!r})).__name__\n"
        "print(before, after, eager)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    before, after, eager = out.stdout.split()
    assert (before, after) == ("False", "True") and eager != "DeferredTokenizer"
