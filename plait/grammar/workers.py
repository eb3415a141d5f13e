"""Where compiles run: in a child process that can be killed (default), or on a thread.

Both engines release the GIL while compiling, so a thread never freezes the caller. But a
thread cannot be stopped: a pathological compile abandoned at its deadline keeps its core and
its memory until it ends, and we measured one (outlines-core on a large schema) grow past 10 GB.
A child process (compiler_process.py) is killed at the deadline instead, and the next job
starts a fresh one. The child sends back the serialized grammar; the caller's process
deserializes it with its own backend (~1-10 ms).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from plait.grammar.base import GrammarError
from plait.grammar.compiler_process import write_frame, write_json

logger = logging.getLogger(__name__)

# a child gets this long to start (imports, vocabulary tables) before its job's budget starts
STARTUP_TIMEOUT = 180.0


class TimedOut:
    """The outcome of a compile that exceeded its budget."""


TIMED_OUT = TimedOut()
Outcome = Any  # CompiledGrammar | bytes (serialized, from a child) | GrammarError | TIMED_OUT


@dataclass(frozen=True)
class BackendSpec:
    """How to build the backend again in a child process."""

    name: str
    module: str
    tokenizer: Any
    vocab_size: int
    eos_token_ids: list[int]
    options: dict


class ThreadWorker:
    """Runs each compile on its own daemon thread and waits for it at most the budget."""

    def __init__(self, get_backend, on_late) -> None:
        self._get_backend = get_backend
        self._on_late = on_late  # called with (key, outcome) when an abandoned compile ends

    def compile(self, key, kind: str, spec: str, timeout: float) -> Outcome:
        box: list[Outcome] = []
        done = threading.Event()
        abandoned = threading.Event()

        def run() -> None:
            box.append(_compile(self._get_backend(), kind, spec, serialize=False))
            done.set()
            if abandoned.is_set():
                self._on_late(key, box[0])

        threading.Thread(target=run, name="grammar-compile", daemon=True).start()
        if done.wait(timeout):
            return box[0]
        abandoned.set()
        if done.is_set():  # finished between the wait and the flag: not abandoned after all
            return box[0]
        return TIMED_OUT

    def close(self) -> None:
        pass


class ProcessWorker:
    """One child process (compiler_process.py) that compiles jobs one at a time; killed when a
    job runs over its budget, and started again for the next job."""

    def __init__(self, spec: BackendSpec) -> None:
        self._spec = spec
        self._child: subprocess.Popen | None = None

    def start_quietly(self) -> None:
        """Start the child ahead of the first job; a failure is retried (and reported) then."""
        try:
            self._ensure_started()
        except GrammarError as e:
            logger.warning("grammar compiler process: %s", e)

    def compile(self, key, kind: str, spec: str, timeout: float) -> Outcome:
        """A child that dies during a job (killed from outside, out of memory) gets the job
        again in a fresh child within the same budget: one death may not be the constraint's
        fault, and the outcome is cached. A second death fails the job."""
        left = timeout  # the budget counts compiling, not a child's start-up
        for attempt in (1, 2):
            try:
                self._ensure_started()
            except GrammarError as e:
                return e
            started = time.monotonic()
            deadline = started + left
            try:
                write_json(self._child.stdin, {"kind": kind, "spec": spec})
                reply = json.loads(self._read(deadline))
                if "ok" in reply:
                    return self._read(deadline)
                return GrammarError(reply["error"], reply.get("param"))
            except TimeoutError:
                self._kill()
                return TIMED_OUT
            except (OSError, EOFError, ValueError) as e:
                self._kill()
                left -= time.monotonic() - started
                if left <= 0:
                    return TIMED_OUT
                if attempt == 2:
                    return GrammarError(
                        f"{kind}: the grammar compiler process failed twice ({e!r})", kind
                    )
                logger.warning("grammar compiler process failed (%r); compiling again", e)
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self._child is None:
            return
        try:
            write_frame(self._child.stdin, b"")  # "exit"
            self._child.wait(timeout=1.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
        self._kill()

    def _ensure_started(self) -> None:
        if self._child is not None and self._child.poll() is None:
            return
        self._kill()
        self._child = subprocess.Popen(
            [sys.executable, "-m", "plait.grammar.compiler_process"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=_child_env(),
        )
        try:
            write_frame(self._child.stdin, pickle.dumps(self._spec))
            reply = json.loads(self._read(time.monotonic() + STARTUP_TIMEOUT))
        except (TimeoutError, OSError, EOFError, ValueError) as e:
            self._kill()
            raise GrammarError(f"the grammar compiler process did not start ({e!r})") from None
        if not reply.get("ready"):
            self._kill()
            raise GrammarError(f"grammar backend failed in the compiler process: {reply['error']}")

    def _read(self, deadline: float) -> bytes:
        """One frame from the child, or TimeoutError at the deadline, EOFError if it died."""
        header = self._read_exactly(4, deadline)
        return self._read_exactly(int.from_bytes(header, "big"), deadline)

    def _read_exactly(self, size: int, deadline: float) -> bytes:
        fd = self._child.stdout.fileno()
        chunks, left = [], size
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise EOFError("the compiler process exited")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _kill(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        if child.poll() is None:
            child.kill()
        child.wait(timeout=5.0)
        for stream in (child.stdin, child.stdout):
            stream.close()


def _child_env() -> dict[str, str]:
    """The child imports plait from where this process did, and uses one OpenMP thread."""
    import plait

    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(plait.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _compile(backend, kind: str, spec: str, serialize: bool) -> Outcome:
    try:
        grammar = backend.compile(kind, spec)
        return backend.serialize(grammar) if serialize else grammar
    except GrammarError as e:
        return e
    except Exception as e:
        logger.exception("grammar compile crashed: %s %.80r", kind, spec)
        return GrammarError(f"{kind}: internal error while compiling ({e})", kind)

