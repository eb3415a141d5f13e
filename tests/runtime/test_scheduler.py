"""The scheduler driven in-process (InProcessIO instead of sockets): abort, oversize requests,
accounting after every step, the lpm policy; model-path errors."""

from __future__ import annotations

import itertools
import json
import shutil
import time

import pytest

from plait.messages import AbortReq, BatchTokenOut, RequestErrorOut, TokenizedGenerateReq
from plait.runtime.scheduler import Scheduler

pytestmark = pytest.mark.model  # starts a model or a server


def submit(io, rid, ids, **sp):
    io.inbox.put(TokenizedGenerateReq(rid=rid, input_ids=ids, sampling_params={"temperature": 0.0, **sp}))


def drain(s: Scheduler, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        s.step()
        s.kv.cache.check_integrity()
        pool = s.runner.kv_pool
        held = sum(r.kv_len for r in s.running) + (s.chunked.kv_len if s.chunked else 0)
        held += s.kv.reserved  # set aside for running requests' next tokens
        # every slot is free, cached, or held by a running request (shared prefixes counted once)
        assert pool.free_size + s.kv.cache.total_size() <= pool.size
        assert pool.free_size + s.kv.cache.evictable_size() + s.kv.cache.protected_size() + held >= pool.size
        if not s.has_work:
            return
    raise AssertionError("scheduler did not go idle")


def outputs(io) -> dict[str, list[int]]:
    """Each request's output tokens, from the scheduler's messages so far."""
    out: dict[str, list[int]] = {}
    for msg in io.outbox:
        if isinstance(msg, BatchTokenOut):
            for rid, new in zip(msg.rids, msg.new_token_ids):
                out.setdefault(rid, []).extend(new)
    return out


def finished(io) -> dict[str, dict]:
    out = {}
    for msg in io.outbox:
        if isinstance(msg, BatchTokenOut):
            for rid, reason in zip(msg.rids, msg.finished_reasons):
                if reason is not None:
                    out[rid] = reason
    return out


def test_abort_frees_everything(make_scheduler):
    s, io = make_scheduler(max_total_tokens=2048)
    submit(io, "long", list(range(10, 60)), max_new_tokens=500, ignore_eos=True)
    submit(io, "short", list(range(10, 30)), max_new_tokens=4)
    for _ in range(5):
        s.step()
    assert s.running
    io.inbox.put(AbortReq("long"))
    drain(s)
    assert finished(io)["long"] == {"type": "abort"}
    assert s.kv.used == 0 and not s.reqs


def test_cache_off_pool_emptied_inside_a_forward_still_frees_outside_one(make_scheduler):
    """--disable-radix-cache: the last running request finishing inside a forward (under
    inference mode) empties the pool, which lays its free list out anew; a later free outside
    a forward (an abort here; retractions and set-aside slots too) must still work. (It raised
    'Inplace update to inference tensor', and the scheduler process died.)"""
    s, io = make_scheduler(max_total_tokens=512, disable_radix_cache=True)
    submit(io, "first", list(range(10, 30)), max_new_tokens=4)
    drain(s)
    assert s.runner.kv_pool.free_size == s.runner.kv_pool.size
    submit(io, "long", list(range(10, 60)), max_new_tokens=300, ignore_eos=True)
    for _ in range(5):
        s.step()
    io.inbox.put(AbortReq("long"))
    drain(s)
    submit(io, "after", list(range(10, 30)), max_new_tokens=4)
    drain(s)
    assert finished(io)["long"] == {"type": "abort"}
    assert finished(io)["after"]["type"] == "length"
    assert outputs(io)["after"] == outputs(io)["first"]
    assert s.kv.used == 0 and not s.reqs


def test_request_larger_than_the_pool_is_refused(make_scheduler):
    s, io = make_scheduler(max_total_tokens=64)
    submit(io, "big", list(range(10, 50)), max_new_tokens=100)
    submit(io, "ok", list(range(10, 20)), max_new_tokens=4)
    drain(s)
    errors = [m for m in io.outbox if isinstance(m, RequestErrorOut)]
    assert len(errors) == 1 and errors[0].rid == "big" and "pool" in errors[0].message
    assert finished(io)["ok"]["type"] == "length"


def test_an_unvalidated_request_fails_alone_and_the_scheduler_goes_on(make_scheduler):
    """The tokenizer manager refuses these prompts (out-of-vocabulary ids, an empty prompt);
    sent to the scheduler directly they fail with an error message, hold no KV afterwards,
    and the scheduler serves the next request."""
    s, io = make_scheduler(max_total_tokens=256)
    vocab = s.runner.config.vocab_size
    for rid, ids in (("oov", [10, vocab + 5, 11]), ("negative", [10, -3]), ("empty", [])):
        submit(io, rid, ids, max_new_tokens=2)
        drain(s)
        errors = {m.rid: m for m in io.outbox if isinstance(m, RequestErrorOut)}
        failed = errors.get(rid) is not None or finished(io).get(rid, {}).get("type") == "error"
        assert failed, rid
        assert s.kv.used == 0 and not s.reqs
        submit(io, f"after-{rid}", list(range(10, 20)), max_new_tokens=3)
        drain(s)
        assert finished(io)[f"after-{rid}"]["type"] == "length"


def test_memory_pressure_never_deadlocks(make_scheduler):
    s, io = make_scheduler(max_total_tokens=160, chunked_prefill_size=32)
    for i in range(12):
        submit(io, f"r{i}", [100 + i] * 3 + list(range(200, 230 + i)), max_new_tokens=40, ignore_eos=True)
    drain(s, max_steps=5000)
    done = finished(io)
    assert len(done) == 12 and all(r["type"] == "length" for r in done.values())
    assert s.counters["retractions"] > 0 and s.kv.used == 0


def test_lpm_admits_the_longest_cached_prefix_first(make_scheduler):
    s, io = make_scheduler(max_total_tokens=4096, max_running_requests=1)
    shared = list(range(300, 400))
    submit(io, "warm", shared + [1], max_new_tokens=1)
    drain(s)
    submit(io, "cold", list(range(500, 600)), max_new_tokens=3)
    submit(io, "hot", shared + [2], max_new_tokens=3)
    s.step()  # one request slot: lpm prefills the one with the cached prefix first
    assert [r.rid for r in s.running] == ["hot"]
    assert [r.rid for r in s.waiting] == ["cold"]


def test_unknown_architecture_names_the_supported_ones(tiny_llama, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    from plait.models.config import ModelConfig

    with pytest.raises(ValueError, match="GPTNeoXForCausalLM.*LlamaForCausalLM"):
        ModelConfig.from_dir(bad)


def test_hub_name_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from plait.models.resolve import resolve_model_path

    with pytest.raises(ValueError, match="not a local directory.*hub"):
        resolve_model_path("some-org/some-model-that-is-not-here")


def test_a_jump_forward_extend_carries_the_decoding_requests(make_scheduler):
    """A request whose grammar forced text (pending tokens > 1) is computed in an extend; the
    requests with one pending token ride along in it (an extend of 1 each) rather than waiting
    for a decode forward of their own right after (a second pass over all the weights)."""
    from plait.runtime.core import ForwardMode

    s, io = make_scheduler(max_total_tokens=2048)
    for i in range(3):
        submit(io, f"r{i}", list(range(10 + i, 40 + i)), max_new_tokens=20, ignore_eos=True)
    for _ in range(20):
        s.step()
        if len(s.running) == 3 and all(r.pending_len == 1 for r in s.running):
            break
    forced = s.running[0]
    s._emit(forced, [11, 12])  # what jump-forward does with a grammar's forced text
    assert forced.pending_len == 3
    batch = s.next_batch()
    assert batch.mode is ForwardMode.EXTEND
    lens = {r.rid: n for r, n in zip(batch.reqs, batch.extend_lens)}
    assert lens == {forced.rid: 3, **{r.rid: 1 for r in s.running if r is not forced}}
    assert all(batch.samples_token)


def test_decoding_requests_ride_along_with_a_long_prompts_chunks(make_scheduler):
    """A prompt longer than the chunk budget prefills over several forwards; the running
    requests decode in each of them (an extend of 1 each) instead of waiting for its last
    chunk, and every request's output is the one it gets alone."""
    from plait.runtime.core import ForwardMode

    alone = {}
    for rid, ids in (("a", list(range(10, 30))), ("b", list(range(40, 62)))):
        s, io = make_scheduler(max_total_tokens=2048, chunked_prefill_size=32)
        submit(io, rid, ids, max_new_tokens=12, ignore_eos=True)
        drain(s)
        alone[rid] = outputs(io)[rid]
    long_ids = [(7 * i) % 500 + 3 for i in range(150)]
    s, io = make_scheduler(max_total_tokens=2048, chunked_prefill_size=32)
    submit(io, "b", list(range(40, 62)), max_new_tokens=12, ignore_eos=True)
    for _ in range(3):
        s.step()
    assert [r.rid for r in s.running] == ["b"]
    submit(io, "long", long_ids, max_new_tokens=4, ignore_eos=True)
    submit(io, "a", list(range(10, 30)), max_new_tokens=12, ignore_eos=True)
    chunk_steps, run = 0, s.run_batch

    def spy(batch):  # a forward with a chunk of "long" that is not its last
        nonlocal chunk_steps
        decoding = [r.rid for r in s.running if r.pending_len == 1]
        lens = {r.rid: n for r, n in zip(batch.reqs, batch.extend_lens)}
        if any(r.rid == "long" and not smp for r, smp in zip(batch.reqs, batch.samples_token)):
            assert batch.mode is ForwardMode.EXTEND
            assert decoding and all(lens.get(rid) == 1 for rid in decoding), (decoding, lens)
            chunk_steps += 1
        run(batch)

    s.run_batch = spy
    drain(s)
    assert chunk_steps >= 3
    out = outputs(io)
    assert out["b"] == alone["b"] and out["a"] == alone["a"]
    assert len(out["long"]) == 4


def test_a_short_request_starts_beside_a_long_prompts_chunks(make_scheduler):
    """While a long prompt prefills chunk by chunk, a short request that arrives fits in the
    share of the budget kept for waiting requests (--chunked-prefill-new-share) and starts in
    the next forward, beside a chunk that is not the long prompt's last; one that shares the
    long prompt's uncached tokens waits until the long prompt computed them. Outputs are those
    alone. (Chunks of the whole budget: a chunk cut to its work leaves room of its own.)"""
    long_ids = [(7 * i) % 500 + 3 for i in range(300)]
    short = list(range(10, 22))
    sharing = long_ids[:90]  # 64 tokens cached after the first chunk, 26 shared uncached
    alone = {}
    for rid, ids in (("long", long_ids), ("short", short), ("sharing", sharing)):
        s, io = make_scheduler(max_total_tokens=4096, chunked_prefill_size=64)
        submit(io, rid, ids, max_new_tokens=6, ignore_eos=True)
        drain(s)
        alone[rid] = outputs(io)[rid]

    for share in (0.5, 0.0):
        s, io = make_scheduler(max_total_tokens=4096, chunked_prefill_size=64,
                               chunked_prefill_new_share=share, disable_chunk_work_cap=True)
        submit(io, "long", long_ids, max_new_tokens=6, ignore_eos=True)
        s.step()  # the first chunk
        submit(io, "sharing", sharing, max_new_tokens=6, ignore_eos=True)
        submit(io, "short", short, max_new_tokens=6, ignore_eos=True)
        started = {}  # rid -> (whether "long" had chunks left after that forward, extend)
        run = s.run_batch

        def spy(batch, run=run, started=started):
            long_continues = any(r.rid == "long" and not smp
                                 for r, smp in zip(batch.reqs, batch.samples_token))
            for r, n, smp in zip(batch.reqs, batch.extend_lens, batch.samples_token):
                if r.rid in ("short", "sharing") and smp and r.rid not in started:
                    started[r.rid] = (long_continues, n)
                    if long_continues:
                        assert n == r.pending_len <= 32  # whole, within the share
            run(batch)

        s.run_batch = spy
        drain(s)
        assert outputs(io) == alone
        assert started["short"] == (share > 0, len(short)), share
        assert started["sharing"][1] <= len(sharing) - 80  # its shared tokens from the cache
        assert s.kv.used == 0


def test_a_long_prompts_chunks_are_cut_to_the_first_chunks_work(make_scheduler):
    """A chunk after a long context costs more (its attention over the context): each is cut
    so that its work (thread_tuner.attention_work) is at most a context-free chunk's, unless
    --disable-chunk-work-cap. The output is the same either way."""
    from plait.runtime.thread_tuner import attention_work

    long_ids = [(7 * i) % 500 + 3 for i in range(1200)]
    chunks, outs = {}, {}
    for disable in (False, True):
        s, io = make_scheduler(max_total_tokens=4096, chunked_prefill_size=64,
                               disable_chunk_work_cap=disable)
        submit(io, "long", long_ids, max_new_tokens=4, ignore_eos=True)
        seen, run = [], s.run_batch

        def spy(batch, run=run, seen=seen):
            seen += [(r.kv_len, n) for r, n in zip(batch.reqs, batch.extend_lens)
                     if r.rid == "long" and r.kv_len < len(long_ids)]
            run(batch)

        s.run_batch = spy
        drain(s)
        chunks[disable], outs[disable] = seen, outputs(io)["long"]
        assert sum(n for _, n in seen) == len(long_ids)
        assert all(p + n == q for (p, n), (q, _) in itertools.pairwise(seen))
    assert outs[False] == outs[True] and len(outs[False]) == 4
    assert {n for _, n in chunks[True][:-1]} == {64}
    cost = s.runner.pair_cost
    first = attention_work([0], [64], cost)
    capped = chunks[False]
    assert capped[0] == (0, 64)
    assert all(attention_work([p], [n], cost) <= first for p, n in capped)
    assert all(attention_work([p], [n + 1], cost) > first for p, n in capped[:-1])  # the most
    assert capped[-2][1] < 40 and len(capped) > len(chunks[True])


def test_a_long_prompt_takes_short_chunks_beside_other_requests(make_scheduler):
    """While another request runs (a stream decoding), a prompt longer than the budget
    prefills in chunks of --chunked-prefill-beside-size tokens' work, so the stream's tokens,
    riding along, each wait for a short forward; alone, beside another long prompt (which
    starts after its last chunk either way), or with the size 0, it takes whole-budget
    chunks. The long prompt's output is the same every way."""
    long_ids = [(7 * i) % 500 + 3 for i in range(300)]
    chunks, outs = {}, {}
    for beside, stream in ((16, True), (0, True), (16, False), (16, None), (16, "short")):
        s, io = make_scheduler(max_total_tokens=4096, chunked_prefill_size=64,
                               chunked_prefill_beside_size=beside, disable_chunk_work_cap=True)
        if stream is True:
            submit(io, "stream", list(range(10, 22)), max_new_tokens=200, ignore_eos=True)
            s.step()  # its prefill: it decodes from here on
        submit(io, "long", long_ids, max_new_tokens=4, ignore_eos=True)
        seen, rode, run = [], [], s.run_batch

        def spy(batch, run=run, seen=seen, rode=rode):
            ids = [r.rid for r in batch.reqs]
            if "long" in ids:
                i = ids.index("long")
                if batch.reqs[i].kv_len < len(long_ids):
                    seen.append(batch.extend_lens[i])
                    rode.append("stream" in ids)
            run(batch)

        s.run_batch = spy
        if stream is None:
            submit(io, "long2", long_ids[::-1], max_new_tokens=4, ignore_eos=True)
        if stream == "short":  # one waits during the first chunk, for one token
            s.step()
            submit(io, "short", list(range(30, 42)), max_new_tokens=1)
        drain(s)
        chunks[beside, stream], outs[beside, stream] = seen, outputs(io)["long"]
        assert sum(seen) == len(long_ids) and s.kv.used == 0
        assert all(rode[:-1]) == (stream is True)  # the stream's token in every chunk's forward
        # but the last's (the stream then decodes with the long prompt's first token)
    assert chunks[16, True] == [16] * 18 + [12]
    assert chunks[0, True] == [63] * 4 + [48]  # one token of each budget is the stream's
    assert chunks[16, False] == chunks[16, None] == [64] * 4 + [44]
    # the short request's forward: a short chunk beside it (the forwards before and after,
    # the long prompt alone: whole-budget chunks)
    assert chunks[16, "short"] == [64, 16, 64, 64, 64, 28]
    assert outs[16, True] == outs[0, True] == outs[16, False] == outs[16, None]
    assert outs[16, None] == outs[16, "short"]
    assert len(outs[16, True]) == 4


def test_kv_runs_put_each_requests_decode_tokens_in_adjacent_slots(make_scheduler):
    """With --kv-run-tokens a decode batch's requests each read their KV as runs of adjacent
    slots (without, a step hands them consecutive slots in turn: 4 requests, 4 slots apart);
    the output is the same either way, and every slot comes back."""
    rows, outs = {}, {}
    for run in (0, 16):
        s, io = make_scheduler(max_total_tokens=2048, kv_run_tokens=run, speculative_ngram=0)
        for i in range(4):
            submit(io, f"r{i}", list(range(10 + i, 40 + i)), max_new_tokens=40, ignore_eos=True)
        for _ in range(200):
            s.step()
            if any(len(r.output_ids) >= 39 for r in s.running):
                break
        assert len(s.running) == 4
        rows[run] = [s.kv.req_to_token.read(r.req_pool_idx, r.kv_len, 30).tolist()
                     for r in s.running]
        drain(s)
        outs[run] = outputs(io)
        assert s.kv.used == 0 and s.kv.reserved == 0
    assert outs[0] == outs[16] and len(outs[0]) == 4
    steps = {run: [b - a for row in rs for a, b in itertools.pairwise(row)] for run, rs in rows.items()}
    assert all(abs(d) == 4 for d in steps[0])  # interleaved
    assert steps[16].count(1) >= 0.9 * len(steps[16])  # adjacent but at a run's start


def test_deferred_tokenizer_loads_once_the_loop_is_idle(tiny_llama, monkeypatch):
    """The scheduler process's tokenizer (a DeferredTokenizer: transformers not imported at
    start-up) starts loading only after the loop has idled TOKENIZER_IDLE_S, not while
    requests run; a constrained request before that loads it on demand and is served."""

    from plait.args import ServerArgs
    from plait.models.tokenizer import DeferredTokenizer, load_scheduler_tokenizer
    from plait.runtime import scheduler as scheduler_module
    from plait.runtime.scheduler_process import InProcessIO

    monkeypatch.setattr(scheduler_module, "TOKENIZER_IDLE_S", 0.2)

    def make():
        tok = load_scheduler_tokenizer(tiny_llama)
        assert isinstance(tok, DeferredTokenizer)
        io = InProcessIO()
        return Scheduler(ServerArgs(model_path=tiny_llama), tiny_llama, io, tok), io, tok

    s, io, tok = make()
    submit(io, "busy", [5, 6, 7, 8], max_new_tokens=12)
    drain(s)  # busy steps, then the first idle step
    assert tok._future is None, "loaded beside running requests"
    started = time.monotonic()
    while tok._future is None and time.monotonic() - started < 5:
        s.step(idle_wait_s=0.02)
    assert tok._future is not None and time.monotonic() - started >= 0.15
    assert len(tok.resolved()) == len(tok)

    s, io, tok = make()  # a grammar first: its backend needs transformers' tokenizer now
    submit(io, "json", [5, 6, 7], max_new_tokens=24, json_object=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            isinstance(m, BatchTokenOut) and m.finished_reasons[0] for m in io.outbox):
        s.step(idle_wait_s=0.01)
        time.sleep(0.001)
    assert not any(isinstance(m, RequestErrorOut) for m in io.outbox)
    assert "json" in outputs(io) and tok._future is not None


@pytest.mark.parametrize("lazy", [False, True])
def test_the_grammar_backend_is_prepared_once_the_loop_idles(make_scheduler, monkeypatch, lazy):
    """Once the loop has idled TOKENIZER_IDLE_S the grammar backend (its vocabulary tables) and
    the spelling index are built on a background thread, not while requests run, and the first
    constrained request uses them: on a fresh SmolLM2 server it took ~2.7 s more than the next,
    ~1 s of it on the loop, holding up every request in flight. With --lazy-grammar-backend
    nothing is built until a constrained request comes."""
    from plait.runtime import scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "TOKENIZER_IDLE_S", 0.2)
    s, io = make_scheduler(lazy_grammar_backend=lazy)
    c = s.constraints
    submit(io, "busy", [5, 6, 7, 8], max_new_tokens=12)
    drain(s)  # busy steps, then the first idle step
    assert c._manager is None, "built beside running requests"

    def ready() -> bool:
        return (c._manager is not None and c._manager._backend_future.done()
                and c._spelled is not None)

    started = time.monotonic()
    while not ready() and time.monotonic() - started < (1.0 if lazy else 60):
        s.step(idle_wait_s=0.02)
    if lazy:
        assert c._manager is None
        return
    assert ready() and time.monotonic() - started >= 0.15
    manager = c._manager
    io.outbox.clear()
    submit(io, "json", [5, 6, 7], max_new_tokens=16, json_object=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(
            isinstance(m, BatchTokenOut) and m.finished_reasons[0] for m in io.outbox):
        s.step(idle_wait_s=0.01)
    assert not any(isinstance(m, RequestErrorOut) for m in io.outbox)
    assert "json" in outputs(io) and c._manager is manager
    assert manager.stats()["compiles"] == 1
    c.shutdown()


def test_the_loop_waits_on_its_socket_while_only_grammars_compile(make_scheduler, monkeypatch):
    """With nothing to run but a grammar compiling, the loop waits on its socket for
    GRAMMAR_WAIT_S between checks (polling without a wait held the GIL from the compile
    threads: the first constrained request of a fresh server took 35-44 s, importing xgrammar
    beside the spin); with requests to run it does not wait."""
    from plait.runtime import scheduler as scheduler_module

    s, io = make_scheduler()
    waits: list[float] = []
    recv = io.recv
    monkeypatch.setattr(io, "recv", lambda timeout_s: waits.append(timeout_s) or recv(timeout_s))
    submit(io, "json", [5, 6, 7], max_new_tokens=4, json_object=True)
    s.step(idle_wait_s=0.05)  # takes the request: its grammar starts compiling
    assert s.constraints.pending
    s.step(idle_wait_s=0.05)
    assert waits[-1] == scheduler_module.GRAMMAR_WAIT_S
    submit(io, "plain", [5, 6, 7], max_new_tokens=4)
    deadline = time.monotonic() + 60  # the compile's first xgrammar import is slow on a busy CI box
    while time.monotonic() < deadline:
        if not s.constraints.pending and not s.has_work:
            break
        busy = s.has_work
        s.step(idle_wait_s=0.05)
        if busy:
            assert waits[-1] == 0.0
    assert "json" in outputs(io) and "plain" in outputs(io)
