"""plait replicas behind the real sglang-router: `plait serve --dp 2 --router` (two real
`plait serve` replica processes on loopback, the router process in front of them).

The server tests share one module-scoped deployment; the last tests break it (a replica
killed mid-run) and shut it down (nothing left behind), so they run in file order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.server.replicas import free_port_block, replica_args, router_command
from plait.server.router_compat import strip_router_fields
from tests.procs import alive as _alive
from tests.procs import descendants as _descendants
from tests.server.server_utils import assert_error, sse_events, wait_for

START_TIMEOUT_S = 600.0
PREFIX_A = "You grade answers about astronomy. " * 12
PREFIX_B = "Rate the recipe below for clarity and taste. " * 12


# ---------------------------------------------------------------------- no server
def test_strip_router_fields_drops_only_inert_values():
    names = ["plait-tiny"]
    body = {
        "text": "hi",
        "model": None,
        "log_metrics": True,
        "no_logs": False,
        "return_hidden_states": False,
        "background": False,
        "return_bytes": False,
        "return_entropy": False,
        "stream": True,
    }
    assert strip_router_fields("/generate", body, names) == {"text": "hi", "stream": True}
    for name, value in [("background", True), ("return_hidden_states", True), ("return_bytes", 0)]:
        with pytest.raises(RequestError) as e:
            strip_router_fields("/generate", {"text": "hi", name: value}, names)
        assert e.value.status == 400 and e.value.param == name
    with pytest.raises(RequestError) as e:
        strip_router_fields("/generate", {"text": "hi", "model": "gpt-4"}, names)
    assert e.value.status == 404
    # the OpenAI endpoints: "unknown" is the router's stand-in for "no model given"
    chat = {"messages": [], "model": "unknown", "separate_reasoning": True}
    assert strip_router_fields("/v1/chat/completions", chat, names) == {"messages": []}
    assert strip_router_fields("/v1/completions", {"model": "x"}, names) == {"model": "x"}
    # a field the router does not add stays for the endpoint to refuse
    assert strip_router_fields("/v1/completions", {"foo": 1}, names) == {"foo": 1}


def test_router_fields_middleware():
    """The ASGI wrapper hands the endpoint the stripped body, answers 400 itself for a
    non-inert value, and stops buffering past --max-request-bytes (the endpoint's 413)."""
    import asyncio
    import json as jsonlib
    from types import SimpleNamespace

    from plait.server.router_compat import RouterFields

    async def endpoint(scope, receive, send):
        chunks = []
        while True:
            m = await receive()
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        seen.append(b"".join(chunks))

    def call(chunks: list[bytes], limit: int = 1 << 20) -> list[dict]:
        app = SimpleNamespace(
            state=SimpleNamespace(
                model_names=["plait-tiny"], args=SimpleNamespace(max_request_bytes=limit)
            )
        )
        scope = {"type": "http", "method": "POST", "path": "/generate", "app": app}
        pending = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        sent: list[dict] = []

        async def receive():
            return pending.pop(0)

        async def send(m):
            sent.append(m)

        asyncio.run(RouterFields(endpoint)(scope, receive, send))
        return sent

    seen: list[bytes] = []
    body = jsonlib.dumps({"text": "hi", "background": False, "log_metrics": True}).encode()
    assert call([body[:10], body[10:]]) == []
    assert jsonlib.loads(seen[-1]) == {"text": "hi"}
    sent = call([jsonlib.dumps({"text": "hi", "background": True}).encode()])
    assert sent[0]["status"] == 400 and b"background" in sent[1]["body"]
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"text": "x"', b"\xff\xfe"):
        assert call([raw]) == []  # unparsable: untouched, for the endpoint's 400
        assert seen[-1] == raw
    big = [b"x" * 600, b"y" * 600, b"z" * 600]
    assert call(big, limit=1000) == []
    assert seen[-1] == b"".join(big)  # passed through untouched, for the endpoint to refuse


def test_replica_ports_and_router_command():
    args = ServerArgs(port=40000, dp_size=3, router=True, router_policy="round_robin")
    replicas = [replica_args(args, i) for i in range(3)]
    assert [r.port for r in replicas] == [40001, 40002, 40003]
    assert all(r.dp_size == 1 and not r.router for r in replicas)
    cmd = router_command(args, [r.url for r in replicas])
    i = cmd.index("--worker-urls")
    assert cmd[i + 1 : i + 4] == [r.url for r in replicas]
    assert cmd[cmd.index("--policy") + 1] == "round_robin"
    assert cmd[cmd.index("--port") + 1] == "40000"
    with pytest.raises(ValueError, match="router_policy"):
        ServerArgs(router_policy="fastest")
    with pytest.raises(ValueError, match="dp_size"):
        ServerArgs(dp_size=0)


# ---------------------------------------------------------------------- deployment
class Deployment:
    def __init__(self, log_path) -> None:
        self.port = free_port_block(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica_urls = [f"http://127.0.0.1:{self.port + i}" for i in (1, 2)]
        self.log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plait",
                "serve",
                "--dp",
                "2",
                "--router",
                "--model",
                "plait-tiny",
                "--port",
                str(self.port),
                "--max-total-tokens",
                "16384",
                "--log-level",
                "warning",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for(self._ready, timeout=START_TIMEOUT_S, interval=1.0)
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            pytest.fail(f"plait serve --dp 2 --router exited with {self.proc.returncode}")
        try:
            body = httpx.get(self.url + "/readiness", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return False
        return body.get("healthy_workers") == 2

    def stats(self, i: int) -> dict:
        return httpx.get(self.replica_urls[i] + "/get_server_info", timeout=30).json()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    pytest.importorskip(
        "sglang_router", reason="sglang-router is not installed (pip install 'plait[router]')"
    )
    d = Deployment(tmp_path_factory.mktemp("router") / "serve.log")
    yield d
    d.stop()


@pytest.fixture
def client(deployment):
    with httpx.Client(base_url=deployment.url, timeout=120) as c:
        yield c


def _greedy(**extra) -> dict:
    return {"max_new_tokens": 6, "temperature": 0, **extra}


# ---------------------------------------------------------------------- through the router
@pytest.mark.model
def test_native_generate_through_router(deployment, client):
    body = {"text": "The capital of France is", "sampling_params": _greedy()}
    direct = httpx.post(deployment.replica_urls[0] + "/generate", json=body, timeout=120).json()
    out = client.post("/generate", json=body)
    assert out.status_code == 200, out.text
    assert out.json()["text"] == direct["text"]
    assert out.json()["meta_info"]["completion_tokens"] == 6
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1]["text"] == direct["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.model
def test_openai_through_router(client):
    comp = {"model": "plait-tiny", "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0}
    r = client.post("/v1/completions", json=comp)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert r.json()["usage"]["completion_tokens"] == 5
    with client.stream("POST", "/v1/completions", json={**comp, "stream": True}) as r:
        assert r.status_code == 200
        chunks = sse_events(r.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in chunks) == text

    # no model: the router forwards "model": "unknown", which plait takes as absent
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["message"]["content"]
    with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
        assert r.status_code == 200
        chunks = sse_events(r.iter_lines())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == content
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.model
def test_router_requests_stay_strict(client):
    r = client.post("/generate", json={"text": "x", "return_hidden_states": True})
    assert_error(r, 400, "return_hidden_states")
    r = client.post("/v1/completions", json={"model": "plait-tiny", "prompt": "x", "bogus": 1})
    assert_error(r, 400, "bogus")
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
    )
    assert_error(r, 400, "continue_final_message")
    r = client.post("/v1/chat/completions", json={"model": "gpt-4", "messages": []})
    assert r.status_code in (400, 404)


@pytest.mark.model
def test_bad_requests_do_not_take_replicas_out(client):
    """The router counts a worker's 4xx answers as failures; plait's router runs without the
    circuit breaker, so invalid requests never make it refuse valid ones."""
    bad = {"text": "x", "sampling_params": {"temperature": -1}}
    for _ in range(25):
        assert client.post("/generate", json=bad).status_code == 400
    r = client.post("/generate", json={"text": "x", "sampling_params": _greedy()})
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_load_report_and_flush(deployment, client):
    load = httpx.get(deployment.replica_urls[0] + "/get_load", timeout=30).json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    loads = client.get("/get_loads").json()["workers"]
    assert sorted(w["worker"] for w in loads) == deployment.replica_urls
    assert all(w["load"] == 0 for w in loads)  # -1 would mean the router could not read it
    r = client.post("/flush_cache")
    assert r.status_code == 200, r.text


@pytest.mark.model
def test_cache_aware_keeps_a_prefix_on_one_replica(deployment, client):
    assert client.post("/flush_cache").status_code == 200
    before = [deployment.stats(i) for i in (0, 1)]
    prompts = [
        PREFIX_A + f"Answer {k}: the sun." if k % 2 == 0 else PREFIX_B + f"Recipe {k}."
        for k in range(6)
    ]
    for p in prompts:  # A, B, A, B, A, B
        r = client.post("/generate", json={"text": p, "sampling_params": _greedy()})
        assert r.status_code == 200, r.text
    after = [deployment.stats(i) for i in (0, 1)]
    got = [
        {
            k: after[i][k] - before[i][k]
            for k in ("prompt_tokens", "cached_tokens", "finished_requests")
        }
        for i in (0, 1)
    ]
    # each prefix stays where it was first served: 3 requests per replica, or all 6 on one;
    # the 2nd and 3rd request of each prefix hit that replica's cache
    per_prefix_len = len(PREFIX_A) // 8  # a loose lower bound on the prefix's tokens
    assert sorted(g["finished_requests"] for g in got) in ([3, 3], [0, 6]), got
    total_cached = sum(g["cached_tokens"] for g in got)
    assert total_cached >= 4 * per_prefix_len, got


# ---------------------------------------------------------------------- faults and shutdown
@pytest.mark.model
def test_replica_killed_mid_run(deployment, client):
    """A replica that dies: its streams are cut (no [DONE]); until the router's health checks
    drop it, a request the router sends there fails with a 5xx (never hangs); then every
    request succeeds on the survivor. The parent restarts the replica and the router takes
    it back."""
    body = {
        "text": "Count slowly:",
        "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        assert first.startswith("data: {")
        loads = [
            httpx.get(url + "/get_load", timeout=30).json()[0]["num_reqs"]
            for url in deployment.replica_urls
        ]
        assert sorted(loads) == [0, 1], loads
        victim = loads.index(1)
        pid = deployment.stats(victim)["pid"]
        os.kill(pid, signal.SIGKILL)
        rest: list[str] = []
        try:  # the router closes the connection mid-body (httpx: RemoteProtocolError)
            rest.extend(lines)
        except httpx.HTTPError:
            pass
        assert "data: [DONE]" not in rest
    survivor = deployment.replica_urls[1 - victim]
    statuses: list[int] = []

    def serving_again() -> bool:
        r = client.post(
            "/generate", json={"text": "Count slowly: one", "sampling_params": _greedy()}
        )
        statuses.append(r.status_code)
        return statuses[-3:] == [200, 200, 200]

    wait_for(serving_again, timeout=120, interval=0.5)
    assert set(statuses) <= {200, 500, 502, 503}, statuses
    assert httpx.get(survivor + "/health", timeout=30).status_code == 200

    def restarted() -> bool:
        try:
            return deployment.stats(victim)["pid"] != pid
        except (httpx.HTTPError, KeyError, ValueError):
            return False

    wait_for(restarted, timeout=START_TIMEOUT_S, interval=1.0)
    wait_for(deployment._ready, timeout=120, interval=1.0)  # the router re-admits it
    assert not _alive(pid)


@pytest.mark.model
def test_shutdown_leaves_no_process(deployment):
    procs = _descendants(deployment.proc.pid)
    assert len(procs) >= 1 + 2 * 3  # router, and each replica with scheduler + detokenizer
    assert deployment.stop() == 0
    wait_for(lambda: not [p for p in procs if _alive(p)], timeout=30)
    with pytest.raises(httpx.HTTPError):
        httpx.get(deployment.url + "/readiness", timeout=5)
