"""Schemathesis against the server's own OpenAPI document (`/openapi.json`): generated bodies,
valid and invalid, for every endpoint. No response may be a 5xx or take long, and the server
is healthy afterwards. A small context (128 tokens) keeps every valid generation short, and
the example count is bounded so the module runs in a minute or two."""

from __future__ import annotations

import os
import time

import httpx
import pytest
import schemathesis

# imported here, at module level: imported lazily inside the fixture (deep in pytest's stack),
# CPython 3.11.7's compile() of one of its modules raised "AST constructor recursion depth
# mismatch" (a CPython bug in the recursion accounting of the AST validator)
import schemathesis.specs.openapi.schemas  # noqa: F401, E402
from hypothesis import HealthCheck, settings

from tests.server.server_utils import start_server

pytestmark = pytest.mark.model

EXAMPLES_PER_OPERATION = int(os.environ.get("PLAIT_FUZZ_EXAMPLES", "12"))
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
    # the coverage phase alone sends ~500 bodies per operation: too slow for the suite; the
    # fuzzing phase (EXAMPLES_PER_OPERATION each, valid and invalid bodies) runs instead
    config = schemathesis.Config.from_dict({"phases": {"coverage": {"enabled": False}}})
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", config=config)


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
    elapsed = time.monotonic() - start
    if os.environ.get("PLAIT_FUZZ_LOG"):
        with open(os.environ["PLAIT_FUZZ_LOG"], "a") as f:
            f.write(f"{elapsed:.2f} {case.method} {case.path} {str(case.body)[:300]}\n")
    assert elapsed < MAX_SECONDS_PER_CALL
