"""plait/kernels/cpp_build.py: one compile of a kernel library however many plait processes
want it, even when the process that started the compile exits before it is done."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

# the smallest library torch's loader accepts: a Python module named after the build
_TINY = """
#include <Python.h>
#define PLAIT_CAT2(a, b) a##b
#define PLAIT_CAT(a, b) PLAIT_CAT2(a, b)
#define PLAIT_STR2(a) #a
#define PLAIT_STR(a) PLAIT_STR2(a)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, PLAIT_STR(TORCH_EXTENSION_NAME), NULL, -1};
PyMODINIT_FUNC PLAIT_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&tiny); }
"""

_LOAD = (
    "import sys; from pathlib import Path; from plait.kernels.cpp_build import load_extension; "
    "m = load_extension('plait_tiny', Path(sys.argv[1]), [], []); print('loaded', m.__name__)"
)


@pytest.fixture
def slow_compiler(tmp_path):
    """TORCH_EXTENSIONS_DIR in tmp_path and a compiler that logs each compile's start and
    end ("start PID", "end PID") and takes 4 s more."""
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) echo "start $$" >> {log}; sleep 4; c++ "$@"; rc=$?; '
        f'echo "end $$" >> {log}; exit $rc;; esac\n'
        'exec c++ "$@"\n'
    )
    cxx.chmod(0o755)
    source = tmp_path / "tiny.cpp"
    source.write_text(_TINY)
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), CXX=str(cxx),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    return env, source, log


def test_a_build_outlives_its_caller_and_is_not_started_twice(slow_compiler):
    env, source, log = slow_compiler
    first = subprocess.Popen([sys.executable, "-c", _LOAD, str(source)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not log.exists():  # the compiler has started
        assert first.poll() is None, "the first load ended before compiling"
        assert time.monotonic() < deadline, "no compile started"
        time.sleep(0.05)
    first.kill()  # as a main command that answered, or a server shut down, mid-build
    first.wait()
    second = subprocess.run([sys.executable, "-c", _LOAD, str(source)], env=env, check=False,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "loaded plait_tiny_" in second.stdout
    # the second process waited for the first one's compile instead of starting its own
    assert log.read_text().count("start") == 1


def test_a_failed_build_raises_with_the_compilers_message(slow_compiler):
    env, source, _ = slow_compiler
    source.write_text("this is not C++;\n")
    failed = subprocess.run([sys.executable, "-c", _LOAD, str(source)], env=env, check=False,
                            capture_output=True, text=True, timeout=300)
    assert failed.returncode != 0
    assert "building plait_tiny failed" in failed.stderr
    assert "expected unqualified-id" in failed.stderr  # the compiler's words, from build.log


def _builder_pids(source: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
        if "-m plait.kernels.cpp_build" in cmdline and str(source) in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_builder_takes_its_compile_with_it(slow_compiler):
    """The builder killed mid-compile: its compiler stops too, so the next build runs alone
    (its compile starts after the first one's compiler has gone)."""
    import signal

    env, source, log = slow_compiler
    first = subprocess.Popen([sys.executable, "-c", _LOAD, str(source)], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not log.exists():
        assert time.monotonic() < deadline, "no compile started"
        time.sleep(0.05)
    (builder,) = _builder_pids(source)
    os.kill(builder, signal.SIGKILL)
    first.wait(timeout=60)
    time.sleep(6)  # past the wrapper's 4 s and the compile, had it gone on
    assert "end" not in log.read_text(), "the compile outlived its builder"
    second = subprocess.run([sys.executable, "-c", _LOAD, str(source)], env=env, check=False,
                            capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert log.read_text().split()[::2] == ["start", "start", "end"]  # compiled again, alone
