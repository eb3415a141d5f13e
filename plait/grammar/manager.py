"""Compile constraints off the caller's thread, with a time budget, an in-memory LRU cache and an
optional on-disk cache.

`submit` never blocks: it returns a GrammarFuture that the caller polls with done(). Jobs go to
`num_workers` worker threads; each hands its job to a compiler (workers.py) and waits at most
`compile_timeout` seconds; a timed-out job fails with a GrammarError and the worker moves on.

isolation="thread" (default): the compile runs on a thread of this process, which both engines
allow because they release the GIL while compiling (measured: a 2 s xgrammar compile on a thread
left a 10 ms ticker on the main thread on time). An abandoned thread cannot be stopped and keeps
its core until it ends (its late result is cached); once more than `num_workers` linger, new
compiles fail fast.
isolation="process": the compile runs in a child process that is killed at the deadline, for
engines whose runaway compiles must not keep memory (outlines-core on a large schema grew past
10 GB). The grammar comes back serialized, which is cheap for outlines-core's Index but can cost
far more than the compile for xgrammar (0.8 s compile, 20 s and 235 MB to serialize one dev
schema's token-mask cache), so it is not the default.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from plait.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    check_satisfiable,
    create_grammar_backend,
)
from plait.grammar.kinds import canonical_spec
from plait.grammar.workers import TIMED_OUT, BackendSpec, ProcessWorker, ThreadWorker
from plait.registry import GRAMMAR_BACKENDS

logger = logging.getLogger(__name__)

# how long a worker waits for lingering (abandoned) thread compiles before failing its job
SATURATED_WAIT = 60.0
HISTOGRAM_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STOP = object()


def grammar_backend_features() -> dict[str, dict]:
    """What each installed backend enforces (GET /get_server_info's `grammar_backends`)."""
    out: dict[str, dict] = {}
    for name in GRAMMAR_BACKENDS.names():
        try:
            out[name] = GRAMMAR_BACKENDS.load(name).supported_features()
        except ImportError as e:
            out[name] = {"error": f"not installed ({e})"}
    return out


class GrammarFuture:
    """A compile in progress; done() never blocks."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._grammar: CompiledGrammar | None = None
        self._error: GrammarError | None = None

    @classmethod
    def finished(cls, grammar: CompiledGrammar | None, error: GrammarError | None) -> GrammarFuture:
        fut = cls()
        fut._settle(grammar, error)
        return fut

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> CompiledGrammar:
        """The compiled grammar; raises its GrammarError. Waits up to `timeout` if not done."""
        if not self._event.wait(timeout):
            raise TimeoutError("grammar compile still running")
        if self._error is not None:
            raise self._error
        assert self._grammar is not None
        return self._grammar

    def _settle(self, grammar: CompiledGrammar | None, error: GrammarError | None) -> bool:
        """First outcome wins (a late compile cannot overwrite a timeout)."""
        with self._lock:
            if self._event.is_set():
                return False
            self._grammar, self._error = grammar, error
            self._event.set()
            return True


@dataclass
class _Job:
    key: tuple[str, str, str]
    kind: str
    spec: str
    future: GrammarFuture = field(default_factory=GrammarFuture)
    compiled_here: bool = False  # compiled on a thread of this process (not loaded, not a child)


@dataclass
class _Stats:
    compiles: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    disk_hits: int = 0
    disk_writes: int = 0
    failures: int = 0
    timeouts: int = 0
    abandoned_running: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(HISTOGRAM_BOUNDS) + 1))

    def observe(self, seconds: float) -> None:
        self.compiles += 1
        self.seconds_sum += seconds
        self.buckets[bisect.bisect_left(HISTOGRAM_BOUNDS, seconds)] += 1

    def as_dict(self) -> dict:
        labels = [str(b) for b in HISTOGRAM_BOUNDS] + ["+Inf"]
        return {
            "compiles": self.compiles,
            "cache_hits": self.cache_hits,
            "cache_misses": self.cache_misses,
            "disk_hits": self.disk_hits,
            "disk_writes": self.disk_writes,
            "failures": self.failures,
            "timeouts": self.timeouts,
            "abandoned_running": self.abandoned_running,
            "compile_seconds": {
                "count": self.compiles,
                "sum": round(self.seconds_sum, 6),
                "buckets": dict(zip(labels, self.buckets)),  # per bucket, not cumulative
            },
        }


class GrammarManager:
    def __init__(
        self,
        backend_name: str,
        tokenizer,
        vocab_size: int,
        eos_token_ids: list[int],
        compile_timeout: float = 5.0,
        cache_dir: str | None = None,
        num_workers: int = 2,
        *,
        isolation: str = "thread",
        max_cached: int = 256,
        **backend_options,
    ) -> None:
        GRAMMAR_BACKENDS.target(backend_name)  # ValueError naming the known ones
        if isolation not in ("process", "thread"):
            raise ValueError(f"isolation must be 'process' or 'thread', got {isolation!r}")
        self.backend_name = backend_name
        self.compile_timeout = compile_timeout
        self.isolation = isolation
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)  # an abandoned compile ended
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[tuple, GrammarFuture] = {}
        self._stats = _Stats()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._spec = BackendSpec(backend_name, GRAMMAR_BACKENDS.target(backend_name)[0], tokenizer,
                                 vocab_size, list(eos_token_ids), backend_options)
        # this process's backend (deserializes, makes matchers) is built off the caller too:
        # vocabulary tables take ~0.5 s on a 100k vocabulary
        self._backend_future: GrammarFuture = GrammarFuture()
        self._disk: _DiskCache | None = None
        threading.Thread(
            target=self._start_backend, args=(cache_dir,), name="grammar-init", daemon=True
        ).start()
        self._workers = [
            threading.Thread(target=self._work, name=f"grammar-worker-{i}", daemon=True)
            for i in range(max(1, num_workers))
        ]
        for worker in self._workers:
            worker.start()
        self._persist_queue: queue.Queue = queue.Queue()
        self._persister = threading.Thread(target=self._persist, name="grammar-persist",
                                           daemon=True)
        self._persister.start()

    # ------------------------------------------------------------------ public API
    @property
    def backend(self) -> GrammarBackend:
        """This process's backend (waits for it to be built)."""
        return self._backend_future.result()  # type: ignore[return-value]

    def submit(self, kind: str, spec: str) -> GrammarFuture:
        """Start compiling (kind, spec); never blocks. A cached grammar is returned done."""
        try:
            key = (self.backend_name, kind, canonical_spec(kind, spec))
        except GrammarError as e:
            return GrammarFuture.finished(None, e)
        with self._lock:
            if self._closed:
                return GrammarFuture.finished(None, GrammarError("grammar manager is shut down"))
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self._stats.cache_hits += 1
                return _finished(cached)
            if key in self._inflight:
                self._stats.cache_hits += 1
                return self._inflight[key]
            self._stats.cache_misses += 1
            job = _Job(key, kind, spec)
            self._inflight[key] = job.future
        self._queue.put(job)
        return job.future

    def stats(self) -> dict:
        with self._lock:
            out = self._stats.as_dict()
            out.update(
                backend=self.backend_name,
                isolation=self.isolation,
                cached=len(self._cache),
                in_flight=len(self._inflight),
                queued=self._queue.qsize(),
                compile_timeout=self.compile_timeout,
            )
        return out

    def shutdown(self) -> None:
        """Stop the workers and their compiler processes; pending compiles fail. (A thread
        compile cannot be interrupted: it is a daemon and ends with the process.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._workers:
            self._queue.put(_STOP)
        for worker in self._workers:
            worker.join(timeout=5.0)
        self._fail_queued()
        self._persist_queue.put(_STOP)  # after the grammars already queued for the disk
        self._persister.join(timeout=60.0)

    # ------------------------------------------------------------------ workers
    def _start_backend(self, cache_dir: str | None) -> None:
        spec = self._spec
        try:
            backend = create_grammar_backend(
                spec.name, spec.tokenizer, spec.vocab_size, spec.eos_token_ids, **spec.options
            )
            if cache_dir is not None:
                self._disk = _DiskCache(Path(cache_dir), backend, spec)
        except Exception as e:
            logger.exception("grammar backend %s failed to start", spec.name)
            self._backend_future._settle(None, GrammarError(f"grammar backend failed: {e}"))
            return
        self._backend_future._settle(backend, None)

    def _work(self) -> None:
        if self.isolation == "process":
            compiler = ProcessWorker(self._spec)
            compiler.start_quietly()  # start the child now, not on the first request
        else:
            compiler = ThreadWorker(lambda: self._backend_future.result(), self._finish_late)
        try:
            while True:
                job = self._queue.get()
                if job is _STOP:
                    return
                self._run(job, compiler)
        finally:
            compiler.close()

    def _run(self, job: _Job, compiler) -> None:
        started = time.monotonic()
        try:
            outcome = self._outcome(job, compiler)
            if isinstance(outcome, CompiledGrammar):  # cached as refused, like any bad spec
                check_satisfiable(outcome, job.kind, self._spec.vocab_size)
        except GrammarError as e:
            outcome = e
        except Exception as e:
            logger.exception("grammar job failed: %s %.80r", job.kind, job.spec)
            outcome = GrammarError(f"{job.kind}: internal error while compiling ({e})", job.kind)
        seconds = time.monotonic() - started
        if outcome is TIMED_OUT:
            self._time_out(job)
            return
        self._finish(job, outcome, seconds)
        if self._disk is not None and isinstance(outcome, CompiledGrammar) and job.compiled_here:
            self._persist_queue.put((job.key, outcome))

    def _outcome(self, job: _Job, compiler):
        """The compiled grammar (or GrammarError, or TIMED_OUT) for a job: from the disk cache,
        else from the compiler; new results are written to the disk cache."""
        backend = self._backend_future.result()
        if self._disk is not None:
            data = self._disk.load(job.key)
            if data is not None:
                grammar = _deserialize(backend, data)
                if grammar is not None:
                    with self._lock:
                        self._stats.disk_hits += 1
                    return grammar
        if self.isolation == "thread" and self._saturated():
            return GrammarError(
                f"{job.kind}: the grammar compiler is still busy with earlier compiles that ran "
                f"over their time limit (waited {SATURATED_WAIT:g} s); try again later", job.kind
            )
        outcome = compiler.compile(job.key, job.kind, job.spec, self.compile_timeout)
        if isinstance(outcome, bytes):  # serialized by a compiler process
            data, outcome = outcome, _deserialize(backend, outcome)
            if outcome is None:
                return GrammarError(f"{job.kind}: the compiled grammar could not be loaded")
        elif isinstance(outcome, CompiledGrammar):
            data = None  # serialized by _persist once the request has its grammar
            job.compiled_here = True
        else:
            return outcome
        if data is not None:
            self._store(job.key, data)
        return outcome

    def _store(self, key: tuple, data: bytes | None) -> None:
        if self._disk is not None and data is not None and self._disk.store(key, data):
            with self._lock:
                self._stats.disk_writes += 1

    def _persist(self) -> None:
        """Write grammars compiled in this process to the disk cache on a thread of its own,
        after their requests got them: serializing can cost far more than compiling (xgrammar:
        0.8 s to compile one dev schema, 20 s and 235 MB of JSON to serialize it)."""
        while True:
            item = self._persist_queue.get()
            if item is _STOP:
                return
            key, grammar = item
            try:
                self._store(key, self._backend_future.result().serialize(grammar))
            except Exception:
                logger.warning("could not persist a compiled grammar", exc_info=True)

    def _saturated(self) -> bool:
        """Whether more than num_workers abandoned compiles still run after waiting up to
        SATURATED_WAIT for some to end. (Failing at once instead turned a few slow compiles
        into a cascade: on the dev schemas under load, 8 timeouts became 90 refusals.)"""
        deadline = time.monotonic() + SATURATED_WAIT
        with self._drained:
            while self._stats.abandoned_running > len(self._workers):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return True
                self._drained.wait(left)
            return False

    def _time_out(self, job: _Job) -> None:
        error = GrammarError(
            f"{job.kind}: compiling the constraint exceeded the {self.compile_timeout:g} s budget",
            job.kind,
        )
        with self._lock:
            self._stats.timeouts += 1
            if self.isolation == "thread":
                self._stats.abandoned_running += 1
            self._inflight.pop(job.key, None)
        job.future._settle(None, error)
        logger.warning("grammar compile stopped after %.1f s: %s %.80r",
                       self.compile_timeout, job.kind, job.spec)

    def _finish(self, job: _Job, outcome, seconds: float) -> None:
        with self._lock:
            self._stats.observe(seconds)
            if isinstance(outcome, GrammarError):
                self._stats.failures += 1
            self._inflight.pop(job.key, None)
            self._remember(job.key, outcome)
        job.future._settle(*_split(outcome))

    def _finish_late(self, key: tuple, outcome) -> None:
        """An abandoned thread compile ended: its result still serves the next request."""
        with self._lock:
            self._stats.abandoned_running -= 1
            self._remember(key, outcome)
            self._drained.notify_all()

    def _remember(self, key: tuple, outcome) -> None:
        self._cache[key] = outcome
        self._cache.move_to_end(key)
        while len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.future._settle(None, GrammarError("grammar manager is shut down"))


def _deserialize(backend: GrammarBackend, data: bytes) -> CompiledGrammar | None:
    try:
        return backend.deserialize(data)
    except Exception:
        logger.warning("ignoring a serialized grammar that does not load", exc_info=True)
        return None


def _split(outcome) -> tuple[CompiledGrammar | None, GrammarError | None]:
    return (None, outcome) if isinstance(outcome, GrammarError) else (outcome, None)


def _finished(outcome) -> GrammarFuture:
    if isinstance(outcome, GrammarError):  # a fresh exception per request (own traceback)
        outcome = GrammarError(str(outcome), outcome.param)
    return GrammarFuture.finished(*_split(outcome))


class _DiskCache:
    """Serialized grammars as files, in a folder per (engine version, options, vocabulary)."""

    def __init__(self, root: Path, backend: GrammarBackend, spec: BackendSpec) -> None:
        vocab = json.dumps(sorted(spec.tokenizer.get_vocab().items()), ensure_ascii=False)
        digest = hashlib.sha256(
            f"{vocab}|{spec.vocab_size}|{spec.eos_token_ids}".encode()
        ).hexdigest()[:16]
        # keys: 2 since specs keep their key order (folders of sorted keys are not read: a
        # schema's grammar there may have come from another order of its properties)
        self.folder = root / f"{backend.fingerprint()}-{digest}-keys2"

    def _path(self, key: tuple) -> Path:
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        return self.folder / f"{name}.bin"

    def load(self, key: tuple) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except OSError:
            return None

    def store(self, key: tuple, data: bytes) -> bool:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self._path(key))  # atomic: readers never see a partial file
        except OSError as e:  # a full or read-only disk must not fail the request
            logger.warning("cannot write grammar cache file in %s: %s", self.folder, e)
            return False
        return True
