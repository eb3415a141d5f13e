"""The scripts in examples/ run end to end: mechanics on the tiny random checkpoint (every
example runs, prints its accuracy line, and its checker is right on right and wrong answers),
and answer quality on the real default model (SmolLM2-135M-Instruct) with a small limit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    module_name = f"plait_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # pydantic resolves annotations through it
        spec.loader.exec_module(module)
    return sys.modules[module_name]


# ----------------------------------------------------------------------------- checkers
def test_judge_items_and_scoring():
    judge = load("judge")
    items = judge.make_items(40)
    assert items == judge.make_items(40)  # seeded
    labels = [it["label"] for it in items]
    assert labels.count("correct") == labels.count("incorrect") == 20
    for it in items:  # a sum's label says whether the answer is the sum
        q = it["question"]
        if q.startswith("What is ") and "+" in q:
            x, y = (int(v) for v in q[len("What is ") : -1].split(" + "))
            assert (int(it["answer"]) == x + y) == (it["label"] == "correct")
    assert judge.accuracy(labels, labels) == 1.0
    flipped = ["incorrect" if v == "correct" else "correct" for v in labels]
    assert judge.accuracy(flipped, labels) == 0.0
    assert judge.accuracy([None] * 40, labels) == 0.0
    assert judge.majority_baseline(["a", "a", "b"]) == pytest.approx(2 / 3)


def test_json_extraction_checker():
    ex = load("json_extraction")
    (text, person), *_ = ex.make_items(3)
    assert person.name in text and str(person.age) in text and person.city in text
    assert ex.field_matches(person.model_dump_json(), person) == dict.fromkeys(
        ["name", "age", "city"], True
    )
    wrong = person.model_copy(update={"age": person.age + 1})
    assert ex.field_matches(wrong.model_dump_json(), person) == {
        "name": True,
        "age": False,
        "city": True,
    }
    assert ex.field_matches('{"name": "x"', person) is None  # does not parse
    assert ex.field_matches('{"name": "x", "age": 500, "city": "y"}', person) is None


def test_react_checker_and_tools():
    ex = load("react_agent")
    for question, expected in ex.make_tasks(6):
        if "population" in question:
            assert expected == ex.FACTS[question.split()[-1].rstrip("?")]
        else:
            assert expected == ex.calculator(question[len("What is ") : -1])
    assert ex.calculator("12 * 3") == 36 and ex.calculator("10 - 12") == -2
    assert ex.is_solved("36", 36) and not ex.is_solved("35", 36)
    assert not ex.is_solved(None, 36) and not ex.is_solved("", 36)


def test_tree_of_thought_choose():
    ex = load("tree_of_thought")
    assert ex.choose(["5", "6", "5"], [0.0, -0.1, -2.0]) == 0  # majority, then score
    assert ex.choose(["5", "6", "7"], [-3.0, -0.1, -2.0]) == 1  # no majority: best check


# ----------------------------------------------------------------------------- mechanics
@pytest.mark.model
def test_judge(engine_backend, capsys):
    judge = load("judge")
    result = judge.main(limit=4, backend=engine_backend, progress_bar=False)
    assert result["n"] == 4 and 0.0 <= result["accuracy"] <= 1.0
    assert result["majority_baseline"] == 0.5
    assert result["cached_token_fraction"] > 0.5  # the rubric is prefilled once
    out = capsys.readouterr().out
    assert "judge accuracy" in out and "majority baseline 50.0%" in out


@pytest.mark.model
def test_json_extraction(engine_backend, capsys):
    result = load("json_extraction").main(limit=2, backend=engine_backend)
    assert 0.0 <= result["fields"] <= 1.0
    assert "field accuracy" in capsys.readouterr().out


@pytest.mark.model
def test_tree_of_thought(engine_backend, capsys):
    result = load("tree_of_thought").main(limit=1, branches=2, backend=engine_backend)
    (state,) = result["states"]
    assert state.error() is None
    tree = state.ret_value["tree"]
    assert len(tree) == 2 and all(len(node["values"]) == 2 for node in tree)
    assert state.usage.cached_token_fraction > 0.3  # the branches reuse the fork prefix
    assert "tree of thought solved" in capsys.readouterr().out


@pytest.mark.model
def test_react_agent(engine_backend, capsys):
    ex = load("react_agent")
    result = ex.main(limit=1, max_steps=2, backend=engine_backend)
    (state,) = result["states"]
    assert state.error() is None
    trace = state.ret_value
    assert 1 <= len(trace) <= 3 and trace[-1][0] == "finish"
    for action, arg, observation in trace[:-1]:  # every tool call ran the real tool
        expected = ex.FACTS[arg] if action == "lookup" else ex.calculator(arg)
        assert observation == expected
        assert f"{action}[{arg}]\nObservation: {observation}\n" in state.text()
    assert state["answer"].endswith("]") and int(trace[-1][1]) == int(state["answer"][:-1])
    assert "react agent solved" in capsys.readouterr().out


# ----------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def smollm2_backend():
    import plait as pl

    backend = pl.EngineBackend("smollm2", max_total_tokens=65536, log_level="warning")
    yield backend
    backend.shutdown()


@pytest.mark.model
def test_examples_on_smollm2(smollm2_backend):
    # measured 8/8 parsed, 95.8% of fields right on these 8 sentences; the floor is well below.
    # (The judge and the agents are near chance on this 135M model: no floor is asserted for
    # them, see benchmarks/quality.py's judge figure.)
    result = load("json_extraction").main(limit=8, backend=smollm2_backend)
    assert result["parsed"] == 1.0
    assert result["fields"] >= 0.6
