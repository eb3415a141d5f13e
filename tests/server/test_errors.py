"""Bad requests get OpenAI's error body with the right status and the server keeps serving;
client disconnects abort requests and free their KV; many concurrent streams stay independent."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest

from tests.server.server_utils import MODEL_NAME, assert_error, sse_events, wait_for

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(autouse=True)
def still_serving(http):
    """After every test here, the server answers a normal request."""
    yield
    resp = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ok", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


BAD_REQUESTS = [
    # (path, body, status, text the message must contain)
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "bogus": 1}, 400, "bogus"),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "temperature": "hot"},
        400,
        "temperature",
    ),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": CHAT, "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": [{"role": "robot", "content": "x"}]},
        400,
        "role",
    ),
    ("/v1/chat/completions", {"model": MODEL_NAME}, 400, "messages"),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 10**6},
        400,
        "max_tokens",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "logit_bias": {"1": 500}},
        400,
        "logit_bias",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "response_format": {"type": "yaml"}},
        400,
        "response_format",
    ),
    (
        "/v1/chat/completions",
        {"model": MODEL_NAME, "messages": CHAT, "regex": "a", "ebnf": "root ::= 'a'"},
        400,
        "ebnf",
    ),
    ("/v1/chat/completions", {"model": "gpt-7", "messages": CHAT}, 404, "gpt-7"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": [1, 2, 10**8]}, 400, "prompt"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "word " * 5000}, 400, "context length"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "seed": -3}, 400, "seed"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}, 400, "prompt"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"temperature": -1}},
        400,
        "sampling_params.temperature",
    ),
    ("/generate", {"text": "x", "sampling_params": {"nope": 1}}, 400, "sampling_params.nope"),
    ("/generate", {"text": "x", "extra": 1}, 400, "extra"),
    ("/generate", {"sampling_params": {}}, 400, "text"),
    ("/generate", {"text": "x", "input_ids": [1]}, 400, "text"),
    ("/generate", {"text": "x", "stream": "yes"}, 400, "stream"),
    (
        "/generate",
        {"text": "x", "return_logprob": True, "logprob_start_len": 99},
        400,
        "logprob_start_len",
    ),
    ("/generate", {"input_ids": list(range(100, 5100))}, 400, "context length"),
    (
        "/generate",
        {"text": "x", "sampling_params": {"max_new_tokens": 5000}},
        400,
        "max_new_tokens",
    ),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
]


@pytest.mark.parametrize(
    "path, body, status, text", BAD_REQUESTS, ids=[f"{p}-{t}" for p, _, _, t in BAD_REQUESTS]
)
def test_bad_request(http, path, body, status, text):
    err = assert_error(http.post(path, json=body), status, text)
    if status == 404:
        assert err["code"] == "model_not_found" and err["param"] == "model"
    else:
        assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value", [("regex", "(unclosed"), ("json_schema", '{"type": 5}')])
def test_a_constraint_the_scheduler_refuses_names_its_sampling_params_field(http, stream, field,
                                                                            value):
    """A constraint refused when it compiles (in the scheduler, not when the body is read) is
    named as the /generate body has it: `sampling_params.regex` (it said `regex`)."""
    body = {"text": "x", "stream": stream, "sampling_params": {field: value, "max_new_tokens": 4}}
    err = assert_error(http.post("/generate", json=body), 400, field)
    assert err["param"] == f"sampling_params.{field}", err


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("value, text", [(-5, "must be in"), (10**6, "context length")])
def test_max_completion_tokens_errors_name_it(http, stream, value, text):
    """A bad max_completion_tokens is named as the request gave it (it said max_tokens, a field
    the request did not send)."""
    body = {"messages": CHAT, "max_completion_tokens": value, "stream": stream}
    err = assert_error(http.post("/v1/chat/completions", json=body), 400, text)
    assert err["param"] == "max_completion_tokens", err


def test_min_tokens_over_max_tokens_speaks_openai(http):
    body = {"prompt": "x", "max_tokens": 4, "min_tokens": 9}
    err = assert_error(http.post("/v1/completions", json=body), 400, "min_tokens")
    assert "max_new_tokens" not in err["message"], err


LONG_TEXT, LONG_IDS = "word " * 5000, list(range(100, 5100))  # over the tiny model's context


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": LONG_TEXT}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", LONG_TEXT]}, "prompt.1"),
        ("/v1/completions", {"prompt": [[5, 6], LONG_IDS]}, "prompt.1"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG_TEXT}]},
         "messages"),
        ("/generate", {"text": ["ok", LONG_TEXT]}, "text.1"),
        ("/generate", {"input_ids": [[5, 6], LONG_IDS]}, "input_ids.1"),
    ],
)
def test_a_prompt_over_the_context_is_named_as_the_request_has_it(http, path, body, param):
    """The context-length check runs on the token ids, after normalize(); its error names the
    prompt as the caller wrote it (OpenAI's prompt / messages, a batch's index), not the
    internal text / input_ids of one prompt."""
    err = assert_error(http.post(path, json=body), 400, "context length")
    assert err["param"] == param, err


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": ["ok", LONG_TEXT], "max_tokens": 50}),
        ("/generate", {"text": ["ok", LONG_TEXT], "sampling_params": {"max_new_tokens": 50}}),
    ],
)
def test_a_streamed_batch_with_a_bad_prompt_is_a_status_not_an_event(http, path, body):
    """Every prompt of a batch is tokenized and checked before any of them runs: a prompt over
    the context is a 400, not a 200 whose stream carries the first prompt's tokens and then
    an error event (its tokenizing took longer than the first prompt's first token)."""
    resp = http.post(path, json={**body, "stream": True})
    err = assert_error(resp, 400, "context length")
    assert err["param"] in ("prompt.1", "text.1"), err


@pytest.mark.parametrize("stream", [False, True])
def test_bad_request_while_streaming_is_a_status_not_an_event(http, stream):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 10**6, "stream": stream}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "max_tokens")


@pytest.mark.parametrize(
    "path", ["/generate", "/v1/completions", "/v1/chat/completions", "/abort_request"]
)
@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400(http, path, raw):
    resp = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(resp, 400, "body")


def test_unknown_route_and_method(http):
    assert_error(http.get("/v2/nothing"), 404)
    assert_error(http.get("/v1/chat/completions"), 405)


def test_unknown_fields_are_all_named(http):
    body = {"model": MODEL_NAME, "prompt": "x", "foo": 1, "bar": 2}
    err = assert_error(http.post("/v1/completions", json=body), 400)
    assert "foo" in err["message"] and "bar" in err["message"]


def kv_used(http) -> int:
    return http.get("/get_server_info").json()["kv_used"]


def test_disconnect_mid_stream_aborts_and_frees_kv(http, server):
    idle = kv_used(http)
    aborted = http.get("/get_server_info").json()["aborted_requests"]
    body = {
        "text": "disconnect me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream("POST", "/generate", json=body) as resp:
            events = (line for line in resp.iter_lines() if line)
            for _ in range(6):  # a few tokens arrive, then the client goes away
                assert next(events).startswith("data: ")
            assert kv_used(http) > idle
    wait_for(lambda: http.get("/get_server_info").json()["aborted_requests"] > aborted)
    wait_for(lambda: kv_used(http) == idle)


def test_disconnect_while_waiting_aborts_non_stream_request(http, server):
    idle = kv_used(http)
    aborted = http.get("/get_server_info").json()["aborted_requests"]
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"model": "tiny", "prompt": "hang up", "max_tokens": 3000, "ignore_eos": true}'
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: kv_used(http) > idle)
    wait_for(lambda: http.get("/get_server_info").json()["aborted_requests"] > aborted)
    wait_for(lambda: kv_used(http) == idle)


def test_fifty_concurrent_streams_are_independent(http, server):
    """50 streaming clients at once: each gets exactly what it gets alone (same seed)."""
    prompts = [f"Client {i} asks about topic {i * 7}" for i in range(50)]

    def body(i, stream):
        return {
            "text": prompts[i],
            "stream": stream,
            "sampling_params": {"max_new_tokens": 8, "temperature": 0.8, "seed": i},
        }

    alone = [http.post("/generate", json=body(i, False)).json()["text"] for i in range(0, 50, 5)]

    async def one(client, i):
        async with client.stream("POST", "/generate", json=body(i, True)) as resp:
            assert resp.status_code == 200
            events = sse_events([line async for line in resp.aiter_lines()])
        return events[-1]["text"]

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(50)))

    start = time.monotonic()
    texts = asyncio.run(main())
    assert time.monotonic() - start < 90
    assert texts[0:50:5] == alone
    assert len(set(texts)) > 40  # distinct prompts and seeds give distinct outputs
