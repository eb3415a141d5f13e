"""Model-free unit tests of the scheduler's pure logic: StopChecker, OutputCollector, the
admission policy (priority tiers, aging, retraction order, budget) and KVManager accounting
(including the slots of a forward that failed). Milliseconds each; no model is loaded."""

from __future__ import annotations

import itertools
import time

import pytest

from plait.registry import SCHEDULE_POLICIES
from plait.runtime import schedule_policy as policy
from plait.runtime.output import OutputCollector, StopChecker
from tests.runtime.units import CharTokenizer, ids, make_kv, make_req

EOS = 0


# ---------------------------------------------------------------------- StopChecker
def run_checker(text: str, **sampling) -> tuple[dict | None, int]:
    """Feed text one character (token) at a time; (finish reason, tokens consumed)."""
    checker = StopChecker(CharTokenizer(), (EOS,))
    req = make_req("r", ids("p"), **{"max_new_tokens": 100, **sampling})
    for tok in ids(text):
        req.output_ids.append(tok)
        checker.check(req)
        if req.finished:
            break
    return req.finished_reason, len(req.output_ids)


def test_stop_string_finishes_on_the_token_that_completes_it():
    assert run_checker("ab END cd", stop=["END"]) == ({"type": "stop", "matched": "END"}, 6)


def test_min_new_tokens_defers_stops_and_ignores_an_early_occurrence():
    # "END" completes at token 3, before min_new_tokens=5: output, not a stop; the next one
    # (completing at token 11) stops the request
    reason, n = run_checker("ENDxxxxxEND tail", stop=["END"], min_new_tokens=5)
    assert reason == {"type": "stop", "matched": "END"} and n == 11


def test_eos_and_stop_token_ids_respect_min_new_tokens():
    assert run_checker("ab\x00cd", min_new_tokens=4)[0] is None  # EOS at token 3: ignored
    assert run_checker("abcd\x00", min_new_tokens=4) == ({"type": "stop", "matched": EOS}, 5)
    assert run_checker("abXd", stop_token_ids=[ord("X")]) == (
        {"type": "stop", "matched": ord("X")}, 3)
    assert run_checker("ab\x00", ignore_eos=True)[0] is None


def test_max_new_tokens_is_a_length_finish():
    assert run_checker("abcdef", max_new_tokens=4) == ({"type": "length"}, 4)


# ---------------------------------------------------------------------- OutputCollector
def test_output_collector_streams_every_interval_and_always_sends_finished():
    out = OutputCollector(stream_interval=2)
    streaming = make_req("s", ids("p"), max_new_tokens=10)
    streaming.stream = True
    quiet = make_req("q", ids("p"), max_new_tokens=10)
    streaming.output_ids, quiet.output_ids = ids("a"), ids("a")
    out.add(streaming)
    out.add(quiet)
    assert out.flush() == []  # 1 new token < interval; quiet is not streaming
    streaming.output_ids.append(ord("b"))
    [msg] = out.flush()
    assert msg.rids == ["s"] and msg.new_token_ids == [ids("ab")]
    quiet.finish("length")
    out.add(quiet)
    [msg] = out.flush()
    assert msg.rids == ["q"] and msg.finished_reasons == [{"type": "length"}]
    assert msg.extra_meta[0]["forced_tokens"] == 0


def test_output_collector_discard_drops_a_failed_request():
    out = OutputCollector(stream_interval=1)
    req = make_req("r", ids("p"))
    req.finish("stop")
    out.add(req)
    out.discard(req)
    assert out.flush() == []


# ---------------------------------------------------------------------- schedule policy
def test_priority_orders_waiting_requests_then_the_policy_within_a_tier():
    kv = make_kv()
    low, high, mid = make_req("low", ids("aaaa")), make_req("high", ids("bb"), 5), make_req(
        "mid", ids("cc"), 1)
    for name in SCHEDULE_POLICIES.names():
        assert policy.order_waiting([low, high, mid], name, kv) == [high, mid, low]


def test_lpm_within_a_tier_and_fcfs_keeps_arrival_order():
    kv = make_kv()
    cached = make_req("cached", ids("shared prefix!!"))
    assert kv.admit(cached) and kv.alloc(cached, cached.pending_len)
    kv.commit(cached, cached.pending_len)
    kv.release(cached)  # its tokens are now in the tree
    fresh, hit = make_req("fresh", ids("zzzz")), make_req("hit", ids("shared prefix??"))
    assert policy.order_waiting([fresh, hit], "lpm", kv) == [hit, fresh]
    assert policy.order_waiting([fresh, hit], "fcfs", kv) == [fresh, hit]


def test_aging_bounds_starvation():
    kv = make_kv()
    now = time.monotonic()
    old = make_req("old", ids("a"), priority=0)
    new = make_req("new", ids("b"), priority=2)
    old.arrival_time = now - (2 + 1) * policy.PRIORITY_AGING_S - 0.1  # waited (q - p + 1) * A
    new.arrival_time = now
    assert policy.priority_tier(old, now) == 3 > policy.priority_tier(new, now) == 2
    assert policy.order_waiting([new, old], "fcfs", kv) == [old, new]
    old.arrival_time = now - 2 * policy.PRIORITY_AGING_S + 0.1  # not yet: still behind
    assert policy.order_waiting([new, old], "fcfs", kv) == [new, old]


def test_retraction_takes_the_lowest_priority_first():
    a, b, c = make_req("a", ids("a"), 1), make_req("b", ids("b"), 0), make_req("c", ids("c"), 0)
    a.output_ids, b.output_ids, c.output_ids = [], ids("xxxx"), ids("xx")
    assert policy.retraction_victim([a, b, c]) is c  # lowest priority, then least progress


def test_admit_respects_budget_room_and_chunks_the_last():
    kv = make_kv(size=64)
    # distinct prompts: one sharing a prefix with the batch would wait a step (next test)
    reqs = [make_req(f"r{i}", list(range(1 + 20 * i, 21 + 20 * i)), max_new_tokens=4)
            for i in range(3)]
    adm = policy.admit(reqs, kv, budget=30, max_new_reqs=8, reserve=0)
    assert [r.rid for r in adm.reqs] == ["r0", "r1"] and adm.extend_lens == [20, 10]
    assert adm.chunked is reqs[1]
    adm2 = policy.admit(reqs[2:], make_kv(), budget=100, max_new_reqs=0, reserve=0)
    assert adm2.reqs == []  # no room for another running request


def test_admit_keeps_room_for_the_decode_reserve():
    kv = make_kv(size=32)
    req = make_req("r", list(range(1, 21)), max_new_tokens=8)
    assert policy.admit([req], kv, budget=100, max_new_reqs=8, reserve=10).reqs == []
    assert kv.used == 0 and kv.req_to_token.free_size == 4  # refused admission let go of all


@pytest.mark.parametrize("length", [0, 1, 63, 64, 65, 127, 128, 200, 300])
def test_common_prefix_len_at_and_around_its_chunk_boundaries(length):
    from plait.matching import common_prefix_len

    a = list(range(1000, 1300))
    b = a[:length] + [-1] * 5  # differs right after `length` (or ends there: length 300)
    assert common_prefix_len(a, b) == common_prefix_len(b, a) == length
    assert common_prefix_len(a, a[:length]) == length  # one a prefix of the other
    assert common_prefix_len(tuple(a), tuple(b)) == length
    text = "".join(chr(0x4E00 + i) for i in range(300))
    assert common_prefix_len(text, text[:length] + "x") == length


# ---------------------------------------------------------------------- KVManager
def test_a_request_sharing_a_chat_template_prefix_with_the_batch_waits_a_step():
    # a system prompt of IN_BATCH_SHARE_MIN tokens shared by three requests: the first is
    # admitted, the others wait for it to be cached; one token less is not worth a step
    shared = "s" * policy.IN_BATCH_SHARE_MIN
    reqs = [make_req(f"r{i}", ids(shared + f"user {i}"), max_new_tokens=4) for i in range(3)]
    adm = policy.admit(reqs, make_kv(size=128), budget=100, max_new_reqs=8, reserve=0)
    assert [r.rid for r in adm.reqs] == ["r0"]
    short = [make_req(f"q{i}", ids(shared[1:] + f"{i} user"), max_new_tokens=4) for i in range(3)]
    adm = policy.admit(short, make_kv(size=128), budget=100, max_new_reqs=8, reserve=0)
    assert [r.rid for r in adm.reqs] == ["q0", "q1", "q2"]


def test_kv_manager_lifecycle_returns_to_idle():
    kv = make_kv(size=64)
    idle_free = kv.kv_pool.free_size
    req = make_req("r", list(range(1, 11)))
    assert kv.admit(req) and kv.alloc(req, 10)
    kv.commit(req, 10)
    kv.cache_prefilled(req)
    req.output_ids.append(99)
    assert kv.alloc(req, 1)
    kv.commit(req, 1)
    assert kv.used == 11
    kv.release(req)
    assert kv.used == 0 and kv.req_to_token.free_size == 4
    assert kv.kv_pool.free_size + kv.cache.evictable_size() == idle_free
    assert kv.cache.protected_size() == 0


def test_kv_manager_frees_the_slots_of_a_failed_forward():
    kv = make_kv(size=64, cache=True)
    req = make_req("r", list(range(1, 11)))
    assert kv.admit(req) and kv.alloc(req, 10)  # the forward would run now ... and fails
    assert kv.kv_pool.free_size == 54
    kv.release(req)
    assert kv.kv_pool.free_size == 64 and kv.cache.total_size() == 0
    assert kv.req_to_token.free_size == 4


def test_kv_manager_cannot_allocate_twice_for_one_forward():
    kv = make_kv()
    req = make_req("r", list(range(1, 5)))
    assert kv.admit(req) and kv.alloc(req, 4)
    with pytest.raises(AssertionError):
        kv.alloc(req, 1)


def _decode(kv, req, steps: int) -> None:
    """steps decode steps of req alone: a slot for its pending token, then its KV computed."""
    for _ in range(steps):
        req.output_ids.append(99)
        assert kv.alloc(req, 1)
        kv.commit(req, 1)


def _row(kv, req, start: int = 0) -> list[int]:
    return kv.req_to_token.read(req.req_pool_idx, req.kv_len, start).tolist()


@pytest.mark.parametrize("run", [0, 8])
def test_kv_runs_give_a_requests_decode_tokens_adjacent_slots(run):
    kv = make_kv(size=256, max_context=128, run=run)
    a, b = make_req("a", list(range(1, 11))), make_req("b", list(range(20, 30)))
    for r in (a, b):
        assert kv.admit(r) and kv.alloc(r, 10)
        kv.commit(r, 10)
    for _ in range(16):  # a decode batch of two: each step one slot for each, in turn
        _decode(kv, a, 1)
        _decode(kv, b, 1)
    steps = [y - x for r in (a, b) for x, y in itertools.pairwise(_row(kv, r, 10))]
    if run == 0:  # the old layout: the two requests' tokens interleave, two slots apart
        assert set(map(abs, steps)) == {2}
    else:  # runs of 8 adjacent slots (a new run starts wherever the pool's next free run is)
        assert steps.count(1) >= len(steps) - 2 * (16 // 8)
    for r in (a, b):
        kv.release(r)
    assert kv.reserved == 0 and kv.used == 0
    assert kv.kv_pool.free_size + kv.cache.evictable_size() == 256


def test_kv_set_aside_slots_are_available_and_taken_back_before_an_allocation_fails():
    kv = make_kv(size=40, max_context=64, run=16, cache=False)
    a = make_req("a", list(range(1, 11)), max_new_tokens=100)
    assert kv.admit(a) and kv.alloc(a, 10)  # 10 + 16 set aside
    kv.commit(a, 10)
    assert kv.reserved == 16 and kv.kv_pool.free_size == 14
    assert kv.available == 30 and kv.used == 10  # set-aside slots count as obtainable
    b = make_req("b", list(range(20, 45)))
    assert kv.admit(b) and kv.alloc(b, 25)  # 14 free + 11 of a's set-aside slots
    kv.commit(b, 25)
    assert a.reserved_len == a.alloc_len and kv.reserved == 0  # a's all given back
    assert kv.kv_pool.free_size == 5 and kv.used == 35
    _decode(kv, a, 1)  # a allocates again, from the free slots
    assert kv.used == 36 and min(_row(kv, a) + _row(kv, b)) >= 1
    assert len(set(_row(kv, a)) | set(_row(kv, b))) == 36  # no slot handed out twice
    for r in (a, b):
        kv.release(r)
    assert kv.kv_pool.free_size == 40 and kv.reserved == 0


def test_kv_set_aside_slots_are_taken_back_before_the_cache_is_evicted():
    kv = make_kv(size=40, max_context=64, run=16)
    c = make_req("c", list(range(100, 110)), max_new_tokens=0)
    assert kv.admit(c) and kv.alloc(c, 10)  # no new tokens: nothing set aside
    kv.commit(c, 10)
    kv.release(c)  # 10 tokens cached, evictable
    assert kv.reserved == 0 and kv.cache.evictable_size() == 10
    a = make_req("a", list(range(1, 11)), max_new_tokens=100)
    assert kv.admit(a) and kv.alloc(a, 10) and kv.reserved == 16
    kv.commit(a, 10)
    b = make_req("b", list(range(20, 24)))
    assert kv.admit(b) and kv.alloc(b, 4)  # 4 free slots: b's own (nothing left to set aside)
    d = make_req("d", list(range(30, 38)))
    assert kv.admit(d) and kv.alloc(d, 8)  # from a's set-aside slots, not the cache
    assert kv.cache.evictable_size() == 10 and kv.reserved == 0


def test_kv_rejected_draft_slots_stay_set_aside_for_the_next_tokens():
    kv = make_kv(size=64, max_context=64, run=0)
    req = make_req("r", list(range(1, 11)))
    assert kv.admit(req) and kv.alloc(req, 10)
    kv.commit(req, 10)
    req.output_ids.append(99)
    assert kv.alloc(req, 5)  # the pending token and a 4-token draft
    verify_slots = kv.req_to_token.read(req.req_pool_idx, 15, 10).tolist()
    kv.commit(req, 2)  # the pending token and one draft token accepted
    req.output_ids += [98, 97]  # the accepted draft token and the one sampled after it
    kv.free_uncommitted(req)
    assert req.alloc_len == req.kv_len == 12 and kv.reserved == 3
    free = kv.kv_pool.free_size
    assert kv.alloc(req, 3)  # the three rejected slots again, no new ones
    assert kv.kv_pool.free_size == free and kv.reserved == 0
    assert kv.req_to_token.read(req.req_pool_idx, 15, 10).tolist() == verify_slots
    kv.commit(req, 3)
    req.output_ids += [96, 95, 94]
    kv.release(req)
    assert kv.kv_pool.free_size + kv.cache.evictable_size() == 64


def test_kv_runs_stop_at_the_request_row_end_and_its_token_budget():
    kv = make_kv(size=256, max_context=24, run=16)
    req = make_req("r", list(range(1, 11)), max_new_tokens=100)
    assert kv.admit(req) and kv.alloc(req, 10)
    assert req.reserved_len == 24 and kv.reserved == 14  # the row holds 24 positions
    short = make_req("s", list(range(30, 40)), max_new_tokens=3)
    assert kv.admit(short) and kv.alloc(short, 10)
    assert short.reserved_len == 13 and kv.reserved == 17  # at most its 3 new tokens


def test_kv_failed_forward_returns_set_aside_and_allocated_slots():
    kv = make_kv(size=64, run=8, cache=True)
    req = make_req("r", list(range(1, 11)))
    assert kv.admit(req) and kv.alloc(req, 10)  # the forward would run now ... and fails
    assert kv.kv_pool.free_size == 64 - 18
    kv.release(req)
    assert kv.kv_pool.free_size == 64 and kv.cache.total_size() == 0 and kv.reserved == 0


def test_kv_run_must_not_be_negative():
    with pytest.raises(ValueError, match="run"):
        make_kv(run=-1)


def test_kv_manager_evicts_unlocked_cache_to_allocate():
    kv = make_kv(size=16)
    a = make_req("a", list(range(1, 13)))
    assert kv.admit(a) and kv.alloc(a, 12)
    kv.commit(a, 12)
    kv.release(a)  # 12 tokens cached, evictable
    b = make_req("b", list(range(50, 62)))
    assert kv.admit(b) and kv.alloc(b, 12)  # needs eviction of a's tokens
    assert kv.cache.evictable_size() <= 4
