"""Engine greedy parity with transformers using the Triton attention backend (on the CPU
under TRITON_INTERPRET=1, which the scheduler process inherits)."""

from __future__ import annotations

import pytest

import plait
from tests.runtime.test_parity import assert_matches, hf_reference, make_prompts

pytestmark = pytest.mark.model  # starts a model or a server

pytest.importorskip("triton")


def test_triton_backend_matches_transformers(tiny_llama):
    prompts = make_prompts(16, 8192, seed=3, max_len=40)[:6]
    prompts[5] = prompts[3][:30] + [11, 12]  # a cached prefix under the Triton extend kernel
    ref = hf_reference(tiny_llama, prompts, 6)
    # float32 also on a GPU (whose default is bf16): transformers' fp32 result is the oracle
    with plait.Engine(tiny_llama, attention_backend="triton", chunked_prefill_size=32,
                      dtype="float32") as engine:
        outs = engine.generate(
            input_ids=prompts, sampling_params={"max_new_tokens": 6, "temperature": 0.0},
            return_logprob=True,
        )
        assert engine.get_server_info()["attention_backend"] == "triton"
    assert_matches(outs, ref)
