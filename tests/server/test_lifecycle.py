"""A server of its own (API key, a one-request queue): the key on every endpoint, 429 when
the queue is full, and a killed scheduler failing requests fast with 503, after which the
server exits non-zero (for a supervisor to restart it), stopping every process and freeing
the port. The tests run in file order on one server. (SIGTERM: tests/runtime/test_faults.py.)"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server.server_utils import MODEL_NAME, assert_error, start_server, wait_for

KEY = "sk-plait-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = {"max_new_tokens": 3000, "ignore_eos": True}

ENDPOINTS = [
    ("GET", "/get_model_info", None),
    ("GET", "/model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/server_info", None),
    ("GET", "/health_generate", None),
    ("GET", "/metrics", None),
    ("GET", "/v1/models", None),
    ("GET", "/flush_cache", None),
    ("POST", "/flush_cache", None),
    ("POST", "/generate", {"text": "k", "sampling_params": {"max_new_tokens": 1}}),
    ("POST", "/abort_request", {"rid": "none"}),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "k", "max_tokens": 1}),
    (
        "POST",
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "k"}], "max_tokens": 1},
    ),
    ("GET", "/no/such/route", None),
]


@pytest.fixture(scope="module")
def server(tiny_llama):
    rt = start_server(tiny_llama, api_key=KEY, max_running_requests=1, max_queued_requests=1)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="module")
def child_pids(server):
    return httpx.get(server.url + "/get_server_info", headers=AUTH).json()["child_pids"]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0, headers=AUTH) as client:
        yield client


@pytest.mark.parametrize("method, path, body", ENDPOINTS, ids=[f"{m} {p}" for m, p, _ in ENDPOINTS])
def test_api_key_required(server, method, path, body):
    with httpx.Client(base_url=server.url, timeout=60.0) as anon:
        err = assert_error(anon.request(method, path, json=body), 401, "API key")
        assert err["code"] == "invalid_api_key"
        wrong = {"Authorization": "Bearer sk-wrong"}
        assert_error(anon.request(method, path, json=body, headers=wrong), 401)
        assert_error(anon.request(method, path, json=body, headers={"Authorization": KEY}), 401)
        resp = anon.request(method, path, json=body, headers=AUTH)
        assert resp.status_code != 401
        assert resp.status_code == (404 if path == "/no/such/route" else 200), resp.text


def test_health_is_open(server):
    assert httpx.get(server.url + "/health").status_code == 200


def test_server_info_hides_the_key(http):
    assert http.get("/get_server_info").json()["api_key"] == "<redacted>"


def start_in_background(server, path, body) -> tuple[threading.Thread, dict]:
    result: dict = {}

    def run():
        with httpx.Client(base_url=server.url, timeout=120.0, headers=AUTH) as c:
            try:
                result["resp"] = c.post(path, json=body)
            except httpx.HTTPError as e:
                result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def test_queue_full_is_429_with_retry_after(http, server):
    # one running + one queued fill --max-running-requests 1 --max-queued-requests 1
    background = [
        start_in_background(server, "/generate", {"text": f"fill {i}", "sampling_params": LONG})
        for i in range(2)
    ]
    wait_for(lambda: http.get("/get_server_info").json()["num_frontend_requests"] == 2)
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1})
    err = assert_error(resp, 429, "retry")
    assert err["code"] == "rate_limit_exceeded" and resp.headers["Retry-After"] == "1"
    assert_error(http.post("/generate", json={"text": "y"}), 429)
    assert http.post("/abort_request", json={"abort_all": True}).status_code == 200
    for thread, result in background:
        thread.join(30)
        assert result["resp"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    resp = http.post("/generate", json={"text": "after", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 200


def test_killed_scheduler_fails_requests_fast(http, server, child_pids):
    """A running stream ends with an error event; a queued request gets a 503; both fast."""
    events: list[str] = []

    def stream():
        with httpx.Client(base_url=server.url, timeout=120.0, headers=AUTH) as c:
            body = {"text": "doomed stream", "stream": True, "sampling_params": LONG}
            with c.stream("POST", "/generate", json=body) as resp:
                assert resp.status_code == 200
                events.extend(line for line in resp.iter_lines() if line)

    streaming = threading.Thread(target=stream, daemon=True)
    streaming.start()
    wait_for(lambda: len(events) > 2)
    queued, result = start_in_background(
        server, "/generate", {"text": "doomed", "sampling_params": LONG}
    )
    wait_for(lambda: http.get("/get_server_info").json()["num_frontend_requests"] == 2)
    os.kill(child_pids["scheduler"], signal.SIGKILL)
    killed_at = time.monotonic()
    queued.join(10)
    streaming.join(10)
    assert time.monotonic() - killed_at < 5
    assert_error(result["resp"], 503, "scheduler process died")
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "service_unavailable"
    # then the server exits non-zero (a supervisor restarts it), its other child with it
    assert server.proc.wait(5) != 0
    assert time.monotonic() - killed_at < 5
    for pid in child_pids.values():
        assert not _alive(pid)
    host, port = server.url.removeprefix("http://").split(":")
    with socket.socket() as s:  # a new server can bind the port (as uvicorn does)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0) until reaped; it runs no code
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"
