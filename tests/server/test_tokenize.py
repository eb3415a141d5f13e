"""vLLM's /tokenize and /detokenize over HTTP: the ids are the ones generation runs on (a text
prompt as /generate encodes it, chat messages as /v1/chat/completions renders them), and
detokenize inverts them; bad input is a 400 naming the field."""

from __future__ import annotations

import pytest

from tests.server.server_utils import MODEL_NAME

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


def test_prompt_tokens_are_the_ones_generate_runs(http):
    text = "The quick brown fox jumps over the lazy dog."
    tok = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": text}).json()
    gen = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 1}})
    assert tok["count"] == len(tok["tokens"]) == gen.json()["meta_info"]["prompt_tokens"]
    assert tok["max_model_len"] > tok["count"] and "token_strs" not in tok
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tok["tokens"]}).json()
    assert back == {"prompt": text}
    strs = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(strs["token_strs"])


def test_chat_tokens_are_the_ones_chat_completions_runs(http):
    tok = http.post("/tokenize", json={"messages": CHAT}).json()
    chat = http.post("/v1/chat/completions",
                     json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1}).json()
    assert tok["count"] == chat["usage"]["prompt_tokens"]
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert bare["count"] < tok["count"] and tok["tokens"][: bare["count"]] == bare["tokens"]


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": "a", "bogus": 1}, "bogus"),
    ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "z" * 200_000}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, 99_999_999]}, "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": ["1"]}, "tokens"),
    ("/detokenize", {"tokens": [5] * 100_000}, "tokens"),
])
def test_bad_input_is_a_4xx_naming_the_field(http, path, body, field):
    resp = http.post(path, json=body)
    assert 400 <= resp.status_code < 500, resp.text
    assert field in resp.json()["error"]["param"], resp.json()
