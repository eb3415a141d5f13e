"""The backend-agnostic program suite: every program runs on the in-process Engine and on a
real `plait serve` process through RuntimeEndpoint. Weights are random, so the assertions
check structure and guarantees (types, constraint validity, listed choices, cache reuse),
never what the answers say."""

from __future__ import annotations

import asyncio
import json
import math
import re

from pydantic import BaseModel, Field

import plait.lang as pl
from plait.lang.ir import REGEX_STR

CHOICES = ["yes", "no", "it depends"]


@pl.function
def few_shot_qa(s, question):
    s += "Answer each question in a few words.\n"
    s += "Q: What is the capital of France?\nA: Paris\n"
    s += "Q: How many legs does a spider have?\nA: Eight\n"
    s += "Q: " + question + "\nA:" + pl.gen("answer", max_tokens=12, stop="\n")


def test_few_shot_qa(backend):
    state = few_shot_qa.run(question="What color is the sky?", backend=backend, temperature=0)
    assert state.error() is None
    answer = state["answer"]
    assert isinstance(answer, str) and "\n" not in answer
    assert state.text().endswith("\nA:" + answer)
    meta = state.get_meta_info("answer")
    assert meta["prompt_tokens"] > 20 and meta["completion_tokens"] <= 12


@pl.function
def multi_turn(s, questions):
    s += pl.system("You are a terse assistant.")
    for i, question in enumerate(questions):
        s += pl.user(question)
        s += pl.assistant(pl.gen(f"a{i}", max_tokens=8))


def test_multi_turn_roles(backend):
    questions = ["Hi!", "What is 2+2?", "Thanks."]
    state = multi_turn.run(questions=questions, backend=backend)
    assert state.error() is None
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in messages[1::2]] == questions
    for i in range(3):
        assert messages[2 + 2 * i]["content"] == state[f"a{i}"].lstrip()
        assert "<|im_end|>" not in state[f"a{i}"]
    assert state.text().count("<|im_start|>assistant\n") == 3
    assert state.text().startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>\n")


@pl.function
def pick(s):
    s += "Is the sky blue? Answer: " + pl.select("ans", CHOICES)


def test_select_returns_a_listed_choice_with_scores(backend):
    state = pick.run(backend=backend)
    assert state.error() is None
    assert state["ans"] in CHOICES and state.text().endswith(state["ans"])
    meta = state.get_meta_info("ans")
    assert meta["choices_method"] == "token_length_normalized"
    assert len(meta["scores"]) == len(CHOICES) and all(math.isfinite(x) for x in meta["scores"])
    assert state["ans"] == CHOICES[meta["scores"].index(max(meta["scores"]))]
    assert all(len(lps) >= 1 for lps in meta["input_token_logprobs"])


@pl.function
def typed(s):
    s += "int: " + pl.gen_int("i", max_tokens=6) + "\n"
    s += "float: " + pl.gen("f", dtype=float, max_tokens=6) + "\n"
    s += "bool: " + pl.gen("b", dtype=bool, max_tokens=3) + "\n"
    s += "str: " + pl.gen_string("s", max_tokens=8)


def test_gen_int_and_dtypes(backend):
    state = typed.run(backend=backend)
    assert state.error() is None
    int(state["i"])
    float(state["f"])
    # int and float end where the model would write other text (end_on_exit): on the random
    # model, after the first token (it was held to digits up to max_tokens)
    for name in ("i", "f"):
        assert state.get_meta_info(name)["completion_tokens"] < 6, state[name]
    assert state["b"] in ("True", "False")
    assert re.fullmatch(REGEX_STR, state["s"])


PERSON_RE = r'\{"name": "[a-z]{1,10}", "age": (0|[1-9][0-9]{0,2})\}'  # (a JSON number)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=150)


@pl.function
def extract(s, text):
    s += "Text: " + text + "\nAs JSON: " + pl.gen("by_regex", regex=PERSON_RE, max_tokens=40)
    s += "\nAgain: " + pl.gen("by_schema", json_schema=Person, max_tokens=64)


def test_json_by_regex_and_by_schema(backend):
    state = extract.run(text="Ann is 31.", backend=backend)
    assert state.error() is None
    assert re.fullmatch(PERSON_RE, state["by_regex"])
    assert json.loads(state["by_regex"])["age"] >= 0
    person = Person.model_validate_json(state["by_schema"])
    assert 0 <= person.age <= 150


TOOLS = {"add": lambda a, b: a + b, "mul": lambda a, b: a * b}


@pl.function
def tool_loop(s, steps):
    s += "You can call the tools add and mul.\n"
    for i in range(steps):
        s += f"Step {i}: tool=" + pl.select(f"tool{i}", list(TOOLS))
        s += " a=" + pl.gen_int(f"a{i}", max_tokens=3) + " b=" + pl.gen_int(f"b{i}", max_tokens=3)
        result = TOOLS[s[f"tool{i}"]](int(s[f"a{i}"]), int(s[f"b{i}"]))
        s += f"\nObservation: {result}\n"
    s += "Final answer:" + pl.gen("final", max_tokens=6, stop="\n")


def test_tool_use_loop(backend):
    state = tool_loop.run(steps=2, backend=backend)
    assert state.error() is None
    for i in range(2):
        expected = TOOLS[state[f"tool{i}"]](int(state[f"a{i}"]), int(state[f"b{i}"]))
        assert f"Observation: {expected}\n" in state.text()
    assert state.text().endswith("Final answer:" + state["final"])


OBSERVATIONS = {"search": "3 results found.", "lookup": "Entry: none."}


@pl.function
def react(s, question, max_steps=3):
    s += "Question: " + question + "\n"
    actions = []
    for step in range(max_steps):
        s += "Thought:" + pl.gen(f"thought{step}", max_tokens=6, stop="\n") + "\n"
        s += "Action: " + pl.select(f"action{step}", ["search", "lookup", "finish"]) + "\n"
        action = s[f"action{step}"]
        actions.append(action)
        if action == "finish":
            break
        s += "Observation: " + OBSERVATIONS[action] + "\n"
    s += "Answer:" + pl.gen("answer", max_tokens=6, stop="\n")
    return actions


def test_react_control_flow_on_generated_values(backend):
    state = react.run(question="Who wrote Hamlet?", backend=backend)
    assert state.error() is None
    actions = state.ret_value
    assert 1 <= len(actions) <= 3 and "finish" not in actions[:-1]
    text = state.text()
    for action in actions:
        if action != "finish":
            assert "Action: " + action + "\nObservation: " + OBSERVATIONS[action] in text
    assert text.count("Observation:") == sum(a != "finish" for a in actions)


@pl.function
def parallel_facts(s, topic):
    s += "Context: " + "background sentence. " * 30 + "\nThree facts about " + topic + ".\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Fact {i + 1}:" + pl.gen("fact", max_tokens=6, stop="\n")
    forks.join()
    s += "Summary:" + pl.gen("summary", max_tokens=6)


def test_fork_join_parallel_decoding(backend):
    state = parallel_facts.run(topic="owls", backend=backend)
    assert state.error() is None
    facts = state["fact"]
    assert len(facts) == 3 and all(isinstance(f, str) for f in facts)
    metas = state.get_meta_info("fact")
    assert all(m["cached_tokens"] > 0 for m in metas)  # branches reuse the committed prefix
    assert state.get_meta_info("summary")["cached_tokens"] > 0


@pl.function
def parallel_encoding(s, docs):
    s += "Read the documents.\n"
    forks = s.fork(len(docs))
    forks += lambda i: f"Doc {i}: " + docs[i] + "\n"
    forks.join("concate_and_append")
    s += "Which doc mentions cats? Doc" + pl.gen("answer", max_tokens=4)


def test_concate_and_append(backend):
    docs = ["Dogs bark.", "Cats purr.", "Fish swim."]
    state = parallel_encoding.run(docs=docs, backend=backend)
    assert state.error() is None
    expected = "Read the documents.\n" + "".join(f"Doc {i}: {d}\n" for i, d in enumerate(docs))
    assert state.text().startswith(expected)
    assert state.get_meta_info("answer")["cached_tokens"] > 0


def test_streaming_concatenates_to_the_final_text(backend):
    state = few_shot_qa.run(question="Why?", stream=True, backend=backend, max_new_tokens=8)
    pieces = list(state.text_iter())
    assert state.error() is None
    assert "".join(pieces) == state.text()
    state = few_shot_qa.run(question="Why?", stream=True, backend=backend, max_new_tokens=8)
    assert "".join(state.text_iter("answer")) == state["answer"]


async def test_async_streaming(backend):
    state = await few_shot_qa.arun(question="How?", stream=True, backend=backend)
    pieces = [p async for p in state.text_async_iter("answer")]
    assert "".join(pieces) == await state.aget("answer")


@pl.function
def at_least(s):
    s += "Say something:" + pl.gen("x", min_tokens=6, max_tokens=8)


def test_min_tokens(backend):
    state = at_least.run(backend=backend)
    assert state.error() is None
    assert state.get_meta_info("x")["completion_tokens"] >= 6


@pl.function
def biased(s, token):
    s += "Pick: " + pl.gen("x", max_tokens=3, temperature=0, logit_bias={token: 100})


def test_logit_bias(backend):
    runs = [biased.run(token=t, backend=backend) for t in (3000, 7000)]
    assert all(state.error() is None for state in runs)
    for state in runs:  # each step picks the biased token
        x = state["x"]
        assert x and x == x[: len(x) // 3] * 3
    assert runs[0]["x"] != runs[1]["x"]


RUBRIC = "You are a strict grader. Grade the answer as good or bad. " * 8


@pl.function
def judge(s, answer):
    s += RUBRIC + "\nAnswer: " + answer + "\nGrade: " + pl.select("grade", ["good", "bad"])


def test_run_batch_shares_the_rubric(backend):
    states = judge.run_batch(
        [{"answer": f"answer number {i}"} for i in range(12)], backend=backend, num_threads=4
    )
    assert all(st.error() is None and st["grade"] in ("good", "bad") for st in states)
    summary = states.summary
    assert summary.common_prefix_chars > len(RUBRIC) // 2
    assert summary.cached_token_fraction > 0.5


async def test_arun_batch_alongside_other_coroutines(backend):
    ticks = 0
    done = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await asyncio.sleep(0.001)

    async def batch():
        try:
            return await judge.arun_batch([{"answer": str(i)} for i in range(6)], backend=backend)
        finally:
            done.set()

    states, _ = await asyncio.gather(batch(), ticker())
    assert len(states) == 6 and all(st.error() is None for st in states)
    # the loop kept running other coroutines during the batch: a batch that blocked the loop
    # would set `done` before the ticker's first turn (0 ticks); the batch takes ~15 ms
    assert ticks >= 2
