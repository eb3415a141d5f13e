"""Constrained generation through the Engine (scheduler, masks, jump-forward, budget closing):
finished outputs always satisfy their constraint; bad constraints fail only their request."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import plait

pytestmark = pytest.mark.model  # starts a model or a server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
# every value bounded: the random model's greedy output ends by itself
BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
PROMPTS = ["Person:", "Data about Bob", "x", "Extract the user as JSON: Ann, 31, likes tea"]


@pytest.fixture(scope="module", params=["xgrammar", "outlines"])
def engine(request, tiny_llama):
    with plait.Engine(tiny_llama, grammar_backend=request.param, max_total_tokens=8192) as eng:
        yield eng


def finished_ok(out) -> bool:
    return out["meta_info"]["finish_reason"]["type"] == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(engine, temperature):
    outs = engine.generate(
        PROMPTS * 2,
        [{"max_new_tokens": 96, "temperature": temperature, "seed": i, "json_schema": json.dumps(SCHEMA)}
         for i in range(len(PROMPTS) * 2)],
    )
    for o in outs:
        assert finished_ok(o), o["meta_info"]
        jsonschema.validate(json.loads(o["text"]), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_closes_within_a_tight_budget(engine, temperature):
    """32 tokens: the closing plan (~15 tokens) always fits, so every output must end as valid
    JSON. Greedy decoding on random weights repeats one digit or string token forever: the
    planner must find the way out of an open number or string (a depth-first search that
    wandered into string content found none, and every output came back incomplete)."""
    outs = engine.generate(
        PROMPTS, [{"max_new_tokens": 32, "temperature": temperature, "seed": i,
                   "json_schema": json.dumps(SCHEMA)} for i in range(len(PROMPTS))],
    )
    for o in outs:
        assert finished_ok(o), (o["text"], o["meta_info"])
        jsonschema.validate(json.loads(o["text"]), SCHEMA)
        assert o["meta_info"]["completion_tokens"] <= 32


def test_regex_and_choices(engine):
    pattern = r"\(\d{3}\) \d{3}-\d{4}"
    for seed in range(3):
        out = engine.generate("Phone:", {"max_new_tokens": 30, "temperature": 1.0, "seed": seed, "regex": pattern})
        assert finished_ok(out) and re.fullmatch(pattern, out["text"])
    choices = ["apple", "banana split", "cherry"]
    outs = engine.generate(["Pick:"] * 3, {"max_new_tokens": 20, "temperature": 1.0, "choices": choices})
    assert all(o["text"] in choices for o in outs)


def test_a_pick_the_mask_allowed_but_the_matcher_refuses_is_picked_again(engine):
    """xgrammar's masks past a counted repetition of 128 let through tokens its matcher
    refuses (`[^x]{300,}`: tokens with an `x`); such a pick is masked out and the row picked
    again (Scheduler._repick_refused) rather than the request failing with an internal
    error. Greedy and sampled; on xgrammar the repicks happened."""
    before = engine.get_server_info().get("refused_mask_picks", 0)
    for temperature in (0.0, 1.0):
        outs = engine.generate(["Hello", "Data:", "x"] * 2, [
            {"max_new_tokens": 60, "temperature": temperature, "seed": s, "regex": "[^x]{300,}"}
            for s in range(6)])
        for out in outs:
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            assert "x" not in out["text"] and len(out["text"]) >= 60
    if engine.args.grammar_backend == "xgrammar":
        assert engine.get_server_info()["refused_mask_picks"] > before


def test_a_budget_ending_where_the_output_is_whole_is_not_cut_short(engine):
    """The budget planner closes what is open; output its constraint already takes as whole (a
    structural tag's free text) runs to max_new_tokens as the same text unconstrained does,
    not ended a few tokens early (it was: "stop" 3 tokens before the budget)."""
    if engine.args.grammar_backend != "xgrammar":
        pytest.skip("structural tags are xgrammar's")
    tag = {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{
            "type": "tag", "begin": "<tool_call>", "end": "</tool_call>",
            "content": {"type": "json_schema", "json_schema": {"type": "object"}}}]}}
    free, held = (engine.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0.0,
                                            "ignore_eos": True, **extra})
                  for extra in ({}, {"structural_tag": tag}))
    for a, b in zip(free, held):
        assert b["meta_info"]["finish_reason"]["type"] == "length", b["meta_info"]
        assert (a["output_ids"], a["text"]) == (b["output_ids"], b["text"])


def test_a_regex_match_that_may_go_on_runs_to_the_budget(engine):
    """The budget's last token is kept where the output can end after it: `[a-z]+` after 8
    letters is whole, so it ends by length (it was: the 8th token replaced by EOS, "stop")."""
    for out in engine.generate(PROMPTS, {"max_new_tokens": 8, "temperature": 0.0,
                                         "regex": "[a-z]+"}):
        assert out["meta_info"]["finish_reason"] == {"type": "length"}, out["meta_info"]
        assert out["meta_info"]["completion_tokens"] == 8
        assert re.fullmatch("[a-z]+", out["text"]), out["text"]


@pytest.mark.parametrize("constraint, least", [
    ({"regex": r"-?[0-9]{1,10}\]"}, 3),
    ({"regex": r"([a-z]+ ){1,4}[0-9]{2}[.]"}, 6),
    # the shortest output exactly: a closing planned from the first token on (the model's
    # first token `{` leaves none that fits 17 tokens; `{"name": "", ...}` does)
    ({"json_schema": json.dumps(BOUNDED)}, {"xgrammar": 17, "outlines": 14}),  # (whitespace)
])
def test_an_answer_that_fits_the_budget_is_not_cut_short(engine, constraint, least):
    """Greedy output that ends by itself within max_new_tokens is the same whatever the budget
    from its length up: the closing planner replaces only a token that leaves no closing that
    fits (it forced closings with a fixed margin, 3 tokens early: SmolLM2 answered `1000400]`
    where its free output is `10004000]`). Below that length (from the `least` tokens any
    output of the constraint takes, with EOS) it still ends whole: also for free text (the
    random model's endless `[a-z]+`, which no closing ended before)."""
    from plait.runtime.constraints import CLOSE_WINDOW

    if isinstance(least, dict):
        least = least[engine.args.grammar_backend]
    params = {"temperature": 0.0, **constraint}
    full = engine.generate(PROMPTS, {"max_new_tokens": 200, **params})
    ended = cut_short = 0
    for prompt, o in zip(PROMPTS, full):
        assert finished_ok(o), o["meta_info"]
        n = o["meta_info"]["completion_tokens"]
        by_itself = n <= 200 - CLOSE_WINDOW  # (else the planner closed it)
        ended += by_itself
        budgets = (n, n + 1, n + 3, n - 1, n - 3, n - 6, least) if by_itself else (12, 24, 40)
        for budget in (b for b in budgets if b >= least):
            out = engine.generate(prompt, {"max_new_tokens": budget, **params})
            assert finished_ok(out), (budget, out["text"], out["meta_info"])
            assert out["meta_info"]["completion_tokens"] <= budget
            if by_itself and budget >= n:
                assert (out["output_ids"], out["text"]) == (o["output_ids"], o["text"]), budget
                continue
            cut_short += out["text"] != o["text"]
            if "regex" in constraint:
                assert re.fullmatch(constraint["regex"], out["text"]), out["text"]
            else:
                jsonschema.validate(json.loads(out["text"]), BOUNDED)
    assert cut_short  # (the budgets below the answer's length did bite)
    assert ended or "[.]" in constraint.get("regex", "")  # (the random model's free text)


@pytest.mark.parametrize("params", [
    {"regex": r"-?[0-9]{1,10}\]", "max_new_tokens": 4},  # a closing replaces a sampled token
    {"regex": r"-?[0-9]{1,10}\]", "max_new_tokens": 40},
    {"json_schema": json.dumps(BOUNDED), "max_new_tokens": 64},  # forced keys, punctuation
    {"json_schema": json.dumps(SCHEMA), "max_new_tokens": 24},  # a closing of many tokens
])
def test_every_constrained_output_token_has_its_logprob(engine, params):
    """With return_logprob, every output token has a logprob, in output order, each from the
    row that predicts it: a forced token's (jump-forward's text, the budget's closing) comes
    from the extend that feeds the text (forced tokens had none: OpenAI's logprobs.content did
    not spell the message). Logprobs no longer turn jump-forward off (each forced token was
    decoded a step of its own): the output is the same as without them, and each logprob is
    the one scoring prompt + output gives that token. The outputs stay whole."""
    sp = {"temperature": 0.0, **params}
    forced = 0
    for prompt in PROMPTS:
        out = engine.generate(prompt, sp, return_logprob=True)
        meta = out["meta_info"]
        assert finished_ok(out), meta
        if "regex" in params:
            assert re.fullmatch(params["regex"], out["text"]), out["text"]
        else:
            jsonschema.validate(json.loads(out["text"]), json.loads(params["json_schema"]))
        got = meta["output_token_logprobs"]
        assert [tok for _, tok, *_ in got] == out["output_ids"]
        assert all(lp <= 0.0 for lp, *_ in got)
        if "max_new_tokens" in params and params["max_new_tokens"] == 4:
            assert meta["forced_tokens"] >= 2  # the closing `]` and EOS replaced model tokens
        plain = engine.generate(prompt, sp)
        assert plain["output_ids"] == out["output_ids"]
        assert plain["meta_info"]["forced_tokens"] == meta["forced_tokens"]
        forced += meta["forced_tokens"]
        # the oracle: prompt + output scored in one prefill (extend rows, as a forced
        # token's are; a decoded token's row differs from them in the last bits)
        prompt_ids = engine.tokenizer.encode(prompt)
        assert len(prompt_ids) == meta["prompt_tokens"]
        scored = engine.generate(
            input_ids=prompt_ids + out["output_ids"],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_logprob=True, logprob_start_len=len(prompt_ids))
        want = [lp for lp, *_ in scored["meta_info"]["input_token_logprobs"]]
        assert len(want) == len(got)
        for k, ((lp, tok, *_), w) in enumerate(zip(got, want)):
            assert abs(lp - w) < 1e-3, (k, tok, lp, w)
    if "json_schema" in params:
        assert forced  # (jump-forward's text was in the outputs)


def test_streamed_constrained_tokens_come_with_their_logprobs(engine):
    """A streamed request that returns logprobs: jump-forward's text is emitted before the
    forward that computes its logprobs, and the stream holds it until then, so every chunk's
    tokens have theirs (the OpenAI layer pairs each chunk's text with its logprobs). With a
    stop string, forced text (which the string might end inside) is fed a token a step: the
    same output as without logprobs."""
    spec = json.dumps(BOUNDED)
    for extra in ({}, {"stop": ["zzz"]}):
        sp = {"max_new_tokens": 48, "temperature": 0.0, "json_schema": spec, **extra}
        ids: list[int] = []
        for chunk in engine.generate("Person:", sp, stream=True, return_logprob=True):
            ids += chunk["output_ids"]
            assert len(chunk["meta_info"]["output_token_logprobs"]) == len(ids)
        whole = engine.generate("Person:", sp, return_logprob=True)
        assert ids == whole["output_ids"] == engine.generate("Person:", sp)["output_ids"]
        assert [t for _, t, _ in whole["meta_info"]["output_token_logprobs"]] == ids
        jsonschema.validate(json.loads(whole["text"]), BOUNDED)


def test_properties_come_in_each_schema_s_order(engine):
    """The output's keys follow the schema's property order (what a chain-of-thought schema
    relies on: `thoughts` before `answer`), for two schemas that differ only in that order,
    in one engine, and for a Pydantic model's fields. Both were sorted (a cache key with
    sorted keys gave the second schema the first one's grammar; a dict schema was serialized
    sorted), so `answer` came first."""
    import pydantic

    props = {"thoughts": {"type": "string", "maxLength": 5},
             "answer": {"type": "integer", "minimum": 0, "maximum": 9}}
    for order in (["thoughts", "answer"], ["answer", "thoughts"]):
        schema = {"type": "object", "properties": {k: props[k] for k in order},
                  "required": order, "additionalProperties": False}
        for spec in (json.dumps(schema), schema):
            out = engine.generate("x", {"max_new_tokens": 40, "temperature": 0.0,
                                        "json_schema": spec})
            assert list(json.loads(out["text"])) == order, out["text"]

    class Verdict(pydantic.BaseModel):
        thoughts: str = pydantic.Field(max_length=5)
        answer: int = pydantic.Field(ge=0, le=9)

    spec = plait.SamplingParams(json_schema=Verdict).json_schema  # (as plait.lang passes it)
    out = engine.generate("x", {"max_new_tokens": 40, "temperature": 0.0, "json_schema": spec})
    assert list(json.loads(out["text"])) == ["thoughts", "answer"], out["text"]


# `{"a": 0}` ends it; the optional "extra", once opened, takes some fifteen tokens more
LATE_OPENING = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "extra": {"type": "object", "properties": {
            k: {"type": "string", "maxLength": 3} for k in ("k1", "k2", "k3")},
            "required": ["k1", "k2", "k3"], "additionalProperties": False},
    },
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_token_that_opens_a_long_closing_is_checked_before_the_budget_is_tight(engine):
    """A token can lengthen the closing by more than the recheck slack: `,` (or `},`) before
    an optional object with required keys commits the output to ` "extra": {"k1": "", ...}}`.
    Every sampled token in the window is checked (SmolLM2 wrote `"port": 8080}, "database":
    {"url":` at 32 tokens, where `}}` had fitted: `length`, incomplete). Random tokens at
    temperature 1 open "extra" at every distance from the budget."""
    _assert_whole_and_opened(engine, LATE_OPENING, range(8, 30, 3))


def _assert_whole_and_opened(engine, schema: dict, budgets: range) -> None:
    """Random outputs (temperature 1, 6 seeds) at each budget all end whole and valid, and
    some take the schema's optional object "extra"."""
    spec = json.dumps(schema)
    params = [{"max_new_tokens": budget, "temperature": 1.0, "seed": seed, "json_schema": spec}
              for budget in budgets for seed in range(6)]
    outs = engine.generate(["x"] * len(params), params)
    opened = 0
    for p, o in zip(params, outs):
        assert finished_ok(o), (p["max_new_tokens"], o["text"], o["meta_info"])
        value = json.loads(o["text"])
        jsonschema.validate(value, schema)
        opened += "extra" in value
    assert opened  # (the optional object was taken)


# an optional object whose required keys take far more than the few tokens "a" needs
EARLY_OPENING = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "extra": {"type": "object", "properties": {
            f"key{i:02d}": {"type": "string", "maxLength": 2} for i in range(8)},
            "required": [f"key{i:02d}" for i in range(8)], "additionalProperties": False},
    },
    "required": ["a"],
    "additionalProperties": False,
}


def test_a_short_budget_is_checked_from_its_first_token(engine):
    """An output's first tokens choose its structure: `, "extra": {` commits it to eight
    required keys. Checked only in its last 48 tokens, a budget of 50-70 let the random model
    open "extra" just before that, and by then its closing no longer fitted (SmolLM2 on the
    dev schemas at 64 tokens: `{"Records": [{"awsRegion": ...` ran out where `{"Records":
    []}` had fitted). A budget of at most 128 tokens is checked from its first token."""
    _assert_whole_and_opened(engine, EARLY_OPENING, range(50, 72, 3))


# before each required key an optional one, which sorts first: where a key is spelled the
# grammar takes either, and a search that spelled the first letter it takes wrote every key
OPTIONAL_FIRST = {
    "type": "object",
    "properties": {k: {"type": "string", "maxLength": 2}
                   for i in range(6) for k in (f"a{i}", f"r{i}")},
    "required": [f"r{i}" for i in range(6)],
    "additionalProperties": False,
}


def test_the_closing_spells_the_required_keys_not_the_optional_ones(engine):
    """The closing search tries a JSON schema's required key names first where a key is
    spelled: it took the first letter the grammar allowed, so it wrote each optional key
    before its required one, and where only the required ones fit the budget it found no
    closing and the output ran out unfinished (Snowplow's 14 required keys among 24: no
    closing in 127 tokens, where one of 111 fits)."""
    tok = engine.tokenizer
    short = json.dumps({f"r{i}": "" for i in range(6)})
    every = json.dumps({k: "" for i in range(6) for k in (f"a{i}", f"r{i}")})
    least, most = len(tok.encode(short)) + 1, len(tok.encode(every))
    # budgets between the two (the search spells the closing in more tokens than the
    # canonical ones it ends up with, ` "",` as ` "` `"` `,`: a third more here)
    budgets = range(least * 4 // 3 + 2, most - 2, 3)
    assert len(budgets) >= 3
    spec = json.dumps(OPTIONAL_FIRST)
    params = [{"max_new_tokens": budget, "temperature": temperature, "seed": seed,
               "json_schema": spec}
              for budget in budgets for temperature, seed in ((0.0, 0), (1.0, 1), (1.0, 2))]
    outs = engine.generate(["x"] * len(params), params)
    for p, o in zip(params, outs):
        assert finished_ok(o), (p["max_new_tokens"], o["text"], o["meta_info"])
        jsonschema.validate(json.loads(o["text"]), OPTIONAL_FIRST)


def test_the_closing_spells_a_key_the_grammar_does_not_force(engine):
    """After `", "` the grammar takes `reason` or `status` and forces neither: the closing
    search, whose texts are JSON punctuation and minimal values, found no way on from there,
    so an open string before two such keys never closed (SmolLM2 on a Kubernetes schema:
    `length` at 64 tokens, incomplete). It now goes on from the keys' first letters."""
    schema = {"type": "object", "properties": {
        "message": {"type": "string"}, "reason": {"type": "string"},
        "status": {"type": "string"}}, "required": ["message", "status"],
        "additionalProperties": False}
    outs = engine.generate(PROMPTS, {"max_new_tokens": 24, "temperature": 0.0,
                                     "json_schema": json.dumps(schema)})
    for o in outs:
        assert finished_ok(o), (o["text"], o["meta_info"])
        jsonschema.validate(json.loads(o["text"]), schema)


@pytest.mark.parametrize("pattern", [
    r"(yes|no), because [a-z ]+[.]",  # `.` is no JSON closer
    r"[0-9]{3}-[A-Z]{2,}!",  # upper case, `!`
    r"[a-z0-9_]+@[a-z0-9]+[.]com",  # `@`
    r"([a-z]+ ){1,4}[0-9]{2}[.]",
])
def test_a_regex_of_any_characters_ends_whole_within_the_budget(engine, pattern):
    """The budget's closing is found for regexes whose way out takes characters that are not
    JSON's punctuation (the planner tried only those, and these outputs ran to max_new_tokens
    unfinished): every output stops and matches, at budgets well under the random model's
    endless free text."""
    for budget in (10, 16, 24):
        outs = engine.generate(PROMPTS, {"max_new_tokens": budget, "temperature": 0.0,
                                         "regex": pattern})
        for o in outs:
            assert finished_ok(o), (budget, o["text"], o["meta_info"])
            assert re.fullmatch(pattern, o["text"]), o["text"]
            assert o["meta_info"]["completion_tokens"] <= budget


@pytest.mark.parametrize("grammar", [
    'root ::= [a-z]+ "=" [0-9]+ ";"',
    'root ::= item+\nitem ::= "- " [A-Za-z ]+ "\\n"',  # a newline ends an item
])
def test_a_grammar_ends_whole_within_the_budget(engine, grammar):
    """The same for EBNF grammars (xgrammar's): a list item that only a newline ends ran to
    max_new_tokens unfinished."""
    if engine.args.grammar_backend != "xgrammar":
        pytest.skip("EBNF grammars are xgrammar's")
    for budget in (8, 16):
        outs = engine.generate(PROMPTS, {"max_new_tokens": budget, "temperature": 0.0,
                                         "ebnf": grammar})
        for o in outs:
            assert finished_ok(o), (budget, o["text"], o["meta_info"])
            assert o["meta_info"]["completion_tokens"] <= budget
            if "item" in grammar:
                assert re.fullmatch(r"(- [A-Za-z ]+\n)+", o["text"]), o["text"]
            else:
                assert re.fullmatch(r"[a-z]+=[0-9]+;", o["text"]), o["text"]


def test_end_on_exit_ends_where_the_model_leaves_the_constraint(engine):
    """end_on_exit: where the regex can end, EOS takes the probability of every token it
    forbids. Greedy, the output is then a prefix of the plain one (only EOS's logit changed)
    ended by EOS, and shorter where the model would have gone on with other text (the random
    model, almost always: most of its vocabulary is no digit)."""
    pattern = r"[-+]?[0-9]+"
    sp = {"max_new_tokens": 16, "temperature": 0.0, "regex": pattern}
    plain = engine.generate(PROMPTS, sp)
    ended = engine.generate(PROMPTS, {**sp, "end_on_exit": True})
    shorter = 0
    for a, b in zip(plain, ended):
        assert finished_ok(b) and re.fullmatch(pattern, b["text"]), b
        ids = b["output_ids"][:-1]  # before its EOS
        assert b["output_ids"][-1] == b["meta_info"]["finish_reason"]["matched"]
        assert a["output_ids"][: len(ids)] == ids
        shorter += len(b["output_ids"]) < len(a["output_ids"])
    assert shorter
    for o in engine.generate(PROMPTS, {**sp, "end_on_exit": True, "min_new_tokens": 3}):
        assert len(o["output_ids"]) >= 3, o  # EOS stays banned before min_new_tokens
    with pytest.raises(ValueError, match="end_on_exit"):
        engine.generate("x", {**sp, "end_on_exit": "yes"})


@pytest.mark.parametrize(
    "params, word",
    [
        ({"regex": "(unclosed"}, "regex"),
        ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "strng"}}})}, "json_schema"),
        ({"json_schema": "{not json"}, "json_schema"),
    ],
)
def test_bad_constraints_fail_alone(engine, params, word):
    with pytest.raises(ValueError, match=word):
        engine.generate("x", {"max_new_tokens": 8, **params})
    assert engine.generate("still serving", {"max_new_tokens": 4})["meta_info"]["completion_tokens"] == 4


def test_jump_forward_saves_forwards_and_off_forces_nothing(tiny_llama):
    # off, the model decodes every token under the mask (what vLLM does): one forward each;
    # on, forced text costs no forward of its own (speculation off: its drafts would stand in
    # for forwards too, test_speculative.py)
    sp = {"max_new_tokens": 80, "temperature": 0.0, "json_schema": json.dumps(SCHEMA)}
    results = {}
    for jf in (False, True):
        with plait.Engine(tiny_llama, disable_jump_forward=not jf, speculative_ngram=0) as eng:
            outs = eng.generate(PROMPTS, sp)
            for o in outs:
                if finished_ok(o):
                    jsonschema.validate(json.loads(o["text"]), SCHEMA)
            info = eng.get_server_info()
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            results[jf] = (info["request_forwards"], tokens, info["forced_tokens"])
    forwards, tokens, _ = results[False]
    assert forwards >= tokens
    forwards, tokens, forced = results[True]
    assert forced > 0 and forwards < tokens


def masked_greedy_reference(path: str, prompts: list[list[int]], schema: dict, max_new: int):
    """transformers' logits, xgrammar's mask (plait's backend, real), argmax: token by token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from plait.grammar.base import allocate_token_bitmask, create_grammar_backend

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    vocab = model.config.vocab_size
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    grammar = create_grammar_backend("xgrammar", tok, vocab, eos).compile("json_schema", json.dumps(schema))
    outs = []
    for p in prompts:
        m, ids = grammar.matcher(), []
        while len(ids) < max_new and not m.is_terminated():
            with torch.no_grad():
                logits = model(torch.tensor([p + ids])).logits[0, -1]
            mask = allocate_token_bitmask(1, vocab)
            m.fill_bitmask(mask, 0)
            bits = (mask[0].unsqueeze(1) >> torch.arange(32)) & 1
            allowed = bits.flatten()[:vocab].bool()
            t = int(torch.where(allowed, logits, float("-inf")).argmax())
            assert m.accept_token(t)
            ids.append(t)
        outs.append(ids)
    return outs


def test_no_jump_forward_is_masked_greedy(tiny_llama):
    # with jump-forward off the model picks every token, forced text included (vLLM's way):
    # plait's greedy output equals transformers + the grammar mask, token for token
    prompts = [[1, 2, 3, 4], [50, 60, 70], [9] * 12]
    ref = masked_greedy_reference(tiny_llama, prompts, BOUNDED, 200)
    with plait.Engine(tiny_llama, disable_jump_forward=True) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 200, "temperature": 0.0, "json_schema": json.dumps(BOUNDED)})
    for o, ids in zip(outs, ref):
        assert o["output_ids"] == ids
