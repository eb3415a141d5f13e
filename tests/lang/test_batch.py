"""run_batch at scale on a model-free backend: bounded threads and concurrency, failures stay
on their item, progress bar, results as they finish, and prefix planning."""

from __future__ import annotations

import asyncio
import threading

import pytest

import plait.lang as pl
from plait.lang.backends.base import BackendError
from plait.lang.runner import MAX_BODY_THREADS
from plait.lang.tracer import plan_batch, trace_prefix
from tests.lang.fakes import FakeBackend

N = 2000


@pl.function
def classify(s, i, text):
    s += "Classify the text.\n" + text + "\nLabel:" + pl.gen("label", max_tokens=4)
    if i == 1234:
        raise ValueError("item 1234 is broken")
    s += " because" + pl.gen("why")
    label = s["label"]  # a blocking read: the body holds its thread until gen "label" ran
    s += " (" + label + ")"


def test_run_batch_of_2000_bounded_threads_and_failures(capsys):
    backend = FakeBackend(delay=0.001, fail_marker="REFUSE")
    baseline = threading.active_count()
    items = [{"i": i, "text": "REFUSE" if i == 7 else f"item {i}"} for i in range(N)]
    states = classify.run_batch(items, backend=backend, num_threads=64, progress_bar=True)

    assert len(states) == N and [st.index for st in states] == list(range(N))
    failed = {st.index: st.error() for st in states if st.error() is not None}
    assert set(failed) == {7, 1234}
    assert isinstance(failed[7], BackendError)
    assert isinstance(failed[1234], ValueError)
    ok = states[42]
    assert ok.text().endswith("(" + ok["label"] + ")")
    assert states.summary.num_items == N and states.summary.num_failed == 2
    # bounded: the interpreter loop, tqdm's monitor and at most MAX_BODY_THREADS body threads,
    # never one per program
    assert backend.max_threads <= baseline + 2 + MAX_BODY_THREADS
    assert backend.max_in_flight <= 64
    assert "programs" in capsys.readouterr().err  # the tqdm bar was drawn


def test_async_bodies_use_no_threads():
    backend = FakeBackend(delay=0.001)
    baseline = threading.active_count()

    @pl.function
    async def prog(s, i):
        s += f"n={i} " + pl.gen("a")
        a = await s.aget("a")
        s += a + pl.gen("b")

    states = prog.run_batch([{"i": i} for i in range(N)], backend=backend, max_concurrency=256)
    assert all(st.error() is None for st in states)
    assert backend.max_in_flight <= 256
    assert backend.max_threads <= baseline + 1


def test_run_batch_iter_yields_as_programs_finish():
    backend = FakeBackend()

    @pl.function
    async def prog(s, delay):
        await asyncio.sleep(delay)
        s += pl.gen("a")

    delays = [0.05 * (5 - i) for i in range(5)]
    seen = [
        st.index
        for st in prog.run_batch_iter(
            [{"delay": d} for d in delays], backend=backend, plan_prefix=False
        )
    ]
    assert sorted(seen) == list(range(5))
    assert seen[0] == 4  # the shortest delay finished first


@pl.function
def few_shot(s, header, question):
    s += header
    s += "Q: " + question + "\nA:" + pl.gen("answer")


def test_plan_batch_groups_items_by_prefix():
    backend = FakeBackend()
    rubric = "You grade answers carefully. " * 10
    math = rubric + "Math examples: 1+1=2, 2+2=4, 3+3=6, 4+4=8, 5+5=10, 6+6=12. " * 2
    poems = rubric + "Poem examples: roses are red, violets are blue, sugar is sweet. " * 2
    items = [{"header": (math, poems)[i % 2], "question": f"q{i}"} for i in range(12)]
    plan = plan_batch(few_shot, backend, items)
    assert plan.common_prefix and rubric.startswith(plan.common_prefix)
    assert plan.num_groups == 2
    starts = [items[i]["header"] for i in plan.order]
    assert starts == sorted(starts)  # the two groups are contiguous
    assert len(set(plan.group_prefix.values())) == 2
    for i, item in enumerate(items):
        group = plan.group_prefix[i]
        assert len(group) > len(plan.common_prefix) and (item["header"] + "Q: q").startswith(group)


def test_run_batch_caches_shared_prefixes_once():
    backend = FakeBackend()
    header = "A long shared instruction for every item of the batch. " * 4
    states = few_shot.run_batch(
        [{"header": header, "question": f"q{i}"} for i in range(30)], backend=backend, num_threads=4
    )
    assert len(backend.cached) == 1
    assert all(p.startswith(backend.cached[0]) for p in backend.prompts)
    summary = states.summary
    assert summary.common_prefix_chars == len(backend.cached[0])
    assert 0.8 < summary.cached_token_fraction <= 1.0
    assert "cached" in str(summary)

    backend = FakeBackend()
    few_shot.run_batch(
        [{"header": header, "question": "q"}] * 3, backend=backend, plan_prefix=False
    )
    assert backend.cached == []


def test_trace_prefix_stops_at_the_first_model_call():
    backend = FakeBackend()

    @pl.function
    def prog(s, name):
        s += pl.system("sys")
        with s.user():
            s += "Hi " + name
        s += pl.assistant(pl.gen("reply"))

    prefix = trace_prefix(prog, backend, {"name": "Ann"})
    assert (
        prefix == "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nHi Ann<|im_end|>\n"
        "<|im_start|>assistant\n"
    )

    @pl.function
    async def aprog(s, x):
        s += "static " + x
        await asyncio.sleep(0)
        s += "never traced"

    assert trace_prefix(aprog, backend, {"x": "y"}) == "static y"


def test_batch_items_are_checked():
    with pytest.raises(TypeError, match="list of dicts"):
        few_shot.run_batch("not a list", backend=FakeBackend())
    with pytest.raises(TypeError, match="item 0"):
        few_shot.run_batch([3], backend=FakeBackend())
    with pytest.raises(ValueError, match="num_threads"):
        few_shot.run_batch([{}], backend=FakeBackend(), num_threads=0)
    assert few_shot.run_batch([], backend=FakeBackend()) == []
