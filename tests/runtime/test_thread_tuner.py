"""ThreadTuner: the adaptive thread count, driven by a fake clock and made-up forward times."""

from __future__ import annotations

import random

import pytest

from plait.runtime.thread_tuner import (
    DECODE,
    EXTEND,
    ThreadTuner,
    TunerConfig,
    candidate_counts,
    size_bucket,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(tuner: ThreadTuner, clock: FakeClock, cost, forwards: int, kind=DECODE, tokens=8):
    """Drive `forwards` forwards; cost(threads, clock.now) is one forward's seconds.
    Returns the thread count of each forward."""
    used = []
    for _ in range(forwards):
        n = tuner.choose(kind, tokens)
        seconds = cost(n, clock.now)
        clock.now += seconds
        tuner.record(kind, tokens, n, seconds)
        used.append(n)
    return used


def fixed(times: dict[int, float]):
    return lambda n, now: times[n]


def test_candidates_are_powers_of_two_up_to_the_maximum():
    assert candidate_counts(1) == (1,)
    assert candidate_counts(2) == (1, 2)
    assert candidate_counts(6) == (1, 2, 4, 6)
    assert candidate_counts(8) == (1, 2, 4, 8)
    with pytest.raises(ValueError, match="max_threads"):
        candidate_counts(0)


def test_size_buckets_are_power_of_two_bins():
    assert [size_bucket(t) for t in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


def test_starts_on_all_threads_and_converges_to_the_faster_count():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    used = run(tuner, clock, fixed({1: 0.028, 2: 0.042}), 200)
    assert used[0] == 2  # today's behaviour until something was measured
    assert used[-150:].count(1) >= 140  # a few probes of 2
    assert tuner.stats()["keys"]["decode/8"]["best"] == 1
    assert tuner.switches == 1


def test_keeps_all_threads_when_they_are_faster_and_probes_rarely():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    used = run(tuner, clock, fixed({1: 0.098, 2: 0.058}), 400)
    assert used[-1] == 2 and tuner.switches == 0
    # 1 thread is 1.7x slower: after its first probe, probes of it stop after one forward
    assert used.count(1) <= 3 + 8
    assert tuner.probes >= 3  # it is re-measured (stale after 5 s, about every 86 forwards)


def test_follows_contention_as_it_comes_and_goes():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)

    def cost(n, now):  # contended between t = 20 s and t = 60 s
        contended = 20.0 <= now < 60.0
        return {1: 0.028, 2: 0.042}[n] if contended else {1: 0.023, 2: 0.017}[n]

    used, times = [], []
    while clock.now < 80.0:
        times.append(clock.now)
        used += run(tuner, clock, cost, 1)

    def share_on(count, start, end):
        window = [n for t, n in zip(times, used) if start <= t < end]
        return window.count(count) / len(window)

    assert share_on(2, 5, 20) > 0.95  # quiet: two threads
    assert share_on(1, 30, 60) > 0.9  # contended: one, within a few seconds of it starting
    assert share_on(2, 70, 80) > 0.9  # quiet again: back to two
    assert tuner.switches >= 2


@pytest.mark.parametrize("seed", range(5))
def test_noise_and_outliers_do_not_mislead_it(seed):
    rng = random.Random(seed)
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)

    def cost(n, now):  # 1 thread 1.25x faster, +-20% noise, 10% of forwards lose a time slice
        base = {1: 0.040, 2: 0.050}[n] * rng.uniform(0.8, 1.2)
        return base + (0.03 if rng.random() < 0.1 else 0.0)

    used = run(tuner, clock, cost, 3000)
    assert used[-2000:].count(1) / 2000 > 0.85
    assert tuner.keys[(DECODE, 8)].best == 1


def test_equal_counts_do_not_flap():
    rng = random.Random(1)
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    run(tuner, clock, lambda n, now: 0.030 * rng.uniform(0.9, 1.1), 3000)
    assert tuner.switches <= 10  # a switch needs a 5% margin; noise crosses it now and then


def test_sizes_and_kinds_are_tuned_apart():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    small = fixed({1: 0.020, 2: 0.030})  # batch 1: one thread faster
    large = fixed({1: 0.100, 2: 0.060})  # batch 32: two threads faster
    for _ in range(20):  # the batch changes size back and forth
        run(tuner, clock, small, 10, tokens=1)
        run(tuner, clock, large, 10, tokens=32)
        run(tuner, clock, large, 3, kind=EXTEND, tokens=1)
    keys = tuner.stats()["keys"]
    assert keys["decode/1"]["best"] == 1
    assert keys["decode/32"]["best"] == 2
    assert keys["extend/1"]["best"] == 2
    assert set(keys["decode/1"]["ms"]) == {"1", "2"}


def test_a_new_size_starts_from_the_nearest_known_size():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    run(tuner, clock, fixed({1: 0.028, 2: 0.042}), 50, tokens=8)
    assert tuner.choose(DECODE, 16) == 1  # contention found at batch 8 holds at batch 16
    assert tuner.choose(EXTEND, 16) == 1  # and for another kind, until it has its own
    run(tuner, clock, fixed({1: 0.9, 2: 0.5}), 50, kind=EXTEND, tokens=1024)
    assert tuner.choose(EXTEND, 32) == 2  # the nearest bucket of its own kind first


def test_probes_of_a_much_slower_count_are_short_and_rare():
    clock = FakeClock()
    cost = fixed({1: 0.035, 2: 0.245})  # 2 threads 7x slower beside a competitor (measured)
    tuner = ThreadTuner(2, clock)
    run(tuner, clock, cost, 40)  # the first probe runs in full (one-off costs)
    before, start = tuner.probes, clock.now
    used = run(tuner, clock, cost, 2000)
    probes = tuner.probes - before
    assert probes >= 5 and used.count(2) == probes  # one forward each ...
    assert probes * 0.245 / (clock.now - start) < 0.05  # ... and spaced: a few % of the time


def test_stale_estimates_are_re_measured_after_a_while():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock, TunerConfig(stale_after_s=5.0, max_interval=10_000))
    run(tuner, clock, fixed({1: 0.5, 2: 0.3}), 30)  # slow forwards: 16 take 4.8 s
    before = tuner.probes
    run(tuner, clock, fixed({1: 0.5, 2: 0.3}), 100)  # 30 s
    assert 2 <= tuner.probes - before <= 30 / (16 * 0.3)


def test_a_drift_of_the_running_count_triggers_a_probe_soon():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock, TunerConfig(stale_after_s=1e9, max_interval=10_000))
    run(tuner, clock, fixed({1: 0.025, 2: 0.020}), 300)  # long settled: no staleness
    used = run(tuner, clock, fixed({1: 0.025, 2: 0.060}), 40)  # contention arrives
    assert used[-10:] == [1] * 10


def test_a_count_set_from_outside_is_ignored_and_stats_report_counts():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    tuner.record(DECODE, 4, 3, 1.0)  # 3 is no candidate
    run(tuner, clock, fixed({1: 0.028, 2: 0.042}), 30)
    s = tuner.stats()
    assert s["mode"] == "adaptive" and s["max_threads"] == 2 and s["threads"] == 1
    assert sum(s["forwards_by_threads"].values()) == 30
    assert s["probes"] >= 1 and s["switches"] == 1


def test_a_key_idle_mid_probe_probes_again_when_it_resumes():
    clock = FakeClock()
    tuner = ThreadTuner(2, clock)
    cost = fixed({1: 0.030, 2: 0.200})
    assert run(tuner, clock, cost, 4) == [2, 2, 2, 1]  # the probe of 1 has begun
    clock.now += 60.0  # no forwards of this size for a minute: every sample expired
    used = run(tuner, clock, cost, 20)
    assert used.count(2) <= 3 and used[-12:] == [1] * 12  # 2 runs again to compare
