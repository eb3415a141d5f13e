"""The OpenAI-compatible API, driven by the official `openai` client against a real server."""

from __future__ import annotations

import json
import math

import openai
import pytest

from tests.server.server_utils import MODEL_NAME

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def stream_text(chunks, n: int = 1) -> tuple[list[str], list[str | None], dict | None]:
    texts, reasons, usage = [""] * n, [None] * n, None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons, usage


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL_NAME]


def test_retrieve_model(client):
    """GET /v1/models/{model} (the client's models.retrieve), as OpenAI and SGLang serve it:
    the served model's card; another name is a 404 model_not_found naming it."""
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    assert model == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-7")
    assert e.value.body["code"] == "model_not_found" and "gpt-7" in e.value.body["message"]


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8
    assert r.usage.prompt_tokens > 10  # the chat template wraps the messages
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_template_is_the_tokenizers(client, server):
    """The prompt is tokenizer.apply_chat_template(messages, add_generation_prompt=True)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(server.args.model_path)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    r = client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))


def test_text_completion(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    assert r.object == "text_completion"
    assert r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=9,
        max_completion_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_matches_non_stream(client, endpoint):
    kwargs = dict(model=MODEL_NAME, max_tokens=12, temperature=0.9, seed=7)
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    kwargs.update(messages=CHAT) if endpoint == "chat" else kwargs.update(prompt="The weather is")
    full = create(**kwargs)
    expected = full.choices[0].message.content if endpoint == "chat" else full.choices[0].text
    texts, reasons, usage = stream_text(
        create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert texts == [expected]
    assert reasons == [full.choices[0].finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_counts_each_choice_so_far(client, endpoint):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries its choice's usage;
    the counts grow to the final usage chunk's."""
    create = client.chat.completions.create if endpoint == "chat" else client.completions.create
    kwargs = dict(model=MODEL_NAME, max_tokens=10, temperature=1.0, seed=5, n=2, stream=True,
                  stream_options={"include_usage": True, "continuous_usage_stats": True})
    kwargs.update(messages=CHAT) if endpoint == "chat" else kwargs.update(prompt="The weather is")
    chunks = list(create(**kwargs))
    *running, final = chunks
    assert not final.choices and final.usage.completion_tokens > 0
    last = {0: 0, 1: 0}
    for c in running:
        (choice,) = c.choices
        u = c.usage
        assert u.prompt_tokens == final.usage.prompt_tokens
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert u.completion_tokens >= last[choice.index]
        last[choice.index] = u.completion_tokens
    assert sum(last.values()) == final.usage.completion_tokens


def test_stream_without_usage_has_no_usage_chunk(client):
    chunks = list(
        client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=3, stream=True)
    )
    assert all(c.usage is None for c in chunks) and all(c.choices for c in chunks)


def test_n3(client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=1.0, seed=3, n=3)
    r = client.chat.completions.create(**kwargs)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seeds 3, 4, 5
    assert 3 <= r.usage.completion_tokens <= 24
    streamed, _, _ = stream_text(client.chat.completions.create(**kwargs, stream=True), n=3)
    assert streamed == texts
    # prompt tokens count once, not once per sample
    single = client.chat.completions.create(**{**kwargs, "n": 1})
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert texts[0] == single.choices[0].message.content


def test_completion_logprobs(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt="Logprobs please", max_tokens=5, temperature=0, logprobs=3
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-4)
        assert top.get(token) == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("logprobs", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token(client, logprobs):
    """OpenAI's legacy logprobs: "the API will always return the logprob of the sampled token,
    so there may be up to logprobs+1 elements" (vLLM too): logprobs=0 gives the sampled token
    alone (it gave null), and a sampled token outside the top-k is added to them."""
    r = client.completions.create(model=MODEL_NAME, prompt="Roll the dice:", max_tokens=8,
                                  temperature=2.0, seed=7, logprobs=logprobs)
    lp = r.choices[0].logprobs
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top is not None and 1 <= len(top) <= logprobs + 1
        assert top[token] == pytest.approx(logprob, abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.bytes == list(t.token.encode())
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)


@pytest.mark.parametrize("stream", [False, True])
def test_constrained_chat_logprobs_spell_the_message(client, stream):
    """A JSON-schema answer's logprobs.content has one entry per output token, the grammar's
    keys and punctuation included, and spells the message (forced tokens had none)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "n": {"type": "integer"}},
              "required": ["name", "n"], "additionalProperties": False}
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0, logprobs=True,
                  response_format={"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}})
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        content = [t for c in chunks if c.choices and c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content]
    else:
        r = client.chat.completions.create(**kwargs)
        text, content = r.choices[0].message.content, r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
    assert json.loads(text).keys() == {"name", "n"}
    tokens = [t.token for t in content]
    if tokens[-1] in ("<|endoftext|>", "<|im_end|>"):  # the EOS that ended it, as unconstrained
        tokens.pop()
    assert "".join(tokens) == text


def test_streamed_logprobs_match(client):
    kwargs = dict(
        model=MODEL_NAME, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    full = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        t
        for c in client.chat.completions.create(**kwargs, stream=True)
        for ch in c.choices
        if ch.logprobs
        for t in ch.logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full]
    full = client.completions.create(
        model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0, logprobs=1
    ).choices[0]
    chunks = [
        c.choices[0]
        for c in client.completions.create(
            model=MODEL_NAME, prompt="abc", max_tokens=5, temperature=0, logprobs=1, stream=True
        )
    ]
    assert sum((c.logprobs.tokens for c in chunks if c.logprobs), []) == full.logprobs.tokens
    offsets = sum((c.logprobs.text_offset for c in chunks if c.logprobs), [])
    assert offsets == full.logprobs.text_offset


def test_stop_string(client):
    base = dict(model=MODEL_NAME, prompt="Count: one two three", temperature=0)
    text = client.completions.create(**base, max_tokens=12).choices[0].text
    assert len(text) > 6
    stop = text[3:6]
    r = client.completions.create(**base, max_tokens=12, stop=[stop, "\u2603never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_include_stop_str_in_output_keeps_exactly_the_stop_string(client):
    """vLLM's include_stop_str_in_output: the text ends with the stop string, not past it
    (no_stop_trim keeps the whole last token), streamed the same."""
    base = dict(model=MODEL_NAME, prompt="Count: one two three", temperature=0, max_tokens=12)
    text = client.completions.create(**base).choices[0].text
    stop = text[3:5]  # two characters: inside a token, so the token runs past it
    extra = {"include_stop_str_in_output": True}
    r = client.completions.create(**base, stop=[stop], extra_body=extra)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop) + len(stop)]
    chunks = client.completions.create(**base, stop=[stop], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_usage_reports_cached_tokens_of_a_repeated_prefix(client):
    prefix = "A long shared instruction that every request repeats. " * 8
    first = client.completions.create(model=MODEL_NAME, prompt=prefix + "Q1", max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=prefix + "Q2", max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= second.usage.prompt_tokens - 4  # all but the differing tail


def test_batch_of_prompts(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=["one", "two"], max_tokens=3, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text  # greedy: samples of one prompt agree
    alone = client.completions.create(model=MODEL_NAME, prompt="two", max_tokens=3, temperature=0)
    assert r.choices[2].text == alone.choices[0].text


def test_token_id_prompt_and_echo(client):
    r = client.completions.create(
        model=MODEL_NAME, prompt=[1000, 2000], max_tokens=3, temperature=0
    )
    assert r.usage.prompt_tokens == 2
    echoed = client.completions.create(
        model=MODEL_NAME, prompt="Echo me", max_tokens=3, temperature=0, echo=True
    )
    plain = client.completions.create(
        model=MODEL_NAME, prompt="Echo me", max_tokens=3, temperature=0
    )
    assert echoed.choices[0].text == "Echo me" + plain.choices[0].text


def test_streamed_echo_starts_each_choice_with_its_prompt(client, http):
    """echo with stream (vLLM streams it): each choice's text, its chunks joined, is what the
    same request returns whole; with logprobs too, so are its logprobs (the prompt's first)."""
    base = dict(model=MODEL_NAME, prompt=["Echo me", "And me"], max_tokens=3, temperature=0,
                n=2, echo=True)
    whole = client.completions.create(**base)
    joined = ["", "", "", ""]
    for chunk in client.completions.create(**base, stream=True):
        for c in chunk.choices:
            joined[c.index] += c.text
    assert joined == [c.text for c in whole.choices]
    assert joined[2].startswith("And me")
    for max_tokens in (3, 0):
        scored = {**base, "logprobs": 1, "max_tokens": max_tokens}
        whole = client.completions.create(**scored)
        parts = [{"tokens": [], "token_logprobs": [], "text_offset": []} for _ in range(4)]
        for chunk in client.completions.create(**scored, stream=True):
            for c in chunk.choices:
                for key, got in parts[c.index].items():
                    got += getattr(c.logprobs, key) if c.logprobs else []
        for c in whole.choices:
            assert parts[c.index] == {key: getattr(c.logprobs, key) for key in parts[0]}
            assert parts[c.index]["token_logprobs"][0] is None  # the prompt's first token


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_echo_with_logprobs_scores_the_prompt(client, http, max_tokens):
    """echo + logprobs returns the prompt tokens' logprobs before the completion's, the first
    one null, as OpenAI and vLLM do: what lm-evaluation-harness's loglikelihood reads
    (max_tokens=0). The values are /generate's input logprobs of the same prompt."""
    prompt = "The quick brown fox jumps"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens,
                                  temperature=0, echo=True, logprobs=1)
    (choice,) = r.choices
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(
        lp.text_offset) == n_prompt + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens) == choice.text
    native = http.post("/generate", json={
        "text": prompt, "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True, "logprob_start_len": 0}).json()["meta_info"]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(
        [v for v, _, _ in native["input_token_logprobs"][1:]], abs=1e-4)
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert logprob <= 0 and len(top) >= 1


def test_user_and_penalties_accepted(client):
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        user="u-1",
        frequency_penalty=0.5,
        presence_penalty=0.5,
        top_p=0.9,
    )
    assert r.choices[0].message.content is not None


def test_text_content_parts_are_the_joined_string(client):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    a, b = (client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": content}], max_tokens=4,
        temperature=0) for content in (parts, "Hello there"))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_logit_bias(client):
    """+100 on one token makes every greedy (and sampled) step pick it; a bias outside
    [-100, 100] or on an id outside the vocabulary is a 400 naming logit_bias."""
    plain = client.completions.create(model=MODEL_NAME, prompt=[1000, 2000], max_tokens=4,
                                      temperature=0, logprobs=1)
    pick = client.completions.create(model=MODEL_NAME, prompt=[1000, 2000], max_tokens=1,
                                     temperature=0).choices[0].text
    assert plain.choices[0].logprobs.tokens[0] == pick
    for temperature in (0.0, 0.7):  # greedy rows (no screened picks for them) and sampled
        biased = client.completions.create(
            model=MODEL_NAME, prompt=[1000, 2000], max_tokens=4, temperature=temperature,
            seed=1, logit_bias={"3000": 100},
        )
        text = biased.choices[0].text
        assert text != pick * 4 and len(text) % 4 == 0 and text == text[: len(text) // 4] * 4
    for bad in ({"3000": 500}, {"99999999": 1}, {"x": 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=2,
                                           logit_bias=bad)
        assert e.value.param == "logit_bias", bad


def test_openai_fields_that_change_nothing_are_accepted(client):
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    r = client.chat.completions.create(**kwargs, store=False, metadata={"run": "eval-1"},
                                       service_tier="auto", parallel_tool_calls=False)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_openai_client_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=CHAT, temperature=-1)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=10**6)
    assert e.value.param == "max_tokens"


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema(client):
    pytest.importorskip("plait.grammar.manager", reason="the grammar layer is not in this tree yet")
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=64, temperature=0, response_format=fmt
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(
        model=MODEL_NAME, prompt="Pick:", max_tokens=8, extra_body={"choices": ["red", "green"]}
    )
    assert r.choices[0].text in ("red", "green")


def test_response_format_structural_tag(client):
    """vLLM's response_format {"type": "structural_tag", "format": ...}: the answer is the
    tag's format, its JSON part held to its schema; a schema plait refuses is a 400 naming
    response_format."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "tag", "begin": "<person>", "end": "</person>",
           "content": {"type": "json_schema", "json_schema": SCHEMA}}
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=64, temperature=0,
        response_format={"type": "structural_tag", "format": fmt})
    text = r.choices[0].message.content
    assert text.startswith("<person>") and text.endswith("</person>"), text
    jsonschema.validate(json.loads(text[len("<person>"):-len("</person>")]), SCHEMA)
    fmt["content"]["json_schema"] = {"type": "array", "uniqueItems": True}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT, max_tokens=8,
            response_format={"type": "structural_tag", "format": fmt})
    assert e.value.body["param"] == "response_format" and "uniqueItems" in e.value.body["message"]


def test_invalid_constraint_is_a_400(client):
    pytest.importorskip("plait.grammar.manager", reason="the grammar layer is not in this tree yet")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(
            model=MODEL_NAME, prompt="x", max_tokens=4, extra_body={"regex": "(unclosed"}
        )
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).choices
