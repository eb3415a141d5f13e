"""The OpenAI backend against plait's own OpenAI-compatible endpoint: the part of the program
suite the API can serve, and clear errors naming what it cannot."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

import plait.lang as pl
from plait.lang.backends.base import UnsupportedFeature
from tests.lang.test_programs import few_shot_qa, parallel_facts


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=150)


@pl.function
def chat(s, questions):
    s += pl.system("You are a terse assistant.")
    for i, question in enumerate(questions):
        s += pl.user(question)
        s += pl.assistant(pl.gen(f"a{i}", max_tokens=8))


@pl.function
def chat_json(s):
    s += pl.user("Describe a person as JSON.")
    s += pl.assistant(pl.gen("person", json_schema=Person, max_tokens=64))


def test_completions_and_chat(openai_backend):
    state = few_shot_qa.run(question="Why?", backend=openai_backend, temperature=0)
    assert state.error() is None and "\n" not in state["answer"]
    assert state.get_meta_info("answer")["prompt_tokens"] > 20
    state = chat.run(questions=["Hi", "And?"], backend=openai_backend)
    assert state.error() is None
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant"] * 1 + [
        "user",
        "assistant",
    ]
    assert state.messages()[-1]["content"] == state["a1"].lstrip()


def test_json_schema_through_response_format(openai_backend):
    state = chat_json.run(backend=openai_backend)
    assert state.error() is None
    Person.model_validate_json(state["person"])


def test_streaming_and_forks(openai_backend):
    state = chat.run(questions=["Hi"], stream=True, backend=openai_backend)
    assert "".join(state.text_iter()) == state.text()
    state = parallel_facts.run(topic="owls", backend=openai_backend)
    assert state.error() is None and len(state["fact"]) == 3


@pl.function
def pick(s):
    s += "Answer: " + pl.select("a", ["yes", "no"])


@pl.function
def regex_gen(s):
    s += "Number: " + pl.gen_int("n")


@pl.function
def min_tokens(s):
    s += "Say:" + pl.gen("x", min_tokens=3)


@pl.function
def mid_turn(s):
    s += pl.user("Hi")
    with s.assistant():
        s += "Sure, " + pl.gen("rest", max_tokens=4)


@pytest.mark.parametrize(
    "program,feature",
    [
        (pick, "select"),
        (regex_gen, "regex"),
        (min_tokens, "min_new_tokens"),
        (mid_turn, "start of an assistant turn"),
    ],
)
def test_unsupported_features_are_named(openai_backend, program, feature):
    state = program.run(backend=openai_backend)
    assert isinstance(state.error(), UnsupportedFeature)
    assert feature in str(state.error()) and "openai" in str(state.error())
