"""Greedy output with plait's extend attention kernel (extend_attn_cpu.cpp) == Hugging Face
transformers, token for token: chunked prefill (chunk boundaries inside prompts), cache hits
(a cached prefix + new tokens), several requests per extend forward, grouped-query heads;
on the tiny Llama and on SmolLM2 with the judge workload's shape (a shared rubric).

The scheduler runs in this process, after the kernel is loaded, so every extend forward takes
the kernel (counted); an Engine would start on torch's path while the kernel loads.
"""

from __future__ import annotations

import random

import pytest

from plait.kernels import cpu_attention, cpu_extend
from plait.messages import BatchTokenOut, TokenizedGenerateReq
from tests.runtime.test_parity import hf_reference, make_prompts

pytestmark = pytest.mark.model


class CountingKernel:
    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, 0

    def extend_attention(self, *args):
        self.calls += 1
        return self.kernel.extend_attention(*args)


@pytest.fixture
def kernel(monkeypatch):
    if cpu_extend.kernel_flags() is None:
        pytest.skip("the extend kernel needs AVX2")
    assert cpu_extend.start_extend_kernel(block=True), "the extend kernel failed to build"
    counting = CountingKernel(cpu_extend._kernel)
    monkeypatch.setattr(cpu_extend, "_kernel", counting)
    return counting


def generate(scheduler, io, prompts: list[list[int]], max_new: int):
    """Greedy outputs and their logprobs, in prompt order, from an in-process scheduler."""
    rids = [f"r{random.random()}" for _ in prompts]
    for rid, p in zip(rids, prompts):
        sp = {"temperature": 0.0, "max_new_tokens": max_new}
        io.inbox.put(
            TokenizedGenerateReq(rid=rid, input_ids=p, sampling_params=sp, return_logprob=True)
        )
    ids: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list[float]] = {r: [] for r in rids}
    for _ in range(2000):
        scheduler.step()
        if not scheduler.has_work and io.inbox.empty():
            break
    for msg in io.outbox:
        if isinstance(msg, BatchTokenOut):
            for rid, new, lp in zip(msg.rids, msg.new_token_ids, msg.output_token_logprobs):
                if rid in ids:
                    ids[rid] += new
                    lps[rid] += [e[0] for e in lp]
    io.outbox.clear()
    return [(ids[r], lps[r]) for r in rids]


def assert_matches(outs, ref) -> None:
    for i, ((ids, lps), (ref_ids, ref_lps)) in enumerate(zip(outs, ref)):
        assert ids == ref_ids, f"prompt {i}: tokens differ"
        assert max(abs(a - b) for a, b in zip(lps, ref_lps)) < 1e-4, f"prompt {i}: logprobs"


@pytest.mark.parametrize("chunk", [16, 2048])
def test_tiny_llama_with_the_kernel(make_scheduler, tiny_llama, kernel, chunk, monkeypatch):
    # one-token extends over a prefix two requests share would attend as decode rows
    # (cpu_attention.plan_rows; test_speculative checks them against transformers)
    monkeypatch.setattr(cpu_attention, "ROWS_MAX_EXTEND", 0)
    prompts = make_prompts(16, 8192)
    ref = hf_reference(tiny_llama, prompts, 16)
    scheduler, io = make_scheduler(chunked_prefill_size=chunk)
    assert_matches(generate(scheduler, io, prompts, 16), ref)
    calls = kernel.calls
    assert calls > 0
    # again: every prompt now cached up to its last token (prefix + one new token each)
    assert_matches(generate(scheduler, io, prompts, 16), ref)
    assert kernel.calls > calls


def test_smollm2_judge_shape_with_the_kernel(kernel):
    """A rubric shared by every request, each request's own item after it, prefill chunks that
    end inside the rubric and inside items: the judge workload in small."""
    from plait.args import ServerArgs
    from plait.models.resolve import resolve_model_path
    from plait.models.tokenizer import load_tokenizer
    from plait.runtime.scheduler import Scheduler
    from plait.runtime.scheduler_process import InProcessIO

    path = str(resolve_model_path("smollm2"))
    rng = random.Random(7)
    rubric = [rng.randrange(256, 49000) for _ in range(256)]
    prompts = [
        rubric + [rng.randrange(256, 49000) for _ in range(rng.randint(10, 40))] for _ in range(4)
    ]
    ref = hf_reference(path, prompts, 8)
    io = InProcessIO()
    args = ServerArgs(model_path=path, chunked_prefill_size=100, max_total_tokens=8192)
    scheduler = Scheduler(args, path, io, load_tokenizer(path))
    assert_matches(generate(scheduler, io, prompts, 8), ref)
    assert kernel.calls > 0
