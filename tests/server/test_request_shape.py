"""The one request shape without a server: GenerateInput.normalize() bounds and shapes,
SamplingParams' RequestErrors, admission tickets and token buckets, and tokenization of a
long prompt off the event loop (the mechanism, with a tokenizer that blocks on purpose)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from plait.args import ServerArgs
from plait.errors import RequestError
from plait.io_struct import GenerateInput, InputLimits, ReqInput
from plait.sampling import SamplingParams
from plait.server.http_common import Admission, KeyPolicy, RateLimited, _depth_over
from plait.tokenizer.tokenizer_manager import INLINE_TOKENIZE_CHARS, TokenizerManager

LIMITS = InputLimits(vocab_size=100, context_length=64, max_prompt_chars=1000)


def error(**fields) -> RequestError:
    with pytest.raises(RequestError) as e:
        GenerateInput(**fields).normalize(LIMITS)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(
    "fields, field",
    [
        (
            {"text": "x", "sampling_params": {"temperature": float("inf")}},
            "sampling_params.temperature",
        ),
        ({"text": "x", "sampling_params": {"temperature": 1e39}}, "sampling_params.temperature"),
        (
            {"text": "x", "sampling_params": {"repetition_penalty": 1e-300}},
            "sampling_params.repetition_penalty",
        ),
        ({"text": "x", "sampling_params": {"top_k": 2**64}}, "sampling_params.top_k"),
        ({"text": "x", "sampling_params": {"seed": 2**64}}, "sampling_params.seed"),
        (
            {"text": "x", "sampling_params": {"stop_token_ids": [100]}},
            "sampling_params.stop_token_ids",
        ),
        ({"text": "x", "sampling_params": {"ignore_eos": "false"}}, "sampling_params.ignore_eos"),
        ({"input_ids": [[1, 2], 3]}, "input_ids.1"),
        ({"input_ids": [1, 100]}, "input_ids"),
        ({"input_ids": [True]}, "input_ids"),
        ({"text": "x" * 1001}, "text"),
        ({"text": ["a", "b", "c"], "sampling_params": {"n": 128}}, "text"),
        ({"text": "x", "stream": "false"}, "stream"),
        ({"text": "x", "return_logprob": True, "top_logprobs_num": 5000}, "top_logprobs_num"),
        ({"text": "x", "priority": 2000}, "priority"),
        ({}, "text"),
    ],
)
def test_normalize_names_the_field(fields, field):
    assert error(**fields).field == field


def test_normalize_expands_prompts_and_n_in_order():
    norm = GenerateInput(
        text=["a", "b"], rid=["r", "s"], sampling_params={"n": 2, "seed": 7}, priority=3
    ).normalize(LIMITS)
    assert norm.batched
    assert [(r.text, r.rid, r.group, r.sampling_params.seed, r.priority) for r in norm.reqs] == [
        ("a", "r_0", "r", 7, 3),
        ("a", "r_1", "r", 8, 3),
        ("b", "s_0", "s", 7, 3),
        ("b", "s_1", "s", 8, 3),
    ]


def test_tiny_temperature_is_greedy_and_errors_carry_fields():
    assert SamplingParams(temperature=1e-9).temperature == 0.0
    with pytest.raises(RequestError) as e:
        SamplingParams(top_p=0)
    assert (e.value.field, e.value.status) == ("top_p", 400) and str(e.value).startswith("top_p:")
    assert isinstance(e.value, ValueError)


def test_logit_bias_is_validated_and_canonical():
    sp = SamplingParams(logit_bias={5: 10, "7": -2.5})
    assert sp.logit_bias == {"5": 10.0, "7": -2.5} and sp.logit_bias_ids == [5, 7]
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {"-1": 1}, {"1.5": 1}, {5: 101}, {5: float("nan")}, {5: "1"},
                {True: 1}, [1, 2], {str(i): 1 for i in range(2000)}, {5: 1, "5": 2}):
        with pytest.raises(RequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.field == "logit_bias", bad
    with pytest.raises(RequestError) as e:
        SamplingParams(logit_bias={"99": 1}).check_vocab(50)
    assert e.value.field == "logit_bias" and "99" in e.value.message


def test_from_dict_refuses_unknown_and_unsupported_fields():
    with pytest.raises(RequestError) as e:
        GenerateInput.from_dict({"text": "x", "bogus": 1})
    assert e.value.field == "bogus"
    with pytest.raises(RequestError) as e:
        GenerateInput.from_dict({"text": "x", "image_data": "b64"})
    assert e.value.field == "image_data"


def test_json_depth_check_is_iterative():
    deep: list = []
    for _ in range(10_000):
        deep = [deep]
    assert _depth_over(deep, 64)
    assert not _depth_over({"a": [{"b": 1}]}, 64)


def test_admission_reserves_synchronously_and_releases_once():
    adm = Admission(max_running=4, max_queued=4, reserve_fraction=0.25)
    tickets = [adm.reserve(1, 0) for _ in range(8)]
    with pytest.raises(RequestError) as e:
        adm.reserve(1, 5)
    assert e.value.status == 429 and e.value.headers["Retry-After"]
    tickets[0].release()
    tickets[0].release()  # idempotent
    assert adm.in_flight == 7
    with pytest.raises(RequestError):  # batch tier: the last queue slot is reserved
        adm.reserve(1, -1)
    with adm.reserve(1, 1):
        assert adm.in_flight == 8
    assert adm.in_flight == 7


def test_rate_limit_retry_after_comes_from_the_bucket():
    policy = KeyPolicy("k", rpm=60)
    for _ in range(60):
        policy.check()
    with pytest.raises(RateLimited) as e:
        policy.check()
    assert e.value.status == 429 and e.value.headers["Retry-After"] == "1"
    tokens = KeyPolicy("t", tpm=600)  # 10 tokens a second
    tokens.check()
    tokens.charge_tokens(700)  # overdrawn by 100 tokens: ~10 s until it admits again
    with pytest.raises(RateLimited) as e:
        tokens.check()
    assert 9 <= int(e.value.headers["Retry-After"]) <= 11 and e.value.limit == "tpm"


class BlockingTokenizer:
    """A real tokenizer whose encode waits until the test releases it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []

    def encode(self, text, **kwargs):
        self.threads.append(threading.current_thread())
        self.entered.set()
        self.release.wait(30)
        return self.tokenizer.encode(text, **kwargs)


async def test_long_prompt_is_tokenized_off_the_event_loop(tiny_llama):
    from transformers import AutoTokenizer

    blocking = BlockingTokenizer(AutoTokenizer.from_pretrained(tiny_llama))
    tm = TokenizerManager(
        ServerArgs(), blocking,
        {"context_length": 4096, "vocab_size": 8256, "max_total_tokens": 65536}, None, {}
    )
    text = "hello " * INLINE_TOKENIZE_CHARS
    req = ReqInput(text=text, input_ids=None, sampling_params=SamplingParams())
    task = asyncio.create_task(tm.tokenize(req))
    # if encode ran on the loop, this await could not even start until encode returned
    assert await asyncio.to_thread(blocking.entered.wait, 10)
    ticks = 0
    for _ in range(5):  # the loop keeps running other work while the tokenizer is busy
        await asyncio.sleep(0)
        ticks += 1
    assert ticks == 5 and not task.done()
    assert blocking.threads[0] is not threading.current_thread()
    blocking.release.set()
    ids = await task
    assert len(ids) >= INLINE_TOKENIZE_CHARS


async def test_request_timeout_counts_only_time_without_scheduler_progress():
    """The deadline fires when nothing at all comes from the scheduler for request_timeout
    seconds, never while the scheduler keeps answering other requests (a long batch)."""
    import time
    from types import SimpleNamespace

    tm = SimpleNamespace(args=SimpleNamespace(request_timeout=0.3), last_progress=time.monotonic())
    state = SimpleNamespace(event=asyncio.Event())
    started = time.monotonic()

    async def other_requests_progress():  # the scheduler serves others for 0.9 s
        while time.monotonic() - started < 0.9:
            tm.last_progress = time.monotonic()
            await asyncio.sleep(0.05)
        state.event.set()  # then this request's output arrives

    task = asyncio.create_task(other_requests_progress())
    await TokenizerManager._wait(tm, state, started)  # 3x the timeout, no error
    await task
    assert time.monotonic() - started >= 0.85

    state.event.clear()
    stalled = time.monotonic()
    with pytest.raises(RequestError) as e:  # nothing comes any more: 504 after the timeout
        await TokenizerManager._wait(tm, state, stalled)
    assert e.value.status == 504 and 0.25 <= time.monotonic() - stalled < 2


async def test_a_streams_last_output_arriving_between_two_chunks_is_yielded(tiny_llama):
    """The Engine cuts each stream chunk from the request's state when generate() yields it.
    The request's final output (its last tokens, finished) may arrive while the consumer holds
    the previous chunk: generate() must yield the state once more, not end because the state
    it resumes on reads finished (a streamed constrained request came back one token short,
    now and then, in CI)."""
    from transformers import AutoTokenizer

    from plait.messages import BatchStrOut

    tm = TokenizerManager(
        ServerArgs(), AutoTokenizer.from_pretrained(tiny_llama),
        {"context_length": 4096, "vocab_size": 8256, "max_total_tokens": 65536}, None, {}
    )
    tm._send = lambda msg: None  # no scheduler: outputs are delivered by hand below

    def output(rid, ids, finished):
        tm._on_output(BatchStrOut(
            rids=[rid], text_deltas=["x" * len(ids)], new_token_ids=[ids],
            finished_reasons=[{"type": "length"} if finished else None], prompt_tokens=[3],
            completion_tokens=[0], cached_tokens=[0], output_token_logprobs=[[]],
            output_top_logprobs=[[]], input_token_logprobs=[None], input_top_logprobs=[None]))

    req = ReqInput(text=None, input_ids=[5, 6, 7], sampling_params=SamplingParams(), rid="r",
                   stream=True)
    agen = tm.generate(req, [5, 6, 7])
    first = asyncio.ensure_future(agen.__anext__())
    await asyncio.sleep(0)
    output("r", [10, 11], False)
    state = await first
    cut = list(state.output_ids)  # the consumer cuts its chunk, then holds it a while ...
    output("r", [12], True)  # ... while the last output arrives
    state = await agen.__anext__()  # yielded once more (it ended here before)
    assert state.output_ids[len(cut):] == [12] and state.finished_reason == {"type": "length"}
    with pytest.raises(StopAsyncIteration):
        await agen.__anext__()
