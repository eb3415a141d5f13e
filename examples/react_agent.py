"""ReAct agent: the model picks a tool with `select`, writes its argument under a regex, Python
runs the tool and appends the observation; then it gives a final answer that is checked.

    python examples/react_agent.py [--url URL | --model PATH] [--limit N] [--steps 3]

The tasks are lookups (a population table) and arithmetic (a calculator): the tools do the
computing, the model chooses the tool, fills its argument and copies the result into its answer.
Control flow depends on generated values (`s["action0"]` waits for that select), so each
program is plain Python around the model. The last line prints solved/total.
"""

from __future__ import annotations

import operator
import random

import plait as pl

FACTS = {
    "paris": 2_102_650,
    "tokyo": 13_960_000,
    "lagos": 15_388_000,
    "oslo": 709_037,
    "cairo": 9_539_673,
    "lima": 10_004_000,
}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CALC_RE = r"[0-9]{1,8} [-+*] [0-9]{1,8}"
LOOKUP_RE = "(" + "|".join(FACTS) + ")"
TOOLS = ["lookup", "calculator", "finish"]

INSTRUCTIONS = f"""Answer the question with one tool call, then finish with the result.
Tools:
  lookup[city]        population of a city, one of: {", ".join(FACTS)}
  calculator[a op b]  integer arithmetic, op is one of + - *
  finish[n]           the final answer, an integer

Question: What is 12 * 3?
Action: calculator[12 * 3]
Observation: 36
Action: finish[36]

Question: What is the population of oslo?
Action: lookup[oslo]
Observation: 709037
Action: finish[709037]
"""


def calculator(expr: str) -> int:
    a, op, b = expr.split()
    return OPS[op](int(a), int(b))


def make_tasks(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n (question, expected answer) pairs, alternating lookups and arithmetic."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        if i % 2 == 0:
            city = rng.choice(sorted(FACTS))
            tasks.append((f"What is the population of {city}?", FACTS[city]))
        else:
            a, b, op = rng.randint(10, 999), rng.randint(2, 99), rng.choice("+-*")
            tasks.append((f"What is {a} {op} {b}?", calculator(f"{a} {op} {b}")))
    return tasks


def is_solved(answer: str | None, expected: int) -> bool:
    try:
        return answer is not None and int(answer) == expected
    except ValueError:
        return False


@pl.function
def agent(s, question, max_steps=3):
    s += INSTRUCTIONS + "\nQuestion: " + question + "\n"
    trace = []
    for i in range(max_steps):
        s += "Action: " + pl.select(f"action{i}", TOOLS) + "["
        action = s[f"action{i}"]  # blocks until the select is decided
        if action == "finish":
            break
        regex = LOOKUP_RE if action == "lookup" else CALC_RE
        s += pl.gen(f"arg{i}", regex=regex, max_tokens=16, temperature=0)
        arg = s[f"arg{i}"]
        observation = FACTS[arg] if action == "lookup" else calculator(arg)
        s += f"]\nObservation: {observation}\n"
        trace.append((action, arg, observation))
    else:
        s += "Action: finish["  # out of steps: answer now
    # the closing bracket is part of the regex so the model can end the number itself
    s += pl.gen("answer", regex=r"-?[0-9]{1,10}\]", max_tokens=12, temperature=0) + "\n"
    trace.append(("finish", s["answer"].rstrip("]"), None))
    return trace


def main(limit: int = 10, max_steps: int = 3, backend: pl.Backend | None = None) -> dict:
    tasks = make_tasks(limit)
    states = agent.run_batch(
        [{"question": q, "max_steps": max_steps} for q, _ in tasks], backend=backend
    )
    solved = 0
    for (question, expected), state in zip(tasks, states):
        if state.error() is not None:
            print(f"Q: {question}\n  failed: {state.error()}")
            continue
        ok = is_solved(state.ret_value[-1][1], expected)
        solved += ok
        steps = " ".join(
            f"{a}[{arg}]" + ("" if obs is None else f"->{obs}") for a, arg, obs in state.ret_value
        )
        print(f"{'ok ' if ok else 'BAD'} Q: {question} (expected {expected})\n    {steps}")
    print(states.summary)
    print(f"react agent solved {solved}/{len(tasks)} ({solved / len(tasks):.0%})")
    return {"solved": solved, "total": len(tasks), "states": states}


if __name__ == "__main__":
    from _common import run_example  # examples/ is on sys.path when a script runs

    run_example(__doc__, main, 10, "number of tasks", steps=3)
