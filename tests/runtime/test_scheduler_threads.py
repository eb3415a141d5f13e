"""The scheduler's forwards run on the thread count the ThreadTuner picks (adaptive threads)."""

from __future__ import annotations

import pytest
import torch

from plait.args import ServerArgs
from plait.runtime.model_runner import _thread_tuner
from plait.runtime.parallel import TPGroup
from plait.runtime.thread_tuner import HostLoad, ThreadTuner
from tests.runtime.test_scheduler import drain, finished, submit


@pytest.fixture
def restore_torch_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_adaptive_only_for_a_single_cpu_process_without_num_threads(monkeypatch):
    monkeypatch.setattr("plait.runtime.model_runner.available_cores", lambda: 4)
    cpu, args = torch.device("cpu"), ServerArgs()
    assert _thread_tuner(args, cpu, TPGroup()).candidates == (1, 2, 4)
    assert _thread_tuner(args.replace(num_threads=2), cpu, TPGroup()) is None  # fixed count
    assert _thread_tuner(args, torch.device("cuda"), TPGroup()) is None
    assert _thread_tuner(args, cpu, TPGroup(rank=0, size=2)) is None  # a tensor-parallel rank
    monkeypatch.setattr("plait.runtime.model_runner.available_cores", lambda: 1)
    assert _thread_tuner(args, cpu, TPGroup()) is None


def test_num_threads_must_be_positive():
    with pytest.raises(ValueError, match="num_threads"):
        ServerArgs(num_threads=0)


def test_scheduler_switches_torch_threads_to_the_faster_count(
    make_scheduler, restore_torch_threads
):
    """Forward times come from a fake clock that reads torch's thread count at the end of each
    forward: 1 thread is made 5x faster, so the tuner moves the forwards to 1 thread only if the
    runner really sets torch's count before each forward."""
    s, io = make_scheduler(max_total_tokens=2048)
    s.runner.thread_tuner = ThreadTuner(2)
    s.runner.host_load = HostLoad(lambda: None)  # load level 0: the host's load is not tested
    elapsed = [0.0]

    def fake_perf_clock() -> float:
        elapsed[0] += 0.001 if torch.get_num_threads() == 1 else 0.005
        return elapsed[0]

    s.runner.perf_clock = fake_perf_clock
    torch.set_num_threads(2)
    for i in range(4):
        submit(io, f"r{i}", list(range(10 + i, 40 + i)), max_new_tokens=40, ignore_eos=True)
    drain(s)
    assert len(finished(io)) == 4
    threads = s.stats()["threads"]
    assert threads["mode"] == "adaptive" and threads["keys"]["decode/4@0"]["best"] == 1
    assert threads["switches"] >= 1 and threads["forwards_by_threads"]["2"] >= 3
    assert torch.get_num_threads() == 1  # the last forwards ran on one thread


def test_fixed_num_threads_reports_the_count(make_scheduler, restore_torch_threads):
    s, _ = make_scheduler(max_total_tokens=1024, num_threads=1)
    assert s.runner.thread_tuner is None
    assert s.stats()["threads"] == {"mode": "fixed", "threads": torch.get_num_threads()}
