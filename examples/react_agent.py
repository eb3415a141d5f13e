"""ReAct agent: the model picks a tool with `select`, writes its argument under a regex, Python
runs the tool and appends the observation; up to `max_steps` steps, then a final answer.

    python examples/react_agent.py [--url http://127.0.0.1:30000] [--steps 5]

Control flow depends on generated values (`s["action0"]` waits for that select), so each
program is plain Python around the model. (The default model has random weights: the agent
wanders, but every argument parses and every tool call runs.)
"""

from __future__ import annotations

import argparse
import operator

import plait as pl

FACTS = {"paris": 2_102_650, "tokyo": 13_960_000, "lagos": 15_388_000, "oslo": 709_037}
OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
CALC_RE = r"[0-9]{1,8} [-+*] [0-9]{1,8}"
LOOKUP_RE = "(" + "|".join(FACTS) + ")"

INSTRUCTIONS = f"""Answer the question using tools. Each step: a Thought, then an Action.
Actions:
  lookup[city]      population of a city, one of: {", ".join(FACTS)}
  calculator[a op b] integer arithmetic, op is one of + - *
  finish[n]         the final answer, an integer
Example:
Question: How many people live in Oslo and Paris together?
Thought: I need both populations.
Action: lookup[oslo]
Observation: 709037
"""

QUESTIONS = [
    "How many more people live in Tokyo than in Paris?",
    "What is the population of Lagos times 2?",
    "Which is larger, Oslo or Paris, and by how much?",
]


def calculator(expr: str) -> int:
    a, op, b = expr.split()
    return OPS[op](int(a), int(b))


@pl.function
def agent(s, question, max_steps=5):
    s += INSTRUCTIONS + "\nQuestion: " + question + "\n"
    trace = []
    for i in range(max_steps):
        s += "Thought:" + pl.gen(f"thought{i}", max_tokens=16, stop="\n", temperature=0) + "\n"
        s += "Action: " + pl.select(f"action{i}", ["lookup", "calculator", "finish"]) + "["
        action = s[f"action{i}"]  # blocks until the select is decided
        if action == "finish":
            s += pl.gen_int("answer", max_tokens=10) + "]\n"
            trace.append(("finish", s["answer"], None))
            return trace
        if action == "lookup":
            s += pl.gen(f"arg{i}", regex=LOOKUP_RE, max_tokens=6)
            observation = FACTS[s[f"arg{i}"]]
        else:
            s += pl.gen(f"arg{i}", regex=CALC_RE, max_tokens=16)
            observation = calculator(s[f"arg{i}"])
        s += f"]\nObservation: {observation}\n"
        trace.append((action, s[f"arg{i}"], observation))
    s += "Action: finish[" + pl.gen_int("answer", max_tokens=10) + "]\n"  # out of steps
    trace.append(("finish", s["answer"], None))
    return trace


def main(n_questions: int = 3, max_steps: int = 5, backend: pl.Backend | None = None):
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n_questions)]
    states = agent.run_batch(
        [{"question": q, "max_steps": max_steps} for q in questions], backend=backend
    )
    for question, state in zip(questions, states):
        print("Q:", question)
        if state.error() is not None:
            print("  failed:", state.error())
            continue
        for step, (action, arg, observation) in enumerate(state.ret_value):
            shown = "" if observation is None else f" -> {observation}"
            print(f"  {step}: {action}[{arg}]{shown}")
        print(
            f"  answer: {int(state['answer'])}  ({state.usage.requests} requests, "
            f"{state.usage.cached_token_fraction:.0%} of prompt tokens cached)"
        )
    print(states.summary)
    return states


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running `plait serve` (default: the embedded model)")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    backend = pl.RuntimeEndpoint(args.url) if args.url else pl.EngineBackend()
    pl.set_default_backend(backend)
    try:
        main(args.questions, args.steps)
    finally:
        backend.shutdown()
