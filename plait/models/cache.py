"""plait's cache directory and the atomic creation of directories in it.

Everything plait builds or downloads (test checkpoints, dequantized GGUF files, fetched
wheels) lives under `$PLAIT_CACHE_DIR` (default `~/.cache/plait/models`). Entries are built
in a temporary sibling and renamed into place, so concurrent starts never see a half-written
entry and the loser of a race simply uses the winner's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("PLAIT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "plait" / "models"


def build_atomically(final: Path, build: Callable[[Path], None]) -> Path:
    """`final` if it exists; else `build(tmp)` in a fresh temporary directory next to it,
    renamed to `final` (a rename that loses a race keeps the winner's directory)."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
