"""Backends on the tiny-llama checkpoint, shared by the whole folder: one in-process Engine, and
one `plait serve` process (started only when a test asks for it) for RuntimeEndpoint and the
OpenAI backend."""

from __future__ import annotations

import pytest

import plait.lang as pl

SERVER_ARGS = {"max_total_tokens": 65536, "log_level": "warning"}


@pytest.fixture(scope="session")
def engine(tiny_llama):
    import plait

    eng = plait.Engine(tiny_llama, **SERVER_ARGS)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def engine_backend(engine):
    return pl.EngineBackend(engine)


@pytest.fixture(scope="session")
def server(tiny_llama):
    rt = pl.Runtime(tiny_llama, **SERVER_ARGS)
    yield rt
    rt.shutdown()


@pytest.fixture(scope="session")
def endpoint_backend(server):
    return pl.RuntimeEndpoint(server.url)


@pytest.fixture(scope="session")
def openai_backend(server):
    return pl.OpenAI(server.server.args.model_name, base_url=server.url + "/v1", api_key="none")


@pytest.fixture(params=["engine_backend", "endpoint_backend"])
def backend(request):
    """The program suite runs on every native backend."""
    return request.getfixturevalue(request.param)
