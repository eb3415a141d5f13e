"""The scripts in examples/ run end to end (small sizes) on the shared in-process engine."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str):
    module_name = f"plait_example_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module  # pydantic resolves annotations through it
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def test_judge(engine_backend, capsys):
    judge = load("judge")
    states = judge.main(n_items=4, backend=engine_backend, progress_bar=False)
    assert len(states) == 4 and states.summary.num_failed == 0
    for state in states:
        assert state["grade"] in judge.GRADES
        assert len(state.get_meta_info("grade")["scores"]) == len(judge.GRADES)
    assert states.summary.cached_token_fraction > 0.5  # the rubric is prefilled once
    assert "cached-token fraction" in capsys.readouterr().out


def test_json_extraction(engine_backend):
    example = load("json_extraction")
    contacts = example.main(n_docs=2, backend=engine_backend)
    assert len(contacts) == 2
    assert all(isinstance(c, example.Contact) for c in contacts)


def test_tree_of_thought(engine_backend, capsys):
    state = load("tree_of_thought").main(depth=2, branches=2, backend=engine_backend)
    tree = state.ret_value
    assert len(tree) == 2 and all(len(step["nodes"]) == 2 for step in tree)
    for step in tree:
        assert all(node["cached"] > 0 for node in step["nodes"])  # branches reuse the fork prefix
        best = step["nodes"][step["best"]]
        assert best["score"] == max(node["score"] for node in step["nodes"])
    assert state.usage.cached_token_fraction > 0.5
    assert "plan:" in capsys.readouterr().out


def test_react_agent(engine_backend):
    example = load("react_agent")
    (state,) = example.main(n_questions=1, max_steps=2, backend=engine_backend)
    assert state.error() is None
    trace = state.ret_value
    assert 1 <= len(trace) <= 3 and trace[-1][0] == "finish"
    for action, arg, observation in trace[:-1]:
        expected = example.FACTS[arg] if action == "lookup" else example.calculator(arg)
        assert observation == expected
        assert f"{action}[{arg}]\nObservation: {observation}\n" in state.text()
    int(state["answer"])
