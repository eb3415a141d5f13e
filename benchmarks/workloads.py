"""Benchmark workloads as token-id inputs, generated deterministically so every engine gets
byte-identical prompts."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_new_tokens: int
    description: str

    @property
    def num_requests(self) -> int:
        return len(self.prompts)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # stay clear of the special tokens at the end of the vocabulary
    return [rng.randrange(256, vocab - 16) for _ in range(n)]


def judge(vocab: int, n: int = 64, rubric_len: int = 1000, item_len: int = 60, out: int = 8) -> Workload:
    rng = random.Random(1)
    rubric = _ids(rng, rubric_len, vocab)
    prompts = [rubric + _ids(rng, item_len + rng.randint(-5, 5), vocab) for _ in range(n)]
    return Workload("judge", prompts, out, f"{n} requests: {rubric_len}-token shared rubric + ~{item_len} unique, {out} out")


def decode(vocab: int, n: int = 32, prompt_len: int = 128, out: int = 128) -> Workload:
    rng = random.Random(2)
    prompts = [_ids(rng, prompt_len, vocab) for _ in range(n)]
    return Workload("decode", prompts, out, f"{n} requests: {prompt_len} distinct prompt tokens, {out} out")


# ----------------------------------------------------------------------------- suite workloads
# Everything below is standard-library only: benchmarks/peers.py imports this module from the
# peers' virtual environment, where plait is not installed.

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@dataclass
class Tree:
    """Tree of thought: root + branch_i generates `branch_out`; then root + branch_i + its
    output + fork_ij generates `fork_out` (stage 2 depends on stage 1's outputs)."""

    root: list[int]
    branches: list[list[int]]
    forks: list[list[list[int]]]  # [branch][fork] -> suffix
    branch_out: int
    fork_out: int


@dataclass
class SuiteWorkload:
    """A workload every engine runs the same way through `run_workload`."""

    name: str
    prompts: list[list[int]]  # stage-1 prompts (for a tree: root + branch)
    max_new_tokens: int
    description: str
    json_schema: str | None = None  # canonical JSON text; outputs then stop where the JSON ends
    ignore_eos: bool = True
    tree: Tree | None = None

    @property
    def num_requests(self) -> int:
        if self.tree is not None:
            return len(self.tree.branches) + sum(len(f) for f in self.tree.forks)
        return len(self.prompts)

    def to_dict(self) -> dict:
        import dataclasses

        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> SuiteWorkload:
        d = dict(d)
        if d.get("tree") is not None:
            d["tree"] = Tree(**d["tree"])
        return cls(**d)

    def head(self, n: int, max_new_tokens: int = 2) -> SuiteWorkload:
        """A small version for warm-up."""
        import dataclasses

        tree = None
        if self.tree is not None:
            t = self.tree
            tree = Tree(t.root, t.branches[:1], [t.forks[0][:1]], max_new_tokens, max_new_tokens)
        return dataclasses.replace(self, prompts=self.prompts[:n], max_new_tokens=max_new_tokens,
                                   tree=tree)


def as_suite(w: Workload) -> SuiteWorkload:
    return SuiteWorkload(w.name, w.prompts, w.max_new_tokens, w.description)


def json_constrained(vocab: int, n: int = 32, prompt_len: int = 32, out: int = 64) -> SuiteWorkload:
    import json

    rng = random.Random(3)
    prompts = [_ids(rng, prompt_len + rng.randint(-4, 4), vocab) for _ in range(n)]
    schema = json.dumps(PERSON_SCHEMA, sort_keys=True, separators=(",", ":"))
    return SuiteWorkload(
        "json", prompts, out,
        f"{n} requests: ~{prompt_len}-token prompts, JSON schema {{name, age, tags<=3}}, <= {out} out",
        json_schema=schema, ignore_eos=False,
    )


def tree_of_thought(vocab: int, root_len: int = 500, branches: int = 4, branch_len: int = 50,
                    forks: int = 3, fork_len: int = 20, out: int = 32) -> SuiteWorkload:
    rng = random.Random(4)
    root = _ids(rng, root_len, vocab)
    branch_ids = [_ids(rng, branch_len, vocab) for _ in range(branches)]
    fork_ids = [[_ids(rng, fork_len, vocab) for _ in range(forks)] for _ in range(branches)]
    tree = Tree(root, branch_ids, fork_ids, out, out)
    return SuiteWorkload(
        "tree", [root + b for b in branch_ids], out,
        f"{root_len}-token root, {branches} branches of {branch_len} generating {out}, "
        f"each forking {forks} ways ({fork_len} tokens) generating {out}: "
        f"{branches + branches * forks} requests",
        tree=tree,
    )


def suite(vocab: int, quick: bool = False) -> dict[str, SuiteWorkload]:
    """The offline workloads of benchmarks/run.py by name (`quick`: a tiny version)."""
    if quick:
        return {
            "judge": as_suite(judge(vocab, n=8, rubric_len=300, item_len=30, out=4)),
            "decode": as_suite(decode(vocab, n=8, prompt_len=32, out=16)),
            "json": json_constrained(vocab, n=8, prompt_len=16, out=32),
            "tree": tree_of_thought(vocab, root_len=200, branches=2, branch_len=20, forks=2,
                                    fork_len=10, out=8),
        }
    return {
        "judge": as_suite(judge(vocab)),
        "decode": as_suite(decode(vocab)),
        "json": json_constrained(vocab),
        "tree": tree_of_thought(vocab),
    }


def run_workload(generate, w: SuiteWorkload) -> list[list[int]]:
    """Run `w` through `generate(prompts, max_new_tokens, json_schema, ignore_eos) -> output
    ids per prompt`; returns the output ids of every request (a tree: stage 1, then stage 2)."""
    if w.tree is None:
        return generate(w.prompts, w.max_new_tokens, w.json_schema, w.ignore_eos)
    t = w.tree
    stage1 = [t.root + b for b in t.branches]
    outs1 = generate(stage1, t.branch_out, w.json_schema, w.ignore_eos)
    stage2 = [p + o + f for p, o, fs in zip(stage1, outs1, t.forks) for f in fs]
    outs2 = generate(stage2, t.fork_out, w.json_schema, w.ignore_eos)
    return list(outs1) + list(outs2)
