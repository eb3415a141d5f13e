"""The 200 JSONSchemaBench dev schemas: each compiles or raises GrammarError (nothing else, no
hang); accepted shares are checked against a floor so that a regression shows.

Measured shares: xgrammar 193/200, outlines 138-140/200 (its compile time limit decides a few;
the rest are refused by name: mostly `oneOf` with overlapping branches, `uniqueItems`,
and on outlines the numeric bounds and patternProperties it does not enforce).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from plait.grammar.base import GrammarError
from plait.grammar.json_schema import prepare_schema
from plait.grammar.manager import GrammarManager

DEV = Path("/work/shared/data/jsonschemabench-dev")
FILES = sorted(DEV.glob("*/*.json"))
pytestmark = [
    pytest.mark.skipif(not FILES, reason="jsonschemabench-dev not available"),
    pytest.mark.heavy,  # every schema of the dev set
]


def compile_all(manager: GrammarManager) -> dict[str, str]:
    """file -> "ok" or the GrammarError message; any other exception fails the test."""
    futures = {f.relative_to(DEV).as_posix(): manager.submit("json_schema", f.read_text())
               for f in FILES}
    outcome = {}
    for name, future in futures.items():
        try:
            future.result(timeout=120)  # the manager's own budget ends it well before
            outcome[name] = "ok"
        except GrammarError as e:
            outcome[name] = str(e)
    return outcome


def test_xgrammar_compiles_or_refuses_every_dev_schema(tokenizer, vocab_size, eos_ids):
    manager = GrammarManager("xgrammar", tokenizer, vocab_size, eos_ids, compile_timeout=20)
    try:
        outcome = compile_all(manager)
    finally:
        manager.shutdown()
    accepted = sum(v == "ok" for v in outcome.values())
    assert len(outcome) == 200 and accepted >= 193, (accepted, outcome)


def test_outlines_schema_stage_on_every_dev_schema():
    """Plait's part for outlines (normalize + outlines' regex builder) on all 200, fast; the
    Index construction (slow on large schemas) is covered by the slow test below."""
    import outlines_core

    from plait.grammar.json_schema import map_subschemas
    from plait.grammar.outlines_backend import POLICY, _for_outlines

    accepted = 0
    for path in FILES:
        try:
            core = map_subschemas(prepare_schema(path.read_text(), POLICY), _for_outlines)
        except GrammarError:
            continue
        outlines_core.json_schema.build_regex_from_schema(json.dumps(core), "")
        accepted += 1
    assert accepted >= 150, accepted


@pytest.mark.slow
def test_outlines_compiles_or_refuses_every_dev_schema(tokenizer, vocab_size, eos_ids):
    manager = GrammarManager("outlines", tokenizer, vocab_size, eos_ids, compile_timeout=10)
    try:
        outcome = compile_all(manager)
    finally:
        manager.shutdown()
    accepted = sum(v == "ok" for v in outcome.values())
    assert len(outcome) == 200 and accepted >= 137, (accepted, outcome)
