"""Fixtures for the HTTP server tests: real `plait serve` processes (launch.ServerProcess) on the
tiny-llama checkpoint, on CPU.

`server` is shared by every module that only sends requests; modules that break a server
(kill its scheduler, fill its queue) start their own.
"""

from __future__ import annotations

import httpx
import pytest

from tests.server.server_utils import start_server


@pytest.fixture(scope="session")
def server(tiny_llama):
    rt = start_server(tiny_llama)
    yield rt
    rt.shutdown()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client
