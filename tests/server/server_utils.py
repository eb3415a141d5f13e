"""Helpers shared by the server tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from plait.launch import ServerProcess

MODEL_NAME = "tiny"
SERVER_ARGS = dict(served_model_name=MODEL_NAME, max_total_tokens=16384, log_level="warning")


def start_server(model_path: str, **overrides) -> ServerProcess:
    return ServerProcess(model_path, **{**SERVER_ARGS, **overrides})


def assert_error(resp: httpx.Response, status: int, param_or_text: str | None = None) -> dict:
    """The response is OpenAI's error body with this status; its message names `param_or_text`."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param_or_text is not None:
        assert param_or_text in err["message"], err
    return err


def wait_for(predicate, timeout: float = 20.0, interval: float = 0.1):
    """Poll until predicate() is truthy; returns its value (fails the test on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout} s")
        time.sleep(interval)


def sse_events(lines) -> list:
    """Parse `data: ...` SSE lines up to [DONE] (which must come last)."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
        else:
            events.append(json.loads(payload))
    assert done, "stream did not end with data: [DONE]"
    return events
