"""Compile constraints off the caller's thread, with a time budget, an in-memory LRU cache and an
optional on-disk cache.

Timeouts: compiles run on threads, because both engines release the GIL while they compile
(xgrammar's C++ compiler and outlines-core's Index construction: measured, a 2 s compile on a
worker thread left a 10 ms ticker on the main thread on time). Neither can be cancelled, so each
compile runs on its own short-lived thread, supervised by one of `num_workers` worker threads
that waits at most `compile_timeout` seconds for it. When the budget runs out the worker fails
the future with a GrammarError and moves on to the next job: the stuck compile keeps one core
busy until it ends (its result is then cached) but it never holds up later compiles nor the
caller. The caller only ever polls `GrammarFuture.done()`.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
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

from plait.grammar.base import CompiledGrammar, GrammarBackend, GrammarError
from plait.grammar.kinds import canonical_spec

logger = logging.getLogger(__name__)

# name -> (module, class), imported on first use so a missing optional engine fails only then
GRAMMAR_BACKENDS: dict[str, tuple[str, str]] = {
    "xgrammar": ("plait.grammar.xgrammar_backend", "XGrammarBackend"),
    "outlines": ("plait.grammar.outlines_backend", "OutlinesBackend"),
}
HISTOGRAM_BOUNDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_STOP = object()


def create_grammar_backend(
    name: str, tokenizer, vocab_size: int, eos_token_ids: list[int], **options
) -> GrammarBackend:
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(
            f"unknown grammar backend {name!r} (known: {', '.join(sorted(GRAMMAR_BACKENDS))})"
        )
    module, cls = GRAMMAR_BACKENDS[name]
    backend_cls = getattr(importlib.import_module(module), cls)
    return backend_cls(tokenizer, vocab_size, list(eos_token_ids), **options)


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
        max_cached: int = 256,
        **backend_options,
    ) -> None:
        if backend_name not in GRAMMAR_BACKENDS:
            raise ValueError(
                f"unknown grammar backend {backend_name!r} "
                f"(known: {', '.join(sorted(GRAMMAR_BACKENDS))})"
            )
        self.backend_name = backend_name
        self.compile_timeout = compile_timeout
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar | GrammarError] = OrderedDict()
        self._inflight: dict[tuple, GrammarFuture] = {}
        self._stats = _Stats()
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        # the backend (tokenizer tables: ~0.5 s on a 100k vocabulary) is built off the caller
        self._backend_future: GrammarFuture = GrammarFuture()
        self._disk: _DiskCache | None = None
        args = (backend_name, tokenizer, vocab_size, eos_token_ids, backend_options, cache_dir)
        threading.Thread(
            target=self._start_backend, args=args, name="grammar-init", daemon=True
        ).start()
        self._workers = [
            threading.Thread(target=self._work, name=f"grammar-worker-{i}", daemon=True)
            for i in range(max(1, num_workers))
        ]
        for worker in self._workers:
            worker.start()

    # ------------------------------------------------------------------ public API
    @property
    def backend(self) -> GrammarBackend:
        """The backend (waits for it to be built)."""
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
                cached=len(self._cache),
                in_flight=len(self._inflight),
                queued=self._queue.qsize(),
                compile_timeout=self.compile_timeout,
            )
        return out

    def shutdown(self) -> None:
        """Stop the workers; pending compiles fail. A running compile cannot be interrupted:
        its thread is a daemon and ends with the process."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for _ in self._workers:
            self._queue.put(_STOP)
        for worker in self._workers:
            worker.join(timeout=1.0)
        self._fail_queued()

    # ------------------------------------------------------------------ workers
    def _start_backend(self, name, tokenizer, vocab_size, eos, options, cache_dir) -> None:
        try:
            backend = create_grammar_backend(name, tokenizer, vocab_size, eos, **options)
            if cache_dir is not None:
                self._disk = _DiskCache(Path(cache_dir), backend, tokenizer, vocab_size, eos)
        except Exception as e:  # noqa: BLE001 - every request must see why, not hang
            logger.exception("grammar backend %s failed to start", name)
            self._backend_future._settle(None, GrammarError(f"grammar backend failed: {e}"))
            return
        self._backend_future._settle(backend, None)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            self._supervise(job)

    def _supervise(self, job: _Job) -> None:
        runner = threading.Thread(
            target=self._run, args=(job,), name="grammar-compile", daemon=True
        )
        started = time.monotonic()
        runner.start()
        # the budget starts when the compile does (and covers a slow backend start)
        runner.join(self.compile_timeout)
        if not runner.is_alive():
            return
        error = GrammarError(
            f"{job.kind}: compiling the constraint exceeded the {self.compile_timeout:g} s budget"
        )
        if job.future._settle(None, error):
            with self._lock:
                self._stats.timeouts += 1
                self._stats.abandoned_running += 1
                self._inflight.pop(job.key, None)
            logger.warning("grammar compile abandoned after %.1f s: %s %.80r",
                           time.monotonic() - started, job.kind, job.spec)

    def _run(self, job: _Job) -> None:
        started = time.monotonic()
        try:
            outcome: CompiledGrammar | GrammarError = self._compile(job)
        except GrammarError as e:
            outcome = e
        except Exception as e:  # noqa: BLE001 - a backend bug must fail one request, not hang it
            logger.exception("grammar compile crashed: %s %.80r", job.kind, job.spec)
            outcome = GrammarError(f"{job.kind}: internal error while compiling ({e})", job.kind)
        self._finish(job, outcome, time.monotonic() - started)

    def _compile(self, job: _Job) -> CompiledGrammar:
        backend = self._backend_future.result()
        if self._disk is not None:
            grammar = self._disk.load(job.key)
            if grammar is not None:
                with self._lock:
                    self._stats.disk_hits += 1
                return grammar
        grammar = backend.compile(job.kind, job.spec)
        if self._disk is not None and self._disk.store(job.key, grammar):
            with self._lock:
                self._stats.disk_writes += 1
        return grammar

    def _finish(self, job: _Job, outcome, seconds: float) -> None:
        with self._lock:
            self._stats.observe(seconds)
            if isinstance(outcome, GrammarError):
                self._stats.failures += 1
            timed_out = job.future.done()
            if timed_out:
                self._stats.abandoned_running -= 1
            self._inflight.pop(job.key, None)
            self._cache[job.key] = outcome  # a late success still serves the next request
            self._cache.move_to_end(job.key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        if not timed_out:
            job.future._settle(*_split(outcome))

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.future._settle(None, GrammarError("grammar manager is shut down"))


def _split(outcome) -> tuple[CompiledGrammar | None, GrammarError | None]:
    return (None, outcome) if isinstance(outcome, GrammarError) else (outcome, None)


def _finished(outcome) -> GrammarFuture:
    if isinstance(outcome, GrammarError):  # a fresh exception per request (own traceback)
        outcome = GrammarError(str(outcome), outcome.param)
    return GrammarFuture.finished(*_split(outcome))


class _DiskCache:
    """Compiled grammars as files, in a folder per (backend version, options, vocabulary)."""

    def __init__(self, root: Path, backend, tokenizer, vocab_size: int, eos: list[int]) -> None:
        self.backend = backend
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        digest = hashlib.sha256(f"{vocab}|{vocab_size}|{eos}".encode()).hexdigest()[:16]
        self.folder = root / f"{backend.fingerprint()}-{digest}"

    def _path(self, key: tuple) -> Path:
        name = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        return self.folder / f"{name}.bin"

    def load(self, key: tuple) -> CompiledGrammar | None:
        path = self._path(key)
        if not path.exists():
            return None
        try:
            return self.backend.deserialize(path.read_bytes())
        except Exception:  # noqa: BLE001 - a stale or torn file is just a miss
            logger.warning("ignoring unreadable grammar cache file %s", path)
            return None

    def store(self, key: tuple, grammar: CompiledGrammar) -> bool:
        data = self.backend.serialize(grammar)
        if data is None:
            return False
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
