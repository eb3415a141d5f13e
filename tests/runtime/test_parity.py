"""Greedy output of plait.Engine == Hugging Face transformers `generate`, token for token,
whatever the batch composition, cache hits, chunking and retraction; logprobs within 1e-4."""

from __future__ import annotations

import random

import pytest
import torch

import plait

pytestmark = pytest.mark.model  # starts a model or a server

MAX_NEW = 24


def make_prompts(n: int, vocab: int, seed: int = 0, max_len: int = 80) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 5, max_len] + [rng.randint(3, max_len) for _ in range(n - 4)]
    prompts = [[rng.randrange(vocab) for _ in range(n_tok)] for n_tok in lengths]
    # two prompts share a long prefix with another, so the cache is exercised within a batch
    prompts[5] = prompts[3][:60] + prompts[5][:10]
    prompts[6] = prompts[3][:40] + [7, 8, 9]
    return prompts


def hf_reference(path: str, prompts: list[list[int]], max_new: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        g = model.generate(
            torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=max_new, do_sample=False, output_scores=True,
            return_dict_in_generate=True, pad_token_id=0,
        )
        ids = g.sequences[0, len(p):].tolist()
        lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(g.scores, ids)]
        outs.append((ids, lps))
    return outs


def run_plait(engine: plait.Engine, prompts: list[list[int]], max_new: int):
    outs = engine.generate(
        input_ids=prompts,
        sampling_params={"max_new_tokens": max_new, "temperature": 0.0},
        return_logprob=True,
    )
    return outs


def assert_matches(outs, ref):
    for i, (o, (ids, lps)) in enumerate(zip(outs, ref)):
        assert o["output_ids"] == ids, f"prompt {i}: tokens differ"
        got = [e[0] for e in o["meta_info"]["output_token_logprobs"]]
        assert len(got) == len(lps)
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-4, f"prompt {i}: logprobs differ"


@pytest.fixture(scope="module")
def llama_ref(tiny_llama):
    prompts = make_prompts(16, 8192)
    return prompts, hf_reference(tiny_llama, prompts, MAX_NEW)


def test_llama_batch_and_cache_hits(tiny_llama, llama_ref):
    prompts, ref = llama_ref
    with plait.Engine(tiny_llama) as engine:
        first = run_plait(engine, prompts, MAX_NEW)
        assert_matches(first, ref)
        second = run_plait(engine, prompts, MAX_NEW)  # every prompt is now cached
        assert_matches(second, ref)
        assert all(o["meta_info"]["cached_tokens"] >= len(p) - 1 for o, p in zip(second, prompts) if len(p) > 1)
        # in-batch sharing: prompt 5 reuses prompt 3's prefix within the first batch
        assert first[5]["meta_info"]["cached_tokens"] >= 60
        # ...and decode attention read the shared 40 tokens once for prompts 3, 5 and 6
        assert engine.get_server_info()["decode_shared_kv_tokens"] > 0
        # a different batch composition: every other prompt, reversed
        sub = list(range(0, 16, 2))[::-1]
        third = run_plait(engine, [prompts[i] for i in sub], MAX_NEW)
        assert_matches(third, [ref[i] for i in sub])


def test_llama_chunked_prefill(tiny_llama, llama_ref):
    prompts, ref = llama_ref
    with plait.Engine(tiny_llama, chunked_prefill_size=16) as engine:
        assert_matches(run_plait(engine, prompts, MAX_NEW), ref)


def test_llama_retraction_under_memory_pressure(tiny_llama, llama_ref):
    prompts, ref = llama_ref
    with plait.Engine(tiny_llama, max_total_tokens=200, chunked_prefill_size=64) as engine:
        assert_matches(run_plait(engine, prompts, MAX_NEW), ref)
        info = engine.get_server_info()
        assert info["retractions"] > 0
        assert info["kv_used"] == 0


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-llama-sharded"])
def test_other_architectures(checkpoint, name):
    path = checkpoint(name)
    n = 16 if name == "tiny-qwen2" else 4
    prompts = make_prompts(16, 8192, seed=1)[:n]
    ref = hf_reference(path, prompts, 12)
    with plait.Engine(path) as engine:
        assert_matches(run_plait(engine, prompts, 12), ref)
