"""Faults through the real processes: an unsatisfiable constraint through plait.Engine fails
that request (the next one succeeds, the pool returns to idle); a killed scheduler makes the
Engine fail calls with the reason instead of hanging, and makes `plait serve` exit non-zero
within 5 s; a stopped (SIGSTOP) scheduler makes /health unhealthy; the API key is in no
process's argv; SIGTERM stops every process with status 0 and frees the port. (Killing a
child of a server: tests/server/test_lifecycle.py, which checks the exit status too.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

import plait
from plait.launch import ServerProcess

pytestmark = pytest.mark.model

GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


def test_engine_isolates_a_failing_request_then_fails_fast_when_its_scheduler_dies(tiny_llama):
    with plait.Engine(tiny_llama, max_total_tokens=4096) as engine:
        idle = engine.get_server_info()
        for sp in ({"json_schema": json.dumps({"$ref": "#"})},
                   {"ebnf": 'root ::= "a" x\nx ::= x "b"'}):
            with pytest.raises(ValueError, match="accepts no string|no continuation") as e:
                engine.generate("hi", {**GREEDY, **sp})
            assert e.value.status == 400
            assert engine.generate("hi", GREEDY)["meta_info"]["completion_tokens"] == 4
        info = engine.get_server_info()
        assert info["kv_used"] == 0 and info["req_slots_free"] == idle["req_slots_free"]
        assert info["failed_requests"] == 2

        # a long request in flight, then the scheduler dies under it
        result: dict = {}

        def long_call():
            try:
                engine.generate("hi", {"max_new_tokens": 2000, "ignore_eos": True})
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                result["error"] = exc

        caller = threading.Thread(target=long_call)
        caller.start()
        time.sleep(1.0)
        os.kill(engine._children.procs["scheduler"].pid, signal.SIGKILL)
        caller.join(timeout=10)
        assert not caller.is_alive(), "the in-flight call hangs"
        assert "scheduler process died" in str(result["error"])
        started = time.monotonic()
        with pytest.raises(ValueError, match="scheduler process died"):
            engine.generate("hi", GREEDY)
        assert time.monotonic() - started < 2


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def test_server_hides_its_key_reports_a_stall_and_stops_on_sigterm(tiny_llama):
    key = "sekrit-key-4e1f"
    rt = ServerProcess(tiny_llama, api_key=key, max_total_tokens=4096)
    try:
        headers = {"Authorization": f"Bearer {key}"}
        info = httpx.get(rt.url + "/get_server_info", headers=headers, timeout=30).json()
        procs = [rt.pid, *descendants(rt.pid)]
        assert set(info["child_pids"].values()) <= set(procs)
        for pid in procs:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            assert key.encode() not in cmdline, f"the API key is in the argv of pid {pid}"

        scheduler = info["child_pids"]["scheduler"]
        os.kill(scheduler, signal.SIGSTOP)
        try:
            started = time.monotonic()
            health = httpx.get(rt.url + "/health", timeout=30)
            assert health.status_code == 503 and time.monotonic() - started < 10
        finally:
            os.kill(scheduler, signal.SIGCONT)
        assert httpx.get(rt.url + "/health", timeout=30).status_code == 200

        host, port = rt.url.removeprefix("http://").split(":")
        started = time.monotonic()
        rt.proc.send_signal(signal.SIGTERM)
        assert rt.proc.wait(20) == 0  # a requested stop is not a failure
        assert time.monotonic() - started < 15
        for pid in info["child_pids"].values():
            assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid)
        with socket.socket() as s:  # a new server can bind the port (as uvicorn does)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, int(port)))
    finally:
        rt.shutdown()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
