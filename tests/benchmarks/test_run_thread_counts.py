"""benchmarks.run records, per plait run, the forwards it ran per torch thread count (and the
thread tuner's probes), so a run slower than its peers can be checked for 1-thread forwards."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


def _forwards(counts: dict[str, int]) -> int:
    """All forwards in a thread_counts() reading or a run's record, whatever the thread count."""
    return sum(v for k, v in counts.items() if k.startswith("forwards@"))


def test_each_plait_run_records_its_forwards_per_thread_count(checkpoint):
    from benchmarks import engine as be
    from benchmarks import workloads as wl
    from benchmarks.run import measure, summarize
    from plait.models.config import ModelConfig

    model = checkpoint("tiny-llama")
    adaptive = be.PlaitEngine("adaptive", model, log_level="warning")
    fixed = be.PlaitEngine("fixed", model, log_level="warning", num_threads=1)
    engines = [adaptive, fixed]
    for e in engines:
        e.warmup = lambda w, e=e: e.run_suite(w.head(2))  # as benchmarks.run.local_engines
    w = wl.as_suite(wl.decode(ModelConfig.from_dir(model).vocab_size, n=4, prompt_len=12, out=6))
    try:
        before = adaptive.thread_counts()
        res = measure(engines, [w], 2)
        after = adaptive.thread_counts()
    finally:
        for e in engines:
            e.close()
    runs = res["decode"]["adaptive"]["runs"]
    assert len(runs) == 2
    recorded = [r["threads"] for r in runs]
    # every run did forwards (a prefill and decode steps), each counted once
    assert all(_forwards(t) >= 6 for t in recorded)
    total = sum(_forwards(t) for t in recorded)
    counted = _forwards(after) - _forwards(before)
    assert 0 < total <= counted  # (the warm-ups ran between the two readings too)
    # a fixed thread count has no tuner: no record
    assert all("threads" not in r for r in res["decode"]["fixed"]["runs"])
    # the results JSON keeps each run's record beside its time
    summary = summarize(res, {"decode": w}, model)["decode"]
    assert summary["adaptive"]["threads_all"] == recorded
    assert "threads_all" not in summary["fixed"]
