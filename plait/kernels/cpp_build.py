"""Build (once) and load plait's C++ CPU kernels with torch's cpp_extension.

torch's JIT build guards each build directory with a lock *file* that only the builder
removes: a process killed mid-build (a scheduler shut down while its background build runs,
a test that kills a server) leaves it behind, and every later load then waits for it forever.
Here each build is also serialised by an flock on a file beside it, which the kernel drops
when its holder dies; whoever holds the flock knows nobody is building, so a leftover torch
lock file is stale and removed before torch looks at it.

A library not built yet is compiled by a builder process of its own (`python -m
plait.kernels.cpp_build`, in its own session), which holds the flock until the compiler is
done; the caller waits for it and then loads the library. Compiled inside the caller, a build
outlived a caller that exited first (the main command answers in seconds, a build takes
minutes on 2 cores): torch's compiler processes ran on, orphaned, after the flock was
released, and the next plait process started the same compile beside them, into the same
files (three sets at once after three short commands on a fresh machine). A builder killed
mid-build takes its compiler with it (_tie_compiles_to_this_process).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)


def build_directory(name: str) -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    tag = f"plait-py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / tag / name


def extension_name(name: str, source_text: str, extra_cflags: list[str],
                   extra_ldflags: list[str]) -> str:
    """`name` and a hash of what the build depends on besides torch (in build_directory)."""
    key = "\0".join([source_text, *extra_cflags, "", *extra_ldflags]).encode()
    return f"{name}_{hashlib.sha256(key).hexdigest()[:16]}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (Linux: /proc/cpuinfo's first `flags` line; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(next((line.split(":", 1)[1].split() for line in text.splitlines()
                           if line.startswith("flags")), []))


@functools.cache
def prefetch_flags() -> list[str]:
    """["-DPLAIT_PREFETCH_L2"] on an Intel CPU (Linux: /proc/cpuinfo's vendor), else []: the
    fp32 linears' software prefetches of their weight stream and next panel (woq_cpu.cpp) then
    go to L2 (prefetcht1) at every row count. On the Intel Xeon VM (~12 GB/s from memory a
    core): SmolLM2's linears 1.09-1.13x at 4-12 rows (1 row even, 32 rows ~1.03x). Without it
    (AMD) the AVX-512 build's go to L2 below 24 rows and to L1 from there on (woq_cpu.cpp's
    kL1FromRows, as measured on the Zen 4 EPYC VM), and its 1-3-row tiles do not prefetch their
    weight stream at all (g_single_tile_stream: the hardware prefetchers alone were 1.01-1.33x
    faster there); the AVX2 build's go to L1. (Decode attention
    prefetches into L2 on every CPU, without this flag: attn_cpu.cpp's header.)"""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    return ["-DPLAIT_PREFETCH_L2"] if "GenuineIntel" in info else []


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
    if not (build_dir / f"{versioned}.so").exists() and os.environ.get(_IN_BUILDER) != "1":
        _run_builder(name, source, extra_cflags, extra_ldflags, build_dir)
    with open(build_dir / "plait.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released by the kernel if this process dies
        try:
            (build_dir / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder
            return build()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


_IN_BUILDER = "PLAIT_KERNEL_BUILDER"


def _run_builder(name: str, source: Path, extra_cflags: list[str], extra_ldflags: list[str],
                 build_dir: Path) -> None:
    """Compile in a builder process (this module's main) and wait for it. It runs in a session
    of its own, so it finishes the build (and holds the flock) even if this process exits or
    its process group is killed first; a later caller then waits on the flock instead of
    compiling again. Its output is appended to build.log beside the library."""
    import json
    import subprocess

    spec = json.dumps([name, str(source), extra_cflags, extra_ldflags])
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, **{_IN_BUILDER: "1"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    log = build_dir / "build.log"
    with open(log, "ab") as out:  # appended: a second caller may start while one builds
        proc = subprocess.Popen(
            [sys.executable, "-m", "plait.kernels.cpp_build", spec], stdin=subprocess.DEVNULL,
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    if proc.wait() != 0:
        tail = log.read_text(errors="replace").strip().splitlines()[-20:]
        raise RuntimeError(f"building {name} failed (exit {proc.returncode}; {log}):\n"
                           + "\n".join(tail))


class BackgroundBuild:
    """One kernel built (first start) or loaded in a background thread, at a lower CPU priority
    than serving (Linux: the thread's nice value, inherited by the compiler it starts); the
    caller runs torch's operators until `ready(module)` has been called. A build that fails
    (no compiler, no ninja) logs a warning and leaves torch's path in place."""

    def __init__(self, what: str, load: Callable[[], Any], ready: Callable[[Any], None]) -> None:
        self.what, self._load, self._ready = what, load, ready
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, block: bool = False) -> None:
        """Start the build once; with `block`, wait for it to end."""
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"plait-build-{self.what}", daemon=True
                )
                self._thread.start()
            thread = self._thread
        if block:
            thread.join()

    def _run(self) -> None:
        try:
            os.nice(10)
        except (OSError, AttributeError):  # not permitted, or not POSIX
            pass
        try:
            module = self._load()
        except (RuntimeError, OSError, ImportError) as e:  # no compiler or ninja, build error
            logger.warning("%s unavailable (%s); using torch's operators", self.what, e)
            return
        self._ready(module)


def _builder_main(argv: list[str]) -> int:
    """The builder process: compile (and import) one library under the flock."""
    import json

    _tie_compiles_to_this_process()
    name, source, extra_cflags, extra_ldflags = json.loads(argv[0])
    load_extension(name, Path(source), extra_cflags, extra_ldflags)
    return 0


def _tie_compiles_to_this_process() -> None:
    """Linux: the commands torch starts (ninja) get SIGTERM if this builder dies first, and
    ninja stops the compilers it runs. A builder killed mid-build (SIGKILL) would otherwise
    leave its compilers running after the flock is released, beside the next builder's."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    import subprocess

    libc = ctypes.CDLL(None, use_errno=True)
    builder, run = os.getpid(), subprocess.run

    def die_with_builder() -> None:  # in the child, between fork and exec
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != builder:  # the builder died before prctl
            os._exit(1)

    def run_tied(*args, **kwargs):
        kwargs.setdefault("preexec_fn", die_with_builder)
        return run(*args, **kwargs)

    subprocess.run = run_tied


if __name__ == "__main__":
    sys.exit(_builder_main(sys.argv[1:]))
