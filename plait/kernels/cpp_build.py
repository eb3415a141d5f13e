"""Build (once) and load plait's C++ CPU kernels with torch's cpp_extension.

torch's JIT build guards each build directory with a lock *file* that only the builder
removes: a process killed mid-build (a scheduler shut down while its background build runs,
a test that kills a server) leaves it behind, and every later load then waits for it forever.
Here each build is also serialised by an flock on a file beside it, which the kernel drops
when its holder dies; whoever holds the flock knows nobody is building, so a leftover torch
lock file is stale and removed before torch looks at it.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    tag = f"plait-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / tag / name


def extension_name(name: str, source_text: str, extra_cflags: list[str],
                   extra_ldflags: list[str]) -> str:
    """`name` and a hash of what the build depends on besides torch (in build_directory)."""
    key = "\0".join([source_text, *extra_cflags, "", *extra_ldflags]).encode()
    return f"{name}_{hashlib.sha256(key).hexdigest()[:16]}"


def load_extension(name: str, source: Path, extra_cflags: list[str], extra_ldflags: list[str]):
    """The compiled module (built on first use, then loaded from the build directory)."""
    from torch.utils.cpp_extension import load

    text = source.read_text()
    versioned = extension_name(name, text, extra_cflags, extra_ldflags)
    build_dir = build_directory(versioned)
    build_dir.mkdir(parents=True, exist_ok=True)
    copy = build_dir / source.name  # the same path for every checkout: ninja sees no change
    kwargs = dict(
        name=versioned, sources=[str(copy)], extra_cflags=extra_cflags,
        extra_ldflags=extra_ldflags, build_directory=str(build_dir),
        verbose=os.environ.get("PLAIT_VERBOSE_BUILD") == "1",
    )

    def build():
        if not copy.exists() or copy.read_text() != text:  # written once: its mtime stays
            copy.write_text(text)
        return load(**kwargs)

    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock only
        return build()
    with open(build_dir / "plait.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder
            return build()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
