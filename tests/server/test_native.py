"""The SGLang-native API (/generate and the control endpoints) against a real server,
including the exact request shapes SGLang's frontend (sglang.RuntimeEndpoint) sends."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.server.server_utils import MODEL_NAME, sse_events, wait_for

GREEDY = {"max_new_tokens": 8, "temperature": 0}


def generate(http, **body):
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_single(http):
    out = generate(http, text="Hello world", sampling_params=GREEDY)
    meta = out["meta_info"]
    assert out["text"] and len(out["output_ids"]) == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["prompt_tokens"] > 0 and meta["completion_tokens"] == 8
    assert {"id", "cached_tokens", "e2e_latency"} <= set(meta)
    assert generate(http, text="Hello world", sampling_params=GREEDY)["text"] == out["text"]


def test_batch_text_and_input_ids(http):
    prompts = ["first prompt", "second one", "third"]
    outs = generate(http, text=prompts, sampling_params=GREEDY)
    assert len(outs) == 3
    for prompt, out in zip(prompts, outs):
        assert out == {
            **generate(http, text=prompt, sampling_params=GREEDY),
            "meta_info": out["meta_info"],
        }
    ids = [[1000, 2000, 3000], [4000, 5000]]
    outs = generate(
        http,
        input_ids=ids,
        sampling_params=[GREEDY, {**GREEDY, "max_new_tokens": 3}],
        rid=["batch-a", "batch-b"],
    )
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [3, 2]
    assert [len(o["output_ids"]) for o in outs] == [8, 3]
    assert [o["meta_info"]["id"] for o in outs] == ["batch-a", "batch-b"]


def test_n_returns_a_list(http):
    outs = generate(
        http, text="sample me", sampling_params={"max_new_tokens": 6, "n": 3, "seed": 1}
    )
    assert len(outs) == 3 and len({o["text"] for o in outs}) > 1
    again = generate(
        http, text="sample me", sampling_params={"max_new_tokens": 6, "n": 3, "seed": 1}
    )
    assert [o["text"] for o in again] == [o["text"] for o in outs]


def test_stream_is_cumulative_and_ends_with_done(http):
    # long enough to stream in several events: a 10-token request (7 ms end to end) arrived
    # as one event, its steps' outputs coalesced while the frontend was busy
    sp = {**GREEDY, "max_new_tokens": 200, "ignore_eos": True}
    full = generate(http, text="Streaming test", sampling_params=sp)
    body = {"text": "Streaming test", "sampling_params": sp, "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert len(events) > 1
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert texts[-1] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_stream_batch_carries_index(http):
    body = {"text": ["aa", "bb"], "sampling_params": GREEDY, "stream": True}
    with http.stream("POST", "/generate", json=body) as resp:
        events = sse_events(resp.iter_lines())
    finals = {e["index"]: e for e in events if e["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert finals[1]["text"] == generate(http, text="bb", sampling_params=GREEDY)["text"]


def test_logprobs(http):
    text = "The logprob test prompt"
    out = generate(
        http,
        text=text,
        sampling_params={**GREEDY, "max_new_tokens": 4},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=3,
        return_text_in_logprobs=True,
    )
    meta = out["meta_info"]
    n_prompt = meta["prompt_tokens"]
    inp, outp = meta["input_token_logprobs"], meta["output_token_logprobs"]
    assert len(inp) == n_prompt and len(outp) == 4
    assert inp[0][0] is None  # the first token has no context
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inp[1:] + outp)
    assert [tok for _, tok, _ in outp] == out["output_ids"]
    assert "".join(t for _, _, t in outp) == out["text"]
    assert "".join(t for _, _, t in inp) == text
    values = [lp for lp, _, _ in inp if lp is not None]
    assert meta["normalized_prompt_logprob"] == pytest.approx(sum(values) / len(values))
    assert len(meta["output_top_logprobs"]) == 4 and all(
        len(r) == 3 for r in meta["output_top_logprobs"]
    )
    for (lp, tok, _), top in zip(outp, meta["output_top_logprobs"]):
        assert top[0][1] == tok and top[0][0] == pytest.approx(lp, abs=1e-4)  # greedy
    # without return_text_in_logprobs the text slot is None; start past 0 trims input logprobs
    out = generate(
        http, text=text, sampling_params=GREEDY, return_logprob=True, logprob_start_len=2
    )
    inp2 = out["meta_info"]["input_token_logprobs"]
    assert len(inp2) == n_prompt - 2 and all(t is None for _, _, t in inp2)
    assert [lp for lp, _, _ in inp2] == pytest.approx([lp for lp, _, _ in inp[2:]], abs=1e-4)


@pytest.mark.parametrize("max_new_tokens", [0, 2])
def test_input_logprobs_of_a_one_token_prompt(http, max_new_tokens):
    """A one-token prompt's input logprobs are its one entry [None, id, None], as for the first
    token of a longer prompt (there was no logit row to compute, and it was left out)."""
    out = generate(http, input_ids=[1000], sampling_params={"max_new_tokens": max_new_tokens},
                   return_logprob=True, logprob_start_len=0, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["input_token_logprobs"] == [[None, 1000, None]]
    assert meta["input_top_logprobs"] == [None]
    assert len(meta["output_token_logprobs"]) == max_new_tokens


def test_max_new_tokens_zero_is_a_prefill(http):
    out = generate(http, text="only prefill this", sampling_params={"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    assert out["meta_info"]["prompt_tokens"] > 0
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_sglang_runtime_endpoint_request_shapes(http):
    """The requests sglang.RuntimeEndpoint sends for gen and select, with its field values."""
    srt_kwargs = {  # SglSamplingParams.to_srt_kwargs() defaults, as JSON
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 6,
        "min_new_tokens": 0,
        "n": 1,
        "stop": [],
        "stop_token_ids": [],
        "stop_regex": [],
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    prefix = "Question: is the sky blue?\nAnswer:"
    out = generate(http, text=prefix, sampling_params=srt_kwargs)
    assert len(out["output_ids"]) <= 6
    # select: cache the prefix, then score every choice in one batch
    obj = generate(http, text=prefix, sampling_params={"max_new_tokens": 0})
    prompt_len = obj["meta_info"]["prompt_tokens"]
    choices = [" yes", " no", " maybe"]
    objs = generate(
        http,
        text=[prefix + c for c in choices],
        sampling_params={"max_new_tokens": 0, "temperature": 0},
        return_logprob=True,
        return_text_in_logprobs=True,
        logprob_start_len=max(prompt_len - 2, 0),
    )
    for r, c in zip(objs, choices):
        itl = r["meta_info"]["input_token_logprobs"]
        assert isinstance(itl[0][-1], str) and itl[0][-1]  # select checks the healed token text
        assert len(itl) == r["meta_info"]["prompt_tokens"] - (prompt_len - 2)
        assert (prefix + c).endswith("".join(t for _, _, t in itl))
        values = [x[0] for x in itl if x[0]]
        assert sum(values) / len(values) == pytest.approx(
            r["meta_info"]["normalized_prompt_logprob"]
        )
        assert r["meta_info"]["output_token_logprobs"] == []
    # unconditional likelihood: a batch of input_ids; logprob_start_len left at its default
    # (-1: output logprobs only, as in SGLang)
    ids = [[tok for _, tok, _ in r["meta_info"]["input_token_logprobs"]] for r in objs]
    objs = generate(http, input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True)
    assert [r["meta_info"]["input_token_logprobs"] for r in objs] == [[], [], []]
    # sglang.Runtime.generate sends nulls for the fields it does not set
    out = generate(
        http,
        text="nulls",
        sampling_params={"max_new_tokens": 2},
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        lora_path=None,
        session_id=None,
    )
    assert len(out["output_ids"]) == 2


def test_sglang_unsupported_fields_are_named(http):
    resp = http.post("/generate", json={"text": "x", "sampling_params": {"stop_regex": ["a+"]}})
    assert resp.status_code == 400 and "stop_regex" in resp.json()["error"]["message"]
    resp = http.post("/generate", json={"text": "x", "lora_path": "adapter"})
    assert resp.status_code == 400 and "lora_path" in resp.json()["error"]["message"]


def test_abort_request(http, server):
    import httpx

    result = {}

    def long_request():
        with httpx.Client(base_url=server.url, timeout=120) as c:
            result["resp"] = c.post(
                "/generate",
                json={
                    "text": "abort me",
                    "rid": "to-abort",
                    "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True},
                },
            )

    t = threading.Thread(target=long_request)
    t.start()
    wait_for(lambda: http.get("/get_server_info").json()["num_running"] > 0)
    time.sleep(0.2)
    assert http.post("/abort_request", json={"rid": "to-abort"}).json()["aborted"] == ["to-abort"]
    t.join(30)
    assert not t.is_alive()
    out = result["resp"].json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 3000
    assert http.post("/abort_request", json={}).status_code == 400


def test_model_info(http, server):
    info = http.get("/get_model_info").json()
    assert info["model_path"] and info["is_generation"] is True
    assert info["served_model_name"] == MODEL_NAME
    assert info["context_length"] > 0
    assert http.get("/model_info").json() == info


def test_server_info(http, server):
    info = http.get("/get_server_info").json()
    assert info["max_total_tokens"] == 16384
    assert {"kv_used", "kv_usage", "num_running", "num_waiting", "cache_hit_rate"} <= set(info)
    assert set(info["child_pids"]) == {"scheduler", "detokenizer"}
    assert info["pid"] == server.pid
    assert info["served_model_name"] == MODEL_NAME and info["api_key"] is None
    assert http.get("/server_info").status_code == 200
    grammar = info["grammar_backends"]  # what each constraint backend enforces
    assert set(grammar) == {"xgrammar", "outlines"}
    assert "ebnf" in grammar["xgrammar"]["kinds"] and "ebnf" not in grammar["outlines"]["kinds"]
    assert "contains" in grammar["xgrammar"]["json_schema"]["refused_keywords"]
    assert "if" in grammar["xgrammar"]["json_schema"]["supported_keywords"]
    assert {"date-time", "email", "uri", "duration"} <= set(grammar["outlines"]["json_schema"]["formats"])


def test_flush_cache(http):
    prompt = "Flush me, a prompt long enough to be cached in the radix tree."
    generate(http, text=prompt, sampling_params=GREEDY)
    assert generate(http, text=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] > 0
    resp = http.post("/flush_cache")
    assert resp.status_code == 200
    assert generate(http, text=prompt, sampling_params=GREEDY)["meta_info"]["cached_tokens"] == 0


def test_health(http):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200


def test_metrics(http):
    with http.stream(
        "POST", "/generate", json={"text": "metrics", "sampling_params": GREEDY, "stream": True}
    ) as resp:
        sse_events(resp.iter_lines())
    text = http.get("/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['plait_http_requests_total{method="POST",path="/generate",status="200"}'] >= 1
    assert samples["plait_generation_tokens_total"] >= 8
    assert samples["plait_prompt_tokens_total"] >= 1
    assert "plait_cached_tokens_total" in samples
    assert samples["plait_time_to_first_token_seconds_count"] >= 1
    assert samples["plait_time_per_output_token_seconds_count"] >= 1
    assert samples["plait_e2e_request_latency_seconds_count"] >= 1
    assert samples['plait_requests_finished_total{finish_reason="length"}'] >= 1
    for gauge in (
        "plait_num_running_requests",
        "plait_num_waiting_requests",
        "plait_kv_cache_usage",
        "plait_cache_hit_rate",
    ):
        assert gauge in samples
    assert samples["plait_kv_cache_total_tokens"] == 16384
    assert samples["plait_healthy"] == 1


def test_grammar_metrics(http):
    schema = {"type": "object", "properties": {"k": {"type": "string", "maxLength": 5}},
              "required": ["k"], "additionalProperties": False}
    params = {"max_new_tokens": 32, "temperature": 0, "json_schema": json.dumps(schema)}
    for _ in range(2):  # a compile, then a cache hit
        assert http.post("/generate", json={"text": "x", "sampling_params": params}).status_code == 200
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["plait_grammar_compile_seconds_count"] >= 1
    assert samples['plait_grammar_compile_seconds_bucket{le="+Inf"}'] >= 1
    assert samples["plait_grammar_cache_hits_total"] >= 1
    assert samples["plait_grammar_cache_misses_total"] >= 1
    assert samples["plait_forced_tokens_total"] >= 1  # '{"k": "' is forced by the schema
    assert "plait_grammar_timeouts_total" in samples and "plait_decode_forwards_total" in samples


def test_thread_count_in_server_info_and_metrics(http):
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    assert http.post("/generate", json={"text": "x", "sampling_params": params}).status_code == 200
    threads = http.get("/get_server_info").json()["threads"]
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["plait_forward_threads"] >= 1
    if threads["mode"] == "fixed":  # --num-threads, or a single core
        return
    by_threads = {k: v for k, v in samples.items() if k.startswith("plait_forwards_by_threads")}
    assert sum(by_threads.values()) >= 8  # a prefill and 7 decode steps at least
    assert sum(threads["forwards_by_threads"].values()) == sum(by_threads.values())
    assert "plait_thread_probes_total" in samples and "plait_thread_switches_total" in samples


def test_decode_shares_the_prefix_of_parallel_samples(http):
    # n=2 samples of one 60-word prompt hold the same cached prompt KV: decode reads it once
    text = " ".join(f"word{i}" for i in range(60))
    params = {"max_new_tokens": 4, "temperature": 0.8, "n": 2, "ignore_eos": True}
    r = http.post("/generate", json={"text": text, "sampling_params": params})
    assert r.status_code == 200, r.text
    samples = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples["plait_decode_shared_kv_tokens_total"] > 0


def test_idle_keep_alive_connections_outlive_client_expiry(server):
    # one HTTP/1.1 connection left idle past httpx's and uvicorn's 5 s default is still open
    # (the second request would fail with RemoteDisconnected): clients, whose idle expiry is
    # shorter, never race the server closing it
    import http.client
    import time
    from urllib.parse import urlparse

    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        for attempt in range(2):
            conn.request("GET", "/health")
            reply = conn.getresponse()
            assert reply.status == 200 and reply.read() == b'{"status":"ok"}', attempt
            if attempt == 0:
                sock = conn.sock
                time.sleep(6.5)
        assert conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()
