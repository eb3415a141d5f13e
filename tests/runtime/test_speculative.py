"""N-gram speculative decoding (--speculative-ngram): the proposer, and greedy output that is
token-identical with and without speculation (stop tokens, stop strings and max_new_tokens
falling inside accepted drafts, mixed batches with sampled, constrained and logprob requests),
KV accounting after every step, and parity with transformers."""

from __future__ import annotations

import math
import random
import re
import time

import pytest

from plait.messages import BatchTokenOut, RequestErrorOut, TokenizedGenerateReq
from plait.runtime.ngram import NgramIndex, accepted_prefix, likely_tokens
from tests.runtime.test_parity import hf_reference
from tests.runtime.test_scheduler import drain

K = 4


def test_ngram_index_proposes_after_the_latest_longest_match():
    idx = NgramIndex(1, 3)
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (5, 2, 3) never occurred; (2, 3) last occurred at 6..7, followed by 7, 8, 5, ...
    assert idx.propose(ids, 3) == [7, 8, 5]
    ids += [7]  # incremental: (2, 3, 7) now matches its occurrence at 6..8
    assert idx.propose(ids, 5) == [8, 5, 2, 3, 7]
    assert idx.propose([4, 5, 6], 3) == []  # (fresh index) nothing repeats
    assert NgramIndex(2, 3).propose([1, 2, 1], 2) == []  # 1-grams below min_n
    assert NgramIndex(1, 3).propose([1, 2, 1], 2) == [2, 1]
    # a match near the end is a loop: the draft goes around it
    assert NgramIndex(1, 1).propose([4, 4, 4], 5) == [4, 4, 4, 4, 4]
    assert NgramIndex(1, 3).propose([9, 5, 7, 5, 7], 5) == [5, 7, 5, 7, 5]
    assert NgramIndex(1, 3).propose([1, 2, 3, 1, 2], 2) == [3, 1]  # (period 3, k 2)


def test_accepted_prefix():
    assert accepted_prefix([5, 6, 7], [5, 6, 8, 1]) == 2
    assert accepted_prefix([5, 6], [5, 6, 3]) == 2
    assert accepted_prefix([5], [4, 5]) == 0
    assert accepted_prefix([5], [-1, 5]) == 0  # an error row never agrees


def test_likely_tokens_keeps_the_draft_tokens_with_even_odds():
    assert likely_tokens(1.0, 7) == 7
    assert likely_tokens(0.94, 16) == 11  # 0.94 ** 11 = 0.506, ** 12 = 0.476
    assert likely_tokens(0.94, 4) == 4
    assert likely_tokens(0.5, 4) == 1
    assert likely_tokens(0.49, 4) == 0
    assert likely_tokens(0.8, 4, odds=0.6) == 2  # 0.64 >= 0.6 > 0.512


def repetitive_prompts(n: int, seed: int = 1) -> list[list[int]]:
    """Prompts of repeated spans: the tiny random model then repeats itself, so drafts from
    the prompt and its own output get accepted."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        span = [rng.randrange(5, 8000) for _ in range(3 + i % 5)]
        out.append([rng.randrange(5, 8000) for _ in range(i % 3)] + span * (24 // len(span)))
    return out


def run(make_scheduler, k: int, reqs: list[dict], **server) -> tuple[dict, dict, dict]:
    """Runs reqs (rid, input_ids, sampling_params[, return_logprob]) to completion; returns
    ({rid: output ids}, {rid: (finish reason, meta extras, logprobs)}, counters)."""
    # exactness is checked in wide batches too: no row limit unless a test sets one
    server.setdefault("speculative_ngram_max_rows", 1 << 16)
    s, io = make_scheduler(speculative_ngram=k, **server)
    for r in reqs:
        io.inbox.put(TokenizedGenerateReq(**r))
    for _ in range(1000):  # a constrained request waits outside the batch for its grammar
        drain(s, max_steps=2000)
        if not s.constraints.pending:
            break
        time.sleep(0.01)
    assert not s.constraints.pending, "grammar compiles did not finish"
    assert s.runner.kv_pool.free_size + s.kv.cache.total_size() == s.runner.kv_pool.size
    ids: dict[str, list[int]] = {}
    info: dict[str, tuple] = {}
    for msg in io.outbox:
        assert not isinstance(msg, RequestErrorOut), msg
        if isinstance(msg, BatchTokenOut):
            for i, rid in enumerate(msg.rids):
                ids.setdefault(rid, []).extend(msg.new_token_ids[i])
                lps = info.get(rid, (None, None, []))[2] + [lp for lp, _ in msg.output_token_logprobs[i]]
                info[rid] = (msg.finished_reasons[i], msg.extra_meta[i], lps)
    return ids, info, s.counters


def greedy(rid: str, ids: list[int], **sp) -> dict:
    return {"rid": rid, "input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 40, **sp}}


def assert_same(make_scheduler, reqs: list[dict], **server) -> dict:
    base, base_info, _ = run(make_scheduler, 0, reqs, **server)
    spec, spec_info, counters = run(make_scheduler, K, reqs, **server)
    for r in reqs:
        rid = r["rid"]
        assert spec[rid] == base[rid], f"{rid}: output differs with speculation"
        assert spec_info[rid][0] == base_info[rid][0], f"{rid}: finish reason differs"
    accepted = sum(m.get("spec_accepted_tokens", 0) for _, m, _ in spec_info.values())
    assert accepted == counters["spec_accepted_tokens"] > 0, "no draft was accepted"
    return {"base": base, "spec": spec, "base_info": base_info, "spec_info": spec_info,
            "counters": counters}


def test_draft_length_follows_acceptance_and_returns_to_k_after_a_whole_draft():
    idx = NgramIndex(1, 3)
    assert idx.draft_len(8) == 8  # nothing rejected yet
    idx.record(8, 0)
    idx.record(8, 2)
    assert idx.draft_len(8) == math.ceil(8 * idx.acceptance) < 8
    idx.record(3, 3)  # a whole draft kept: the next one is full length again
    assert idx.acceptance < 1 and idx.draft_len(8) == 8
    idx.record(8, 5)
    assert idx.draft_len(8) == math.ceil(8 * idx.acceptance) < 8
    assert NgramIndex(1, 3).draft_len(0) == 1  # at least one


def test_draft_length_defaults_to_8_without_cuda_graphs(make_scheduler):
    s, _ = make_scheduler()  # the CPU: no CUDA graphs
    assert s.runner.decode_graphs is None and s.speculative_ngram == 8
    s, _ = make_scheduler(speculative_ngram=2)
    assert s.speculative_ngram == 2
    s, _ = make_scheduler(speculative_ngram=0)
    assert s.speculative_ngram == 0


def test_greedy_output_is_identical_and_drafts_are_accepted(make_scheduler):
    prompts = repetitive_prompts(8)
    res = assert_same(make_scheduler, [greedy(f"g{i}", p) for i, p in enumerate(prompts)])
    c = res["counters"]
    # fewer forwards than output tokens: drafts stood in for decode steps
    out = sum(len(v) for v in res["spec"].values())
    assert c["spec_forwards"] + c["decode_forwards"] < out - len(prompts)


def test_length_and_stop_tokens_inside_drafts(make_scheduler):
    """max_new_tokens = every length, and a stop token at every output position: whichever
    positions the accepted drafts covered, each boundary is somewhere inside one."""
    prompts = repetitive_prompts(3)
    base, _, _ = run(make_scheduler, 0, [greedy(f"g{i}", p, max_new_tokens=24)
                                         for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        out = base[f"g{i}"]
        reqs += [greedy(f"len{i}-{n}", p, max_new_tokens=n) for n in range(1, 25)]
        reqs += [greedy(f"stop{i}-{j}", p, max_new_tokens=24, stop_token_ids=[t])
                 for j, t in enumerate(dict.fromkeys(out))]
    res = assert_same(make_scheduler, reqs)
    for i in range(len(prompts)):
        for n in range(1, 25):
            assert res["spec"][f"len{i}-{n}"] == base[f"g{i}"][:n]


def test_eos_and_stop_strings_inside_drafts(make_scheduler, tiny_llama):
    from plait.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    prompts = repetitive_prompts(3, seed=2)
    base, _, _ = run(make_scheduler, 0, [greedy(f"g{i}", p, max_new_tokens=24)
                                         for i, p in enumerate(prompts)])
    reqs = []
    for i, p in enumerate(prompts):
        out = base[f"g{i}"]
        texts = {tok.decode([t], skip_special_tokens=False) for t in out}
        reqs += [greedy(f"str{i}-{j}", p, max_new_tokens=24, stop=[s])
                 for j, s in enumerate(sorted(t for t in texts if t.strip()))]
        # ignore_eos off: a request whose own output token is an EOS id stops inside a draft
        reqs += [greedy(f"min{i}", p, max_new_tokens=24, min_new_tokens=3,
                        stop_token_ids=[out[1]])]
    res = assert_same(make_scheduler, reqs)
    stopped = [r for r, (reason, _, _) in res["spec_info"].items() if reason["type"] == "stop"]
    assert stopped


def test_mixed_batch_sampled_constrained_and_logprobs(make_scheduler):
    """Speculating greedy requests beside seeded sampled ones, a JSON-constrained one and a
    penalized one (none of which speculate) and logprob requests (which do): all unchanged."""
    prompts = repetitive_prompts(6, seed=3)
    reqs = [greedy(f"g{i}", p) for i, p in enumerate(prompts[:3])]
    reqs.append({**greedy("lp", prompts[3]), "return_logprob": True})
    reqs.append(greedy("seeded", prompts[4], temperature=0.8, seed=7))
    reqs.append(greedy("pen", prompts[5], repetition_penalty=1.3))
    # a logit bias does not depend on the tokens before a row: verified drafts stay exact
    reqs.append(greedy("bias", prompts[1], logit_bias={str(t): 4.0 for t in prompts[2][:3]}))
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    reqs.append(greedy("json", prompts[0], json_schema=schema, max_new_tokens=16))
    res = assert_same(make_scheduler, reqs)
    base_lp, spec_lp = res["base_info"]["lp"][2], res["spec_info"]["lp"][2]
    assert len(spec_lp) == len(res["spec"]["lp"])
    assert max(abs(a - b) for a, b in zip(base_lp, spec_lp)) < 1e-4
    for rid in ("seeded", "pen"):  # never speculated
        assert "spec_accepted_tokens" not in res["spec_info"][rid][1]


STRING_SCHEMA = ('{"type": "object", "properties": {"s": {"type": "string"}, "n": {"type": '
                 '"integer"}}, "required": ["s", "n"], "additionalProperties": false}')
ARRAY_SCHEMA = ('{"type": "object", "properties": {"t": {"type": "array", "items": {"type": '
                '"string"}, "maxItems": 3}}, "required": ["t"], "additionalProperties": false}')


@pytest.mark.parametrize("jump_forward", [True, False])
def test_constrained_drafts_verify_through_the_grammar(make_scheduler, tiny_llama, jump_forward):
    """Greedy JSON-schema and regex requests speculate: each draft row is masked by the
    matcher's state after the tokens before it, and jump-forward (or, with it off, the forced
    tokens fed one a step) and the closing planner near max_new_tokens run between tokens as in
    plain decoding: the same tokens and finish reasons, drafts accepted for constrained
    requests, and every output that stopped parses and matches its schema."""
    import json

    import jsonschema

    from plait.models.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_llama)
    prompts = repetitive_prompts(6, seed=4)
    reqs = []
    for i, p in enumerate(prompts):
        for n in (12, 23, 40, 64):  # below CLOSE_WINDOW: a closing is planned inside drafts
            reqs.append(greedy(f"s{i}-{n}", p, json_schema=STRING_SCHEMA, max_new_tokens=n))
        reqs.append(greedy(f"a{i}", p, json_schema=ARRAY_SCHEMA, max_new_tokens=48))
        reqs.append(greedy(f"r{i}", p, regex="([a-z]+ ){2,8}[0-9]{3}", max_new_tokens=40))
    res = assert_same(make_scheduler, reqs, disable_jump_forward=not jump_forward)
    accepted = {rid: m.get("spec_accepted_tokens", 0) for rid, (_, m, _) in res["spec_info"].items()}
    assert sum(v for rid, v in accepted.items() if rid[0] in "sa") > 0
    for rid, ids in res["spec"].items():
        reason = res["spec_info"][rid][0]["type"]
        text = tok.decode(ids, skip_special_tokens=True)
        if rid[0] == "r":
            assert reason != "stop" or re.fullmatch("([a-z]+ ){2,8}[0-9]{3}", text), text
        elif not rid.endswith("-12"):  # (12 tokens can be too few to close the string)
            assert reason == "stop", (rid, text)  # the closing planner ended the JSON in time
            jsonschema.validate(json.loads(text), json.loads(STRING_SCHEMA if rid[0] == "s"
                                                            else ARRAY_SCHEMA))


def test_drafts_fill_a_forward_up_to_max_rows(make_scheduler):
    """--speculative-ngram-max-rows: drafts widen a decode forward to at most that many rows
    (requests + draft tokens); a batch of that many requests decodes without drafts."""
    prompts = repetitive_prompts(8, seed=6)
    reqs = [greedy(f"g{i}", p, max_new_tokens=32, ignore_eos=True) for i, p in enumerate(prompts)]
    widths = []
    s, io = make_scheduler(speculative_ngram=K, speculative_ngram_max_rows=12)
    real = s.runner.forward

    def forward(batch, rows, *args):
        if batch.draft_ids is not None:
            widths.append(sum(batch.extend_lens))
        return real(batch, rows, *args)

    s.runner.forward = forward
    for r in reqs:
        io.inbox.put(TokenizedGenerateReq(**r))
    drain(s, max_steps=2000)
    assert widths and max(widths) <= 12 and s.counters["spec_accepted_tokens"] > 0
    # as many requests as rows: none speculates, the output is the same
    wide, _, counters = run(make_scheduler, K, reqs, speculative_ngram_max_rows=8)
    assert counters["spec_forwards"] == counters["spec_draft_tokens"] == 0
    base, _, _ = run(make_scheduler, 0, reqs)
    assert wide == base


@pytest.mark.parametrize("acceptance", [0.3, 0.95])
def test_past_the_narrow_rows_only_likely_draft_tokens(make_scheduler, monkeypatch, acceptance):
    """--speculative-ngram-narrow-rows: up to it any request's draft widens the forward; past
    it only draft tokens with even odds by the request's acceptance (here held fixed)."""
    monkeypatch.setattr(NgramIndex, "record", lambda self, proposed, accepted: None)
    orig_init = NgramIndex.__init__

    def init(self, *a):
        orig_init(self, *a)
        self.acceptance = acceptance

    monkeypatch.setattr(NgramIndex, "__init__", init)
    prompts = repetitive_prompts(4, seed=6)
    reqs = [greedy(f"g{i}", p, max_new_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
    s, io = make_scheduler(speculative_ngram=K, speculative_ngram_max_rows=64,
                           speculative_ngram_max_tokens=64, speculative_ngram_narrow_rows=6)
    widths = []
    real = s.runner.forward

    def forward(batch, rows, *args):
        if batch.draft_ids is not None:
            widths.append((batch.batch_size, sum(batch.extend_lens), [len(d) for d in batch.draft_ids]))
        return real(batch, rows, *args)

    s.runner.forward = forward
    for r in reqs:
        io.inbox.put(TokenizedGenerateReq(**r))
    drain(s, max_steps=2000)
    four = [w for w in widths if w[0] == 4]
    assert four
    if acceptance < 0.5:  # 4 requests + 2 narrow rows, nothing past them
        assert max(w[1] for w in four) == 6
    else:  # 0.95: draft_len(4) = 4 tokens each, all with even odds (0.95 ** 4 = 0.81)
        assert max(w[1] for w in four) > 6
        assert all(max(d) <= K for _, _, d in four)
    spec, _, _ = run(make_scheduler, K, reqs, speculative_ngram_max_rows=64,
                     speculative_ngram_max_tokens=64, speculative_ngram_narrow_rows=6)
    base, _, _ = run(make_scheduler, 0, reqs)
    assert spec == base


def test_drafts_under_memory_pressure(make_scheduler):
    """A small pool: drafts get only the slots left after one per request, requests are
    retracted and recomputed; outputs stay the same and the pool accounts to the slot."""
    prompts = repetitive_prompts(8, seed=4)
    res = assert_same(make_scheduler, [greedy(f"g{i}", p, max_new_tokens=48)
                                       for i, p in enumerate(prompts)], max_total_tokens=300)
    assert res["counters"]["retractions"] > 0


@pytest.mark.model
def test_matches_transformers(make_scheduler, tiny_llama):
    prompts = repetitive_prompts(4, seed=5)
    ref = hf_reference(tiny_llama, prompts, 24)
    reqs = [{**greedy(f"g{i}", p, max_new_tokens=24), "return_logprob": True}
            for i, p in enumerate(prompts)]
    ids, info, counters = run(make_scheduler, K, reqs)
    assert counters["spec_accepted_tokens"] > 0
    for i, (ref_ids, ref_lps) in enumerate(ref):
        assert ids[f"g{i}"] == ref_ids, f"prompt {i}: tokens differ from transformers"
        got = info[f"g{i}"][2]
        assert max(abs(a - b) for a, b in zip(got, ref_lps)) < 1e-4


@pytest.mark.model
def test_matches_transformers_when_drafts_verify_over_a_shared_prefix(
    make_scheduler, tiny_llama, monkeypatch
):
    """Branches of one root verifying their drafts together attend as decode rows, the root
    read once for all of them (cpu_attention.plan_rows): the same tokens as transformers."""
    from plait.kernels import torch_backend
    from plait.kernels.base import ForwardMode

    as_rows = []

    def plan_rows(meta):
        plan = cpu_plan_rows(meta)
        if plan is not None and meta.mode is ForwardMode.EXTEND and "seen" not in meta.cache:
            meta.cache["seen"] = as_rows.append(meta.extend_lens_cpu)
        return plan

    cpu_plan_rows = torch_backend.plan_rows
    monkeypatch.setattr(torch_backend, "plan_rows", plan_rows)
    root = repetitive_prompts(1, seed=7)[0] * 3  # 72 tokens, above MIN_SHARED_PREFIX
    prompts = [root + p[:6] for p in repetitive_prompts(4, seed=8)]
    ref = hf_reference(tiny_llama, prompts, 24)
    reqs = [{**greedy(f"g{i}", p, max_new_tokens=24), "return_logprob": True}
            for i, p in enumerate(prompts)]
    ids, info, counters = run(make_scheduler, K, reqs)
    assert counters["spec_accepted_tokens"] > 0
    assert as_rows and all(max(lens) > 1 for lens in as_rows)  # the verifies, as decode rows
    for i, (ref_ids, ref_lps) in enumerate(ref):
        assert ids[f"g{i}"] == ref_ids, f"prompt {i}: tokens differ from transformers"
        got = info[f"g{i}"][2]
        assert max(abs(a - b) for a, b in zip(got, ref_lps)) < 1e-4
