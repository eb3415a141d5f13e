"""Tensor parallelism (--tp N) on CPU over gloo: greedy output with two ranks equals transformers
and one rank, token for token, with cache hits, chunked prefill, grammar, logprobs and abort;
the KV rows broadcast to the other ranks; sharding; a dead rank fails requests (503) and
shutdown leaves no process behind."""

from __future__ import annotations

import argparse
import os
import signal
import time
from dataclasses import dataclass

import pytest
import torch

import plait
from plait.args import ServerArgs
from plait.kernels.base import ForwardMode
from plait.models.llama import LlamaForCausalLM
from plait.radix_cache.kv_pool import ReqToTokenPool
from plait.runtime.model_runner import ForwardInputs
from plait.runtime.parallel import ModelSharding, TPGroup, check_tp_divisible
from plait.runtime.tp_worker import BatchSender, ForwardMessage, RowUpdate, decode, encode
from tests.procs import alive as _alive
from tests.procs import descendants as _descendants
from tests.runtime.test_parity import assert_matches, hf_reference, make_prompts, run_plait

MAX_NEW = 16
ENGINE = {"max_total_tokens": 4096, "max_running_requests": 16, "log_level": "warning"}
# constraints and logprobs, compared between --tp 2 and --tp 1 (computed on rank 0 only)
MIXED = [
    ({"max_new_tokens": 10, "regex": "(yes|no), [0-9]{3}"}, {}),
    ({"max_new_tokens": 12, "json_schema": '{"type": "object", "properties": '
      '{"a": {"type": "integer"}}, "required": ["a"]}'}, {}),
    ({"max_new_tokens": 6}, {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}),
]


# ----------------------------------------------------------------------------- no model
def test_forward_message_round_trip():
    msg = ForwardMessage(
        ForwardInputs(ForwardMode.EXTEND, [5, 6, 7, 8], [3, 0], [2, 0], [1, 3]),
        logit_rows=[0, 3, 2],
        row_updates=[RowUpdate(3, 0, [11, 12, 13]), RowUpdate(0, 0, [1, 2, 3])],
    )
    header, body = encode(msg)
    assert decode(header.tolist(), body) == msg
    empty = ForwardMessage(ForwardInputs(ForwardMode.DECODE, [9], [1], [4], [1]), [0], [])
    header, body = encode(empty)
    assert decode(header.tolist(), body) == empty


def test_sender_sends_the_rows_the_other_ranks_lack():
    pool = ReqToTokenPool(4, 16)
    sender = BatchSender(TPGroup(), pool)

    def inputs(slots, prefix, ext):
        return ForwardInputs(ForwardMode.EXTEND, [0] * sum(ext), slots, prefix, ext)

    pool.write(1, 0, torch.tensor([7, 8, 9]))  # a cached prefix of 2, then one new slot
    assert sender.row_updates(inputs([1], [2], [1])) == [RowUpdate(1, 0, [7, 8, 9])]
    pool.write(1, 3, torch.tensor([10]))  # decode: only the new slot goes
    assert sender.row_updates(inputs([1], [3], [1])) == [RowUpdate(1, 3, [10])]
    # the radix cache re-points positions 1.. to shared slots: sent from the first change
    pool.write(1, 1, torch.tensor([20, 21]))
    pool.write(1, 4, torch.tensor([30]))
    assert sender.row_updates(inputs([1], [4], [1])) == [RowUpdate(1, 1, [20, 21, 10, 30])]
    # nothing changed within the used positions: nothing sent; stale slots beyond are ignored
    pool.write(2, 0, torch.tensor([40, 41, 42, 43]))
    assert sender.row_updates(inputs([1, 2], [4, 0], [1, 2])) == [RowUpdate(2, 0, [40, 41])]
    assert sender.row_updates(inputs([2], [2], [1])) == [RowUpdate(2, 2, [42])]
    # a slot recycled for another request whose rows happen to match what was sent: no update
    pool.write(2, 0, torch.tensor([40, 41, 42]))
    assert sender.row_updates(inputs([2], [0], [3])) == []


@dataclass(frozen=True)
class _Shape:  # the fields of ModelConfig that sharding reads
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int


def _cfg(heads=4, kv=2, inter=384, vocab=8256, head_dim=32) -> _Shape:
    return _Shape(heads, kv, head_dim, inter, vocab)


@pytest.mark.parametrize(
    ("cfg", "tp", "message"),
    [
        (_cfg(heads=4), 3, "4 attention heads do not divide by tp_size 3"),
        (_cfg(heads=6, kv=3), 2, "3 KV heads neither divide by tp_size 2 nor divide it"),
        (_cfg(inter=390), 4, "MLP width 390 does not divide by tp_size 4"),
    ],
)
def test_indivisible_shapes_are_a_clear_error(cfg, tp, message):
    with pytest.raises(ValueError, match=message):
        check_tp_divisible(cfg, tp)


def test_shards_reassemble_the_checkpoint():
    plan = LlamaForCausalLM.tp_plan
    cfg = _cfg(heads=4, kv=1, vocab=9)  # MQA: the one KV head is replicated on both ranks
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(128, 16),
        "model.layers.0.self_attn.k_proj.bias": torch.randn(32),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 128),
        "model.layers.0.mlp.down_proj.bias": torch.randn(16),
        "model.embed_tokens.weight": torch.randn(9, 16),
        "model.norm.weight": torch.randn(16),
    }
    shards = [ModelSharding(cfg, TPGroup(rank, 2)) for rank in range(2)]
    part = {name: [s.shard_tensor(name, t, plan) for s in shards] for name, t in full.items()}
    q, k, o, down, emb, norm = part.values()
    assert torch.equal(torch.cat(q), full["model.layers.0.self_attn.q_proj.weight"])
    assert all(torch.equal(p, full["model.layers.0.self_attn.k_proj.bias"]) for p in k)
    assert torch.equal(torch.cat(o, dim=1), full["model.layers.0.self_attn.o_proj.weight"])
    assert all(torch.equal(p, full["model.layers.0.mlp.down_proj.bias"]) for p in down)
    assert all(torch.equal(p, full["model.norm.weight"]) for p in norm)
    assert [p.shape[0] for p in emb] == [5, 5]  # 9 rows padded to 10
    assert torch.equal(torch.cat(emb)[:9], full["model.embed_tokens.weight"])
    assert not emb[1][4].any()
    assert shards[1].local_config().num_attention_heads == 2
    assert shards[1].local_config().num_key_value_heads == 1


def test_tp_flag():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args(["--tp", "2"])).tp_size == 2
    assert ServerArgs.from_cli_args(parser.parse_args(["--tp-size", "2"])).tp_size == 2
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(tp_size=0)


# ----------------------------------------------------------------------------- processes
def _mixed(engine: plait.Engine) -> list[dict]:
    prompt = make_prompts(8, 8192, seed=3)[7]
    return [engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, **sp}, **kw)
            for sp, kw in MIXED]


@pytest.fixture(scope="module")
def llama_ref(tiny_llama):
    prompts = make_prompts(10, 8192)
    return prompts, hf_reference(tiny_llama, prompts, MAX_NEW)


@pytest.fixture(scope="module")
def tp1_mixed(tiny_llama):
    with plait.Engine(tiny_llama, chunked_prefill_size=16, **ENGINE) as engine:
        return _mixed(engine)


@pytest.mark.model
def test_tp2_llama_matches_transformers_and_tp1(tiny_llama, llama_ref, tp1_mixed):
    prompts, ref = llama_ref
    before = _descendants(os.getpid())  # other tests' servers may still be running
    engine = plait.Engine(tiny_llama, tp_size=2, chunked_prefill_size=16, **ENGINE)
    try:
        assert engine.model_info["tp_size"] == 2
        first = run_plait(engine, prompts, MAX_NEW)  # chunks of 16; prompt 5 shares 3's prefix
        assert_matches(first, ref)
        assert first[5]["meta_info"]["cached_tokens"] >= 60
        second = run_plait(engine, prompts, MAX_NEW)  # every prompt is now cached
        assert_matches(second, ref)
        assert all(o["meta_info"]["cached_tokens"] >= len(p) - 1
                   for o, p in zip(second, prompts) if len(p) > 1)

        mixed = _mixed(engine)  # grammar masks, input/output/top logprobs: as with one rank
        for got, want in zip(mixed, tp1_mixed):
            assert got["output_ids"] == want["output_ids"]
        got, want = mixed[2]["meta_info"], tp1_mixed[2]["meta_info"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [e[1] for e in got[key]] == [e[1] for e in want[key]]
            pairs = [(a[0], b[0]) for a, b in zip(got[key], want[key]) if a[0] is not None]
            assert max(abs(a - b) for a, b in pairs) < 1e-4
        assert [[t[1] for t in row] for row in got["output_top_logprobs"]] == \
            [[t[1] for t in row] for row in want["output_top_logprobs"]]

        # abort: a stream closed early frees its KV; the next request is still exact
        stream = engine.generate(input_ids=prompts[3], stream=True, sampling_params={
            "max_new_tokens": 400, "ignore_eos": True, "temperature": 0.0})
        next(stream)
        stream.close()
        assert_matches(run_plait(engine, prompts[:2], MAX_NEW), ref[:2])
        deadline = time.monotonic() + 30
        while engine.get_server_info()["kv_used"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.get_server_info()["kv_used"] == 0

        children = _descendants(os.getpid()) - before
        pids = {name: p.pid for name, p in engine._children.procs.items()}
        assert set(pids) == {"detokenizer", "scheduler", "tp1"}
        assert set(pids.values()) <= children
    finally:
        engine.shutdown()
    assert not [pid for pid in children if _alive(pid)]


@pytest.mark.model
@pytest.mark.parametrize("name", ["tiny-qwen2", pytest.param("tiny-qwen3", marks=pytest.mark.slow)])
def test_tp2_other_architectures(checkpoint, name):
    # qwen2: MQA (its one KV head replicated on both ranks), qkv bias, tied embeddings;
    # qwen3: q/k norms over each head
    path = checkpoint(name)
    prompts = make_prompts(8, 8192, seed=1)[:4]
    ref = hf_reference(path, prompts, 12)
    with plait.Engine(path, tp_size=2, **ENGINE) as engine:
        assert_matches(run_plait(engine, prompts, 12), ref)


@pytest.mark.model
def test_indivisible_heads_fail_before_any_process_starts(tiny_llama):
    before = _descendants(os.getpid())
    with pytest.raises(ValueError, match="4 attention heads do not divide by tp_size 3"):
        plait.Engine(tiny_llama, tp_size=3, **ENGINE)
    assert not [pid for pid in _descendants(os.getpid()) - before if _alive(pid)]


@pytest.mark.model
def test_a_dead_rank_fails_requests_with_503_and_nothing_hangs(tiny_llama):
    before = _descendants(os.getpid())  # other tests' servers may still be running
    engine = plait.Engine(tiny_llama, tp_size=2, **ENGINE)
    try:
        children = _descendants(os.getpid()) - before
        stream = engine.generate(input_ids=[1, 2, 3], stream=True, sampling_params={
            "max_new_tokens": 2000, "ignore_eos": True, "temperature": 0.0})
        next(stream)
        os.kill(engine._children.procs["tp1"].pid, signal.SIGKILL)
        killed = time.monotonic()
        # tp1, or rank 0 whose forward failed on tp1's closed socket
        with pytest.raises(ValueError, match="(tp1|scheduler) process died") as err:
            for _ in stream:
                pass
        assert err.value.status == 503
        assert time.monotonic() - killed < 10
        with pytest.raises(ValueError, match="server unavailable") as err:
            engine.generate(input_ids=[4, 5], sampling_params={"max_new_tokens": 2})
        assert err.value.status == 503
    finally:
        engine.shutdown()
    assert not [pid for pid in children if _alive(pid)]
