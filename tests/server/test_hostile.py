"""Hostile requests against a real `plait serve`: each gets a 4xx naming the field, quickly,
and the server keeps serving; admission bursts get 429s without leaking slots; bodies over
--max-request-bytes get 413; per-key rate limits answer 429 with Retry-After; a stalled
scheduler makes requests end with 504 at --request-timeout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.server.server_utils import MODEL_NAME, assert_error, start_server, wait_for

pytestmark = pytest.mark.model

FAST_KEY, LIMITED_KEY, TPM_KEY, BATCH_KEY = "k-fast", "k-limited", "k-tpm", "k-batch"
KEYS = {
    FAST_KEY: {"name": "fast"},
    LIMITED_KEY: {"name": "limited", "rpm": 2},
    TPM_KEY: {"name": "tokens", "tpm": 30},
    BATCH_KEY: {"priority": -1},  # unnamed: its metrics label is a hash
}
MAX_BYTES = 1 << 20
REQUEST_TIMEOUT = 10.0
CHAT = [{"role": "user", "content": "hi"}]
HUGE = 2**64 + 5


@pytest.fixture(scope="module")
def hostile(tiny_llama, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    key_file.write_text(json.dumps(KEYS))
    rt = start_server(
        tiny_llama,
        api_key_file=str(key_file),
        max_running_requests=4,
        max_queued_requests=4,
        max_request_bytes=MAX_BYTES,
        request_timeout=REQUEST_TIMEOUT,
    )
    yield rt
    rt.shutdown()


def client(rt, key: str = FAST_KEY) -> httpx.Client:
    return httpx.Client(base_url=rt.url, timeout=30.0, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def http(hostile):
    with client(hostile) as c:
        yield c


def assert_healthy(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    resp = http.post("/generate", json={"text": "ok", "sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["meta_info"]["completion_tokens"] >= 1


def gen(**sampling) -> dict:
    return {"text": "Hi", "sampling_params": {"max_new_tokens": 4, **sampling}}


def chat(**fields) -> dict:
    return {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, **fields}


# (path, body, field the error names): every class of issue 14, and more
HOSTILE = [
    # non-finite and out-of-range floats (the scheduler once sampled NaN from these)
    ("/generate", gen(temperature=1e39), "temperature"),
    ("/generate", gen(temperature=-0.5), "temperature"),
    ("/generate", gen(repetition_penalty=1e-300), "repetition_penalty"),
    ("/generate", gen(top_p=1.5), "top_p"),
    ("/generate", gen(min_p=-1), "min_p"),
    ("/generate", gen(frequency_penalty=3), "frequency_penalty"),
    ("/v1/chat/completions", chat(temperature=1e39), "temperature"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "presence_penalty": 1e308},
        "presence_penalty",
    ),
    # integers out of range, incl. >= 2**64 (once a 500 that leaked its queue slot)
    ("/generate", gen(seed=HUGE), "seed"),
    ("/generate", gen(top_k=HUGE), "top_k"),
    ("/generate", gen(stop_token_ids=[HUGE]), "stop_token_ids"),
    ("/generate", gen(min_new_tokens=2, stop_token_ids=[10**6]), "stop_token_ids"),
    ("/generate", {"input_ids": [1, HUGE]}, "input_ids"),
    ("/generate", {"input_ids": [1, -3]}, "input_ids"),
    ("/generate", gen(max_new_tokens=HUGE), "max_new_tokens"),
    ("/generate", gen(n=10**6), "n"),
    ("/generate", {"text": ["a"] * 100, "sampling_params": {"n": 100}}, "text"),
    ("/v1/chat/completions", chat(seed=HUGE), "seed"),
    ("/v1/chat/completions", chat(n=500), "n"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "max_tokens": HUGE}, "max_tokens"),
    (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "stop_token_ids": [HUGE]},
        "stop_token_ids",
    ),
    # malformed shapes
    ("/generate", {"input_ids": [[1, 2], 3]}, "input_ids"),
    ("/generate", {"input_ids": [[1, 2], []]}, "input_ids"),
    ("/generate", {"input_ids": [1.5, 2]}, "input_ids"),
    ("/generate", {"text": ["a", 3]}, "text"),
    ("/generate", {"text": ""}, "text"),
    ("/generate", {"text": "x", "sampling_params": [1, 2]}, "sampling_params"),
    ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ("/generate", {"text": "x", "rid": ["a", "b"]}, "rid"),
    ("/generate", {"text": "x", "rid": "r" * 1000}, "rid"),
    ("/generate", {"text": "x", "priority": 10**9}, "priority"),
    ("/generate", {"text": "x", "priority": "high"}, "priority"),
    # strict booleans
    ("/generate", {"text": "x", "stream": "false"}, "stream"),
    ("/generate", {"text": "x", "return_logprob": 1}, "return_logprob"),
    ("/generate", gen(ignore_eos="true"), "ignore_eos"),
    ("/abort_request", {"abort_all": "false"}, "abort_all"),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "x", "echo": "yes"}, "echo"),
    # response volume: top logprobs x rows, stop lists
    (
        "/generate",
        {
            "input_ids": [5] * 3000,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 1000,
            "sampling_params": {"max_new_tokens": 1},
        },
        "top_logprobs_num",
    ),
    (
        "/generate",
        {"text": "x", "top_logprobs_num": 10**6, "return_logprob": True},
        "top_logprobs_num",
    ),
    ("/generate", gen(stop=["a"] * 1000), "stop"),
    ("/generate", gen(stop=["a" * 5000]), "stop"),
    ("/generate", gen(stop=[""]), "stop"),
    # prompt bounds: over the context in tokens, and in characters before tokenizing
    ("/generate", {"input_ids": [5] * 5000}, "input_ids"),
    ("/generate", {"text": "z" * 200_000}, "text"),
    (
        "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": "z" * 200_000}]),
        "messages",
    ),
    # constraints that cannot be served
    ("/generate", gen(regex="(", json_schema="{}"), "json_schema"),
    ("/generate", gen(json_schema="{not json"), "json_schema"),
    ("/generate", gen(regex="a" * (2 << 20)), "body"),  # over --max-request-bytes (413)
    # unknown and unsupported fields
    ("/generate", {"text": "x", "image_data": "b64"}, "image_data"),
    ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools"),
    # OpenAI fields accepted only where nothing changes
    ("/v1/chat/completions", chat(store=True), "store"),
    ("/v1/chat/completions", chat(service_tier="flex"), "service_tier"),
    ("/v1/chat/completions", chat(metadata={str(i): "v" for i in range(17)}), "metadata"),
    ("/v1/chat/completions", chat(metadata={"k": 5}), "metadata"),
    # content parts: text only, and a text part needs its text
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages.0.content.1.type"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     "messages.0.content.0.text"),
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "a", "bogus": 1}]),
     "messages.0.bogus"),
    ("/v1/chat/completions", chat(logit_bias={"5": 1e9}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={str(i): 1 for i in range(5000)}), "logit_bias"),
    ("/generate", gen(logit_bias={"99999999": 1}), "logit_bias"),
]


@pytest.mark.parametrize(
    "path, body, field", HOSTILE, ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(HOSTILE)]
)
def test_hostile_request_is_a_4xx_naming_the_field(http, path, body, field):
    start = time.monotonic()
    resp = http.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert field in err["message"] and err["param"] is not None and field in err["param"], err
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 10_000 + b"]" * 10_000,
        b'{"text": "x", "sampling_params": ' + b'{"a":' * 5000 + b"1" + b"}" * 5001,
        b'{"text": "x", "sampling_params": {"temperature": Infinity}}',
        b'{"text": "x", "sampling_params": {"temperature": NaN}}',
        b'{"text": "x", "sampling_params": {"temperature": 1e999}}',
        b'{"text": "x"',
        b"\xff\xfe",
    ],
)
def test_malformed_json_is_a_400_and_the_connection_stays(http, raw):
    resp = http.post("/generate", content=raw, headers={"Content-Type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] in ("body", "sampling_params.temperature")
    # same client, same keep-alive connection: still answered
    assert http.get("/health").status_code == 200


def test_oversized_body_is_413(http):
    resp = http.post("/generate", content=b"x" * (MAX_BYTES + 1))
    assert_error(resp, 413, "max-request-bytes")

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(MAX_BYTES // 65536 + 2):
            yield b" " * 65536

    resp = http.post("/generate", content=chunks())
    assert_error(resp, 413, "max-request-bytes")


def test_abort_matches_the_rid_exactly(http, hostile):
    async def scenario():
        async with httpx.AsyncClient(
            base_url=hostile.url, timeout=30, headers={"Authorization": f"Bearer {FAST_KEY}"}
        ) as c:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
            long_ = asyncio.create_task(c.post("/generate", json={**body, "rid": "job_1"}))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                info = (await c.get("/get_server_info")).json()
                if info["num_frontend_requests"]:
                    break
                await asyncio.sleep(0.1)
            resp = await c.post("/abort_request", json={"rid": "job"})  # a prefix: no match
            assert resp.json()["aborted"] == []
            resp = await c.post("/abort_request", json={"rid": "job_1"})
            assert resp.json()["aborted"] == ["job_1"]
            out = (await long_).json()
            assert out["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(scenario())


def test_admission_burst_gets_429s_and_frees_its_slots(http, hostile):
    """30 simultaneous long requests with 4 running + 4 queued slots: 22 get 429 at once;
    the 8 admitted are aborted; the slots come back (a later burst is admitted again)."""

    async def burst(refused: int, priority: int | None = None) -> list[int]:
        async with httpx.AsyncClient(
            base_url=hostile.url,
            timeout=60,
            headers={"Authorization": f"Bearer {FAST_KEY}"},
            limits=httpx.Limits(max_connections=64),
        ) as c:
            body = {"text": "x", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
            if priority is not None:
                body["priority"] = priority
            tasks = [asyncio.create_task(c.post("/generate", json=body)) for _ in range(30)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                done = [t for t in tasks if t.done()]
                if len(done) >= refused and all(t.result().status_code == 429 for t in done):
                    break
                if any(t.result().status_code != 429 for t in done):
                    break
                await asyncio.sleep(0.05)
            while not all(t.done() for t in tasks):  # an admitted one may register late
                await c.post("/abort_request", json={"abort_all": True})
                await asyncio.sleep(0.2)
            return [r.status_code for r in await asyncio.gather(*tasks)]

    codes = asyncio.run(burst(22))
    assert codes.count(429) >= 22, codes
    assert codes.count(200) == 30 - codes.count(429)
    # batch-tier requests may not take the reserved share of the queue (1 of 4 slots)
    wait_for(lambda: "plait_admission" in http.get("/metrics").text)
    codes = asyncio.run(burst(23, priority=-1))
    assert codes.count(200) <= 7 and codes.count(429) >= 23, codes
    # nothing leaked: every slot is free again
    assert asyncio.run(burst(22)).count(200) >= 8
    metrics = http.get("/metrics").text
    assert 'plait_admission_requests_total{outcome="refused",tier="batch"}' in metrics
    assert 'plait_admission_requests_total{outcome="admitted",tier="default"}' in metrics
    assert_healthy(http)


def test_bad_requests_leak_no_slot(http):
    for body in (
        gen(seed=HUGE),
        gen(top_k=HUGE),
        gen(stop_token_ids=[HUGE]),
        {"input_ids": [HUGE]},
    ):
        assert http.post("/generate", json=body).status_code == 400
    # 8 slots: 8 concurrent requests all get in
    with httpx.Client(base_url=http.base_url, headers=http.headers, timeout=60) as c:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(lambda _: c.post("/generate", json=gen()).status_code, range(8)))
    assert codes == [200] * 8


def test_rate_limits_answer_429_with_retry_after(hostile):
    with client(hostile, LIMITED_KEY) as c:
        assert c.post("/generate", json=gen()).status_code == 200
        assert c.post("/generate", json=gen()).status_code == 200
        resp = c.post("/generate", json=gen())
        err = assert_error(resp, 429, "requests per minute")
        assert err["code"] == "rate_limit_exceeded"
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
    with client(hostile, TPM_KEY) as c:
        # 30 tokens a minute: one request of ~40 tokens spends them, the next is refused
        assert (
            c.post(
                "/generate", json={"text": "x " * 40, "sampling_params": {"max_new_tokens": 8}}
            ).status_code
            == 200
        )
        resp = c.post("/generate", json=gen())
        assert_error(resp, 429, "tokens per minute")
        assert int(resp.headers["Retry-After"]) >= 1
        metrics = c.get("/metrics").text
    assert 'plait_rate_limited_requests_total{key="limited",limit="rpm"} 1.0' in metrics
    assert 'plait_rate_limited_requests_total{key="tokens",limit="tpm"} 1.0' in metrics
    assert LIMITED_KEY not in metrics and TPM_KEY not in metrics
    with client(hostile, "wrong") as c:
        assert c.post("/generate", json=gen()).status_code == 401


def test_key_priority_caps_the_request_priority(hostile):
    with client(hostile, BATCH_KEY) as c:
        assert c.post("/generate", json={**gen(), "priority": 5}).status_code == 200
        metrics = c.get("/metrics").text
    assert 'plait_admission_requests_total{outcome="admitted",tier="batch"}' in metrics


def test_openapi_document_describes_every_body(http):
    doc = http.get("/openapi.json").json()
    for path in ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request",
                 "/tokenize", "/detokenize"):
        assert "requestBody" in doc["paths"][path]["post"], path


def test_stalled_scheduler_gets_504_at_the_deadline(http):
    """SIGSTOP the scheduler: a request ends with 504 at --request-timeout, not never; once
    the scheduler runs again the server serves (the request was aborted)."""
    pid = http.get("/get_server_info").json()["child_pids"]["scheduler"]
    os.kill(pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        resp = http.post("/generate", json=gen())
        elapsed = time.monotonic() - start
    finally:
        os.kill(pid, signal.SIGCONT)
    assert_error(resp, 504, "request-timeout")
    assert REQUEST_TIMEOUT - 0.5 <= elapsed < REQUEST_TIMEOUT + 5
    wait_for(lambda: http.get("/health").status_code == 200)
    assert_healthy(http)
