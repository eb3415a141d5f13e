"""Schemathesis against the server's own OpenAPI document (`/openapi.json`): generated bodies,
valid and invalid, for every endpoint. No response may be a 5xx or take long, and the server
is healthy afterwards. A small context (128 tokens) keeps every valid generation short, and
the example count is bounded so the module runs in a minute or two."""

from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.frontend.server_utils import start_server  # noqa: E402

pytestmark = pytest.mark.model

EXAMPLES_PER_OPERATION = 12
MAX_SECONDS_PER_CALL = 30.0


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    rt = start_server(tiny_llama, context_length=128, max_running_requests=16)
    yield rt
    with httpx.Client(base_url=rt.url, timeout=30) as c:  # healthy after the fuzzing
        assert c.get("/health").status_code == 200
        resp = c.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
        assert resp.status_code == 200, resp.text
    rt.shutdown()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


def no_server_error(ctx, response, case) -> None:
    assert response.status_code < 500, (
        f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
    )


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_5xx_and_no_hang(case):
    start = time.monotonic()
    case.call_and_validate(checks=[no_server_error], timeout=MAX_SECONDS_PER_CALL)
    assert time.monotonic() - start < MAX_SECONDS_PER_CALL
