"""select scoring on the Engine backend: the scores are the model's log-probabilities of each
choice (checked against direct engine requests), token healing at the prompt/choice boundary,
the three methods, and one batched request per select."""

from __future__ import annotations

import math

import pytest

import plait.lang as pl
from plait.io_struct import to_payload

CHOICES = ["yes", "no", "maybe not"]


def _lcp(a: list[int], b: list[int]) -> int:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return i


def direct_logprobs(engine, prompt: str, choice: str) -> list[float]:
    """Logprobs of the choice's tokens given the prompt, from one cold engine request."""
    tok = engine.tokenizer
    prompt_ids = tok.encode(prompt, add_special_tokens=False)
    full = tok.encode(prompt + choice, add_special_tokens=False)
    engine.flush_cache()
    out = engine.generate(
        input_ids=full,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=_lcp(prompt_ids, full),
    )
    return [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]]


def unconditional_logprobs(engine, token_ids: list[int]) -> list[float]:
    engine.flush_cache()
    out = engine.generate(
        input_ids=token_ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=0,
    )
    values = [lp or 0.0 for lp, _, _ in out["meta_info"]["input_token_logprobs"]]
    return [0.0] * (len(token_ids) - len(values)) + values  # a 1-token input has no entries


def test_warm_input_logprobs_equal_cold(engine):
    """select scores must not depend on what the prefix cache holds. (Regression: when every
    row of an extend needed logits, the runner skipped its row gather although the rows came
    reordered, sampling row first, so warm-cache input logprobs were shifted.)"""
    ids = engine.tokenizer.encode("Answer: good", add_special_tokens=False)
    engine.flush_cache()
    args = dict(
        input_ids=ids,
        sampling_params={"max_new_tokens": 0},
        return_logprob=True,
        logprob_start_len=len(ids) - 2,
    )
    cold = engine.generate(**args)["meta_info"]["input_token_logprobs"]
    warm = engine.generate(**args)["meta_info"]["input_token_logprobs"]
    assert len(cold) == len(warm) == 2
    assert [a[0] for a in warm] == pytest.approx([a[0] for a in cold], abs=1e-4)


def pick_program(prompt: str, choices: list[str], method=pl.token_length_normalized):
    @pl.function
    def pick(s):
        s += prompt + pl.select("c", choices, choices_method=method)

    return pick


@pytest.mark.parametrize(
    "prompt,choices",
    [
        ("Question: is water wet?\nAnswer: ", CHOICES),  # healing: " yes" is one token
        ("Question: is water wet?\nAnswer:", [" " + c for c in CHOICES]),
        ("The color of the sky is bl", ["ue", "ack"]),  # healing inside a word
    ],
)
def test_scores_are_the_engines_logprobs(engine, engine_backend, prompt, choices):
    state = pick_program(prompt, choices).run(backend=engine_backend)
    assert state.error() is None
    meta = state.get_meta_info("c")
    for choice, entries, score in zip(choices, meta["input_token_logprobs"], meta["scores"]):
        expected = direct_logprobs(engine, prompt, choice)
        assert [e[0] for e in entries] == pytest.approx(expected, abs=1e-4)
        assert score == pytest.approx(sum(expected) / len(expected), abs=1e-4)
    assert state["c"] == choices[meta["scores"].index(max(meta["scores"]))]


def test_token_healing_gives_the_same_choice(engine_backend):
    spaced = pick_program("Question: is the sea salty?\nAnswer: ", CHOICES).run(
        backend=engine_backend
    )
    glued = pick_program("Question: is the sea salty?\nAnswer:", [" " + c for c in CHOICES]).run(
        backend=engine_backend
    )
    assert " " + spaced["c"] == glued["c"]
    assert spaced.text() == glued.text()
    a, b = spaced.get_meta_info("c"), glued.get_meta_info("c")
    assert a["scores"] == pytest.approx(b["scores"], abs=1e-5)
    # the healed token (space + word start) is scored, not a lone trailing space
    first = a["input_token_logprobs"][0][0][2]
    assert first.startswith(" ") and len(first) > 1


def test_unconditional_likelihood_normalized(engine, engine_backend):
    prompt = "Is fire cold? Answer:"
    choices = [" yes", " no"]
    state = pick_program(prompt, choices, pl.unconditional_likelihood_normalized).run(
        backend=engine_backend
    )
    meta = state.get_meta_info("c")
    assert meta["choices_method"] == "unconditional_likelihood_normalized"
    assert state["c"] == choices[meta["scores"].index(max(meta["scores"]))]
    assert [len(u) for u in meta["unconditional_token_logprobs"]] == [
        len(c) for c in meta["input_token_logprobs"]
    ]
    for choice, cond, score in zip(choices, meta["input_token_logprobs"], meta["scores"]):
        uncond = unconditional_logprobs(engine, [e[1] for e in cond])
        expected = direct_logprobs(engine, prompt, choice)
        diffs = [c - u for c, u in zip(expected, uncond)]
        assert score == pytest.approx(sum(diffs) / len(diffs), abs=1e-4)


def test_greedy_token_selection(engine_backend):
    state = pick_program(
        "Pick a fruit:", [" apple", " apricot", " banana"], pl.greedy_token_selection
    ).run(backend=engine_backend)
    meta = state.get_meta_info("c")
    assert meta["choices_method"] == "greedy_token_selection"
    assert state["c"] in (" apple", " apricot", " banana")
    assert len(meta["greedy_logprob_matrix"]) == 3


class CountingBackend(pl.EngineBackend):
    def __init__(self, engine) -> None:
        super().__init__(engine)
        self.calls = []

    async def request(self, inp):
        self.calls.append(to_payload(inp))  # the /generate body this request would be
        return await super().request(inp)


def test_one_batched_request_after_one_prefix_commit(engine):
    backend = CountingBackend(engine)
    pick_program("Some fresh context for a select. Answer:", CHOICES).run(backend=backend)
    commit, batch = backend.calls
    assert commit["sampling_params"]["max_new_tokens"] == 0 and not commit.get("return_logprob")
    assert len(batch["input_ids"]) == len(CHOICES) and batch["return_logprob"]
    assert all(ids[: len(commit["input_ids"])] == commit["input_ids"] for ids in batch["input_ids"])

    @pl.function
    def after_gen(s):
        s += "Context:" + pl.gen("g", max_tokens=3) + pl.select("c", CHOICES)

    backend.calls.clear()
    state = after_gen.run(backend=backend)
    assert len(backend.calls) == 2  # the gen, then the select batch: the text was committed
    assert state.usage.cached_tokens > 0


def test_sampled_select_and_bad_choices(engine_backend):
    state = pick_program("Choose:", CHOICES).run(backend=engine_backend)
    assert all(math.isfinite(x) for x in state.get_meta_info("c")["scores"])

    @pl.function
    def hot(s):
        s += "Choose:" + pl.select("c", CHOICES, temperature=5.0)

    assert hot.run(backend=engine_backend)["c"] in CHOICES
    with pytest.raises(ValueError, match="choices"):
        pl.select("c", [])
