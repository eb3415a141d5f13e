"""benchmarks.run times each engine with the others' processes stopped (_others_paused)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import SimpleNamespace

from benchmarks.run import PeerEngine, PeerWorker, _others_paused


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, want: set[str], timeout_s: float = 5.0) -> str:
    end = time.monotonic() + timeout_s
    while (s := _state(pid)) not in want and time.monotonic() < end:
        time.sleep(0.01)
    return s


def test_other_engines_are_stopped_for_a_run_and_continued_after():
    # a peer worker: its own process group (a child in it too); a plait Engine: its children
    group = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], start_new_session=True)
    child = subprocess.Popen(["sleep", "60"])
    worker = PeerWorker.__new__(PeerWorker)
    worker.proc = group
    vllm_on, vllm_off = PeerEngine(worker, "on"), PeerEngine(worker, "off")
    plait = SimpleNamespace(engine=SimpleNamespace(_children=SimpleNamespace(
        procs={"scheduler": SimpleNamespace(popen=child)})))
    engines = [plait, vllm_on, vllm_off]
    try:
        with _others_paused(plait, engines):
            assert _wait_state(group.pid, {"T"}) == "T"
            assert _state(child.pid) != "T"
        assert _wait_state(group.pid, {"S", "R"}) in {"S", "R"}
        # a vLLM engine runs: plait's children stop, its own worker (both engines) does not
        with _others_paused(vllm_on, engines):
            assert _wait_state(child.pid, {"T"}) == "T"
            assert _state(group.pid) != "T"
        assert _wait_state(child.pid, {"S", "R"}) in {"S", "R"}
        # an error inside the run still continues them
        try:
            with _others_paused(plait, engines):
                raise RuntimeError("run failed")
        except RuntimeError:
            pass
        assert _wait_state(group.pid, {"S", "R"}) in {"S", "R"}
    finally:
        os.killpg(group.pid, signal.SIGKILL)  # the sh and its sleep
        child.kill()
        group.wait()
        child.wait()
