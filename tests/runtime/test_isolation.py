"""Failure isolation in the real scheduler (driven in-process): a fault injected while serving
one request fails that request with a named cause, the requests beside it and after it
succeed, and the KV pool and request slots return to their idle level."""

from __future__ import annotations

import json
import time

import pytest

from plait.matching import stop_search_start
from plait.messages import BatchTokenOut, RequestErrorOut, TokenizedGenerateReq
from plait.runtime import logprobs
from plait.runtime.scheduler import Scheduler
from tests.runtime.test_scheduler import drain as drain_running
from tests.runtime.test_scheduler import finished, outputs

pytestmark = pytest.mark.model

PROMPT = list(range(10, 30))


def submit(io, rid, ids=PROMPT, return_logprob=False, **sp):
    io.inbox.put(TokenizedGenerateReq(
        rid=rid, input_ids=list(ids), return_logprob=return_logprob,
        sampling_params={"temperature": 0.0, "max_new_tokens": 6, **sp},
    ))


def drain(s: Scheduler) -> None:
    """Step until idle, grammar compiles included."""
    for _ in range(3000):
        drain_running(s)
        if not s.constraints.pending:
            return
        time.sleep(0.01)
    raise AssertionError("grammar compiles did not finish")


def errors(io) -> dict[str, RequestErrorOut]:
    return {m.rid: m for m in io.outbox if isinstance(m, RequestErrorOut)}


def assert_idle(s: Scheduler) -> None:
    pool = s.runner.kv_pool
    assert not s.reqs and not s.running and not s.waiting and s.chunked is None
    assert s.kv.used == 0 and s.kv.cache.protected_size() == 0
    assert pool.free_size + s.kv.cache.evictable_size() == pool.size
    assert s.kv.req_to_token.free_size == s.kv.req_to_token.max_reqs
    s.kv.cache.check_integrity()


def run_with_neighbour(s, io, bad: str, **bad_sp) -> None:
    """`bad` runs beside a healthy request; afterwards one more healthy request runs."""
    submit(io, bad, **bad_sp)
    submit(io, "beside", PROMPT[::-1])
    drain(s)
    submit(io, "after")
    drain(s)
    assert finished(io)["beside"]["type"] == "length"
    assert finished(io)["after"]["type"] == "length"
    assert bad not in finished(io)
    assert_idle(s)


def test_nan_logits_of_one_row_fail_that_request(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512)
    forward = s.runner.forward

    def poisoned(batch, rows, *_):
        out = forward(batch, rows)  # full logits (no greedy picks): a NaN goes into them
        sampling = [r for r, t in zip(batch.reqs, batch.samples_token) if t]
        for k, r in enumerate(sampling):
            if r.rid == "bad" and len(r.output_ids) == 2:
                out.logits[k, 7] = float("nan")
        return out

    s.runner.forward = poisoned
    run_with_neighbour(s, io, "bad")
    err = errors(io)["bad"]
    assert err.status == 500 and "non-finite logits" in err.message


def test_extreme_sampling_parameters_fail_their_request(make_scheduler):
    # values the frontend's validation should refuse; here they reach the sampler anyway
    s, io = make_scheduler(max_total_tokens=512)
    for rid, field, value in (("hot", "temperature", 1e-45), ("pen", "repetition_penalty", 1e-300)):
        submit(io, rid, temperature=1.0)
        s.step()  # registered (and maybe prefilled)
        setattr(s.reqs[rid].sampling, field, value)
    submit(io, "beside", PROMPT[::-1])
    drain(s)
    errs = errors(io)
    assert errs["hot"].status == 400 and errs["hot"].param == "temperature"
    assert errs["pen"].status == 400 and errs["pen"].param == "repetition_penalty"
    assert finished(io)["beside"]["type"] == "length"
    assert_idle(s)


def test_a_forward_that_raises_fails_its_batch_and_the_server_goes_on(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512)
    forward, calls = s.runner.forward, []

    def flaky(batch, rows, *args):
        calls.append(1)
        if len(calls) == 2:  # the first decode step
            raise RuntimeError("device lost")
        return forward(batch, rows, *args)

    s.runner.forward = flaky
    submit(io, "a")
    submit(io, "b", PROMPT[::-1])
    drain(s)
    errs = errors(io)
    assert set(errs) == {"a", "b"} and all("device lost" in e.message for e in errs.values())
    assert_idle(s)
    submit(io, "after")
    drain(s)
    assert finished(io)["after"]["type"] == "length"
    assert_idle(s)


@pytest.mark.parametrize("where", ["logprobs", "stop_check", "grammar_mask"])
def test_a_bookkeeping_error_fails_only_its_request(make_scheduler, monkeypatch, where):
    s, io = make_scheduler(max_total_tokens=512)
    bad_sp: dict = {"return_logprob": True}
    if where == "logprobs":
        real = logprobs.record_output_logprob

        def record(req, row, token):
            if req.rid == "bad" and len(req.output_token_logprobs) == 2:
                raise IndexError("boom in logprobs")
            real(req, row, token)

        monkeypatch.setattr(logprobs, "record_output_logprob", record)
    elif where == "stop_check":
        real_check = s.stop_checker.check

        def check(req):
            if req.rid == "bad" and len(req.output_ids) == 3:
                raise KeyError("boom in stop check")
            real_check(req)

        monkeypatch.setattr(s.stop_checker, "check", check)
    else:
        bad_sp = {"regex": "[a-z ]+"}
        real_fill = type(s.constraints).bitmask

        def bitmask(self, reqs, vocab, on_error):
            for r in reqs:
                if r.rid == "bad" and r.grammar is not None and len(r.output_ids) == 1:
                    r.grammar.fill_bitmask = _raise
            return real_fill(self, reqs, vocab, on_error)

        monkeypatch.setattr(type(s.constraints), "bitmask", bitmask)
    run_with_neighbour(s, io, "bad", **bad_sp)
    err = errors(io)["bad"]
    assert err.status == 500 and "boom" in err.message


def _raise(*args):
    raise RuntimeError("boom in the grammar matcher")


def test_unsatisfiable_grammars_are_refused(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512)
    submit(io, "ref", json_schema=json.dumps({"$ref": "#"}))
    submit(io, "ebnf", ebnf='root ::= root "a"')
    # not empty at the start, but after "a" nothing can follow: caught while sampling
    submit(io, "dead", ebnf='root ::= "a" x\nx ::= x "b"')
    submit(io, "beside", PROMPT[::-1])
    drain(s)
    errs = errors(io)
    assert errs["ref"].status == 400 and errs["ref"].param == "json_schema"
    assert "accepts no string" in errs["ref"].message
    assert errs["ebnf"].status == 400 and errs["ebnf"].param == "ebnf"
    assert errs["dead"].status == 400 and "no continuation" in errs["dead"].message
    assert "dead" not in finished(io)  # never a 200 with text the grammar rejects
    assert finished(io)["beside"]["type"] == "length"
    assert_idle(s)


def test_stop_token_ids_beyond_the_vocabulary_with_min_new_tokens(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512)
    vocab = s.runner.config.vocab_size
    # (the frontend refuses ids beyond the vocabulary; the sampler must not index with them)
    submit(io, "r", stop_token_ids=[vocab + 5, vocab * 1000], min_new_tokens=3, max_new_tokens=5)
    drain(s)
    assert finished(io)["r"]["type"] == "length" and not errors(io)
    assert_idle(s)


def test_min_new_tokens_keeps_text_before_it(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512)
    submit(io, "free", max_new_tokens=8)
    drain(s)
    free_ids = outputs(io)["free"]
    text = s.tokenizer.decode(free_ids[:2])  # a stop string produced within min_new_tokens
    submit(io, "min", max_new_tokens=8, min_new_tokens=4, stop=[text])
    drain(s)
    got = outputs(io)["min"]
    assert got == free_ids[: len(got)] and len(got) >= 4  # greedy: the same tokens
    reason = finished(io)["min"]
    if reason["type"] == "stop":  # only an occurrence ending in the last token stops it
        before, full = s.tokenizer.decode(got[:-1]), s.tokenizer.decode(got)
        assert full.find(text, stop_search_start(before, text)) >= 0
    else:
        assert reason["type"] == "length" and len(got) == 8


def test_loop_survives_an_error_outside_any_request(make_scheduler, monkeypatch):
    s, io = make_scheduler(max_total_tokens=512)
    submit(io, "a", max_new_tokens=50)
    s.step()
    s.step()

    def broken():
        raise RuntimeError("scheduling bug")

    monkeypatch.setattr(s, "next_batch", broken)
    s.step_safely()  # what run_forever calls: does not raise
    monkeypatch.undo()
    assert errors(io)["a"].status == 500 and "scheduling bug" in errors(io)["a"].message
    assert_idle(s)
    submit(io, "b")
    drain(s)
    assert finished(io)["b"]["type"] == "length"


def test_priority_is_served_first_and_retraction_spares_it(make_scheduler):
    s, io = make_scheduler(max_total_tokens=512, max_running_requests=1)
    for rid, prio in (("low", 0), ("high", 5)):
        io.inbox.put(TokenizedGenerateReq(
            rid=rid, input_ids=PROMPT, priority=prio,
            sampling_params={"temperature": 0.0, "max_new_tokens": 3},
        ))
    drain(s)
    order = [rid for m in io.outbox if isinstance(m, BatchTokenOut)
             for rid, r in zip(m.rids, m.finished_reasons) if r is not None]
    assert order == ["high", "low"]
    assert s.stats()["requests_by_priority"] == {"0": 1, "5": 1}
