"""GrammarManager: non-blocking submit, caches (memory, disk), the compile budget with real slow
compiles on both engines, stats, shutdown, and the backend registry."""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from plait.grammar.base import GrammarError
from plait.grammar.manager import GrammarManager, create_grammar_backend
from tests.grammar.conftest import BACKENDS
from tests.procs import descendants

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
# Real compiles that take seconds (measured ~2-3 s each on one core): xgrammar's cost grows
# steeply with the number of optional properties, outlines' DFA doubles with each [ab] after a.
SLOW = {
    "xgrammar": ("json_schema", json.dumps(
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(900)}}
    )),
    "outlines": ("regex", "[ab]*a[ab]{13}"),
}


@pytest.fixture
def make_manager(tokenizer, vocab_size, eos_ids):
    managers = []

    def make(name="xgrammar", **kwargs) -> GrammarManager:
        manager = GrammarManager(name, tokenizer, vocab_size, eos_ids, **kwargs)
        manager.backend  # wait until built, so budgets measure compiles only
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()


@pytest.mark.parametrize("name", BACKENDS)
def test_cache_hits_are_done_futures(make_manager, name):
    manager = make_manager(name)
    first = manager.submit("json_schema", json.dumps(SCHEMA))
    again = manager.submit("json_schema", json.dumps(SCHEMA))
    assert again is first  # the same compile in flight is shared
    grammar = first.result(timeout=30)
    reordered = json.dumps(dict(reversed(list(SCHEMA.items()))))  # same schema, other key order
    hit = manager.submit("json_schema", reordered)
    assert hit.done() and hit.result() is grammar
    stats = manager.stats()
    assert stats["cache_misses"] == 1 and stats["cache_hits"] == 2 and stats["compiles"] == 1
    assert stats["compile_seconds"]["count"] == 1
    # the properties' order is the output's order: each order its own grammar
    two = {"a": {"type": "string"}, "b": {"type": "integer"}}
    ab, ba = (manager.submit("json_schema", json.dumps({"type": "object", "properties": p}))
              for p in (two, dict(reversed(list(two.items())))))
    assert ab.result(timeout=30) is not ba.result(timeout=30)


def test_errors_come_through_the_future(make_manager):
    manager = make_manager()
    bad = manager.submit("regex", "(unclosed")
    with pytest.raises(GrammarError) as info:
        bad.result(timeout=30)
    assert info.value.param == "regex"
    cached = manager.submit("regex", "(unclosed")  # failures are cached too
    assert cached.done()
    with pytest.raises(GrammarError, match="invalid regular expression"):
        cached.result()
    unknown = manager.submit("yaml", "x")
    assert unknown.done()
    with pytest.raises(GrammarError, match="unknown constraint kind"):
        unknown.result()
    assert manager.stats()["failures"] == 1


@pytest.mark.parametrize("name", BACKENDS)
def test_slow_compile_times_out_and_manager_keeps_working(make_manager, name):
    manager = make_manager(name, compile_timeout=0.3, num_workers=1)
    kind, spec = SLOW[name]
    started = time.monotonic()
    slow = manager.submit(kind, spec)
    quick = manager.submit("regex", "[a-z]{2}")  # queued behind the slow one: one worker
    assert time.monotonic() - started < 0.1  # submit never waits
    # the caller's thread keeps running while the engine compiles (it releases the GIL)
    ticks = time.monotonic()
    for _ in range(10):
        time.sleep(0.01)
    assert time.monotonic() - ticks < 0.5
    with pytest.raises(GrammarError, match="exceeded the 0.3 s budget"):
        slow.result(timeout=10)
    assert time.monotonic() - started < 2.0
    assert quick.result(timeout=10) is not None  # the worker moved on
    stats = manager.stats()
    assert stats["timeouts"] == 1 and stats["abandoned_running"] in (0, 1)


def test_late_result_of_a_timed_out_compile_is_cached(make_manager):
    manager = make_manager(compile_timeout=0.02)
    spec = json.dumps(  # ~0.15 s
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(400)}}
    )
    with pytest.raises(GrammarError, match="budget"):
        manager.submit("json_schema", spec).result(timeout=10)
    deadline = time.monotonic() + 30
    while manager.stats()["abandoned_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    retry = manager.submit("json_schema", spec)
    assert retry.done() and retry.result() is not None


@pytest.mark.parametrize("name", BACKENDS)
def test_disk_cache_survives_a_new_manager(make_manager, walker, tmp_path, name):
    first = make_manager(name, cache_dir=str(tmp_path))
    first.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30)
    first.shutdown()  # waits for the disk write, which follows the result
    assert first.stats()["disk_writes"] == 1
    second = make_manager(name, cache_dir=str(tmp_path))
    grammar = second.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30)
    assert second.stats()["disk_hits"] == 1
    walk = walker.walk(grammar.matcher(), seed=1)
    assert walk.terminated and "a" in json.loads(walk.text)


def test_disk_cache_of_an_earlier_translation_is_not_served(make_manager, tmp_path,
                                                             monkeypatch):
    """Grammars cached by a plait whose schema translation differed (slower or since-fixed
    forms) are never loaded: the translation number is part of the cache folder's name."""
    import plait.grammar.xgrammar_backend as xb

    first = make_manager("xgrammar", cache_dir=str(tmp_path))
    first.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30)
    first.shutdown()
    monkeypatch.setattr(xb, "TRANSLATION", xb.TRANSLATION + 1)
    second = make_manager("xgrammar", cache_dir=str(tmp_path))
    second.submit("json_schema", json.dumps(SCHEMA)).result(timeout=30)
    second.shutdown()
    assert second.stats()["disk_hits"] == 0 and second.stats()["disk_writes"] == 1


def test_corrupt_disk_entry_is_a_miss(make_manager, tmp_path):
    first = make_manager(cache_dir=str(tmp_path))
    first.submit("regex", "[0-9]+").result(timeout=30)
    first.shutdown()
    for path in tmp_path.rglob("*.bin"):
        path.write_bytes(b"garbage")
    second = make_manager(cache_dir=str(tmp_path))
    assert second.submit("regex", "[0-9]+").result(timeout=30) is not None
    second.shutdown()
    assert second.stats()["disk_hits"] == 0 and second.stats()["disk_writes"] == 1


def test_shutdown_fails_later_submits(make_manager):
    manager = make_manager()
    manager.shutdown()
    late = manager.submit("regex", "a")
    assert late.done()
    with pytest.raises(GrammarError, match="shut down"):
        late.result()


def test_registry(tokenizer, vocab_size, eos_ids):
    with pytest.raises(ValueError, match="outlines, xgrammar"):
        create_grammar_backend("nope", tokenizer, vocab_size, eos_ids)
    with pytest.raises(ValueError, match="unknown grammar backend"):
        GrammarManager("nope", tokenizer, vocab_size, eos_ids)
    backend = create_grammar_backend("outlines", tokenizer, vocab_size, eos_ids,
                                     any_whitespace=True, max_whitespace=2)
    assert backend.name == "outlines" and backend.whitespace == "[ \\t\\n\\r]{0,2}"


@pytest.mark.parametrize("name", BACKENDS)
def test_any_whitespace_is_bounded(tokenizer, vocab_size, eos_ids, walker, name):
    backend = create_grammar_backend(name, tokenizer, vocab_size, eos_ids,
                                     any_whitespace=True, max_whitespace=3)
    grammar = backend.compile("json_schema", json.dumps(SCHEMA))
    finished = 0
    for seed in range(8):
        walk = walker.walk(grammar.matcher(), seed=seed)
        if walk.terminated:
            finished += 1
            json.loads(walk.text)
            outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', walk.text)
            assert not re.search(r"\s{4}", outside_strings), walk.text
    assert finished


@pytest.mark.heavy
def test_process_isolation_kills_a_slow_compile_and_serves_the_next(make_manager, walker):
    manager = make_manager("outlines", compile_timeout=1.0, num_workers=1, isolation="process")
    # 8x SLOW's states: SLOW["outlines"] compiled within the 1 s budget now and then on a quiet
    # machine (the child is killed at the budget, so the larger one costs nothing more)
    slow = manager.submit("regex", "[ab]*a[ab]{16}")
    quick = manager.submit("json_schema", json.dumps(SCHEMA))  # the next child compiles it
    with pytest.raises(GrammarError, match="exceeded the 1 s budget"):
        slow.result(timeout=200)
    grammar = quick.result(timeout=200)  # serialized in the child, loaded here
    walk = walker.walk(grammar.matcher(), seed=3)
    assert walk.terminated and "a" in json.loads(walk.text)
    stats = manager.stats()
    assert stats["isolation"] == "process" and stats["timeouts"] == 1
    assert stats["abandoned_running"] == 0  # the child was killed, nothing lingers


@pytest.mark.heavy
def test_a_compiler_process_killed_mid_compile_does_not_refuse_the_constraint(make_manager):
    """The child dies for a reason of its own (OOM killer, an operator's kill) while compiling
    a valid constraint: the compile is retried in a fresh child, and nothing refuses it later."""
    manager = make_manager("outlines", compile_timeout=120.0, num_workers=1, isolation="process")
    child = _wait_for_compiler_child()
    idle_cpu = _cpu_ticks(child)
    kind, spec = SLOW["outlines"]
    future = manager.submit(kind, spec)
    deadline = time.monotonic() + 60
    while _cpu_ticks(child) < idle_cpu + 20:  # compiling (0.2 s of CPU into the job)
        assert time.monotonic() < deadline, "the compiler child never started the job"
        time.sleep(0.01)
    os.kill(child, signal.SIGKILL)
    assert future.result(timeout=120) is not None
    assert manager.submit(kind, spec).result(timeout=120) is not None
    assert manager.stats()["failures"] == 0


def _wait_for_compiler_child() -> int:
    """The manager's compiler process, once it waits for jobs."""
    deadline = time.monotonic() + 60
    while True:
        children = [
            pid for pid in descendants(os.getpid())
            if b"plait.grammar.compiler_process" in _cmdline(pid)
        ]
        if children:
            break
        assert time.monotonic() < deadline, "no compiler process started"
        time.sleep(0.05)
    while True:  # started: idle once its CPU time stops growing (its vocabulary tables built)
        ticks = _cpu_ticks(children[0])
        time.sleep(0.5)
        if _cpu_ticks(children[0]) == ticks:
            return children[0]
        assert time.monotonic() < deadline + 120, "the compiler process never went idle"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_isolation_is_checked(tokenizer, vocab_size, eos_ids):
    with pytest.raises(ValueError, match="isolation"):
        GrammarManager("xgrammar", tokenizer, vocab_size, eos_ids, isolation="fork")


@pytest.mark.heavy
def test_lingering_compiles_make_later_jobs_wait_not_fail(make_manager):
    """Two abandoned thread compiles on one worker exceed the linger limit: the next job waits
    for one of them to end and then compiles (failing at once cascaded into refusals)."""
    manager = make_manager(compile_timeout=0.2, num_workers=1)
    kind, spec = SLOW["xgrammar"]
    slow = [manager.submit(kind, spec.replace('"p0"', f'"q{i}"')) for i in range(2)]
    quick = manager.submit("regex", "[0-9]{3}")
    for future in slow:
        with pytest.raises(GrammarError, match="budget"):
            future.result(timeout=30)
    assert quick.result(timeout=60) is not None
    assert manager.stats()["timeouts"] == 2
