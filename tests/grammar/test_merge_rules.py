"""Rules that match the same texts are merged before xgrammar compiles a schema's grammar
(plait/grammar/xgrammar_patterns.py, merge_equal_rules): fewer rules to build token masks for,
the same language. The dev-schema cases compare the token masks of the merged and the unmerged
grammar at every step of random walks."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import xgrammar as xgr

from plait.grammar.json_schema import prepare_schema
from plait.grammar.xgrammar_backend import POLICY, XGrammarCompiled
from plait.grammar.xgrammar_patterns import extract_patterns, merge_equal_rules, splice_patterns
from tests.grammar.walker import allowed_ids

DEV = Path("/work/shared/data/jsonschemabench-dev")


def rules(ebnf: str) -> dict[str, str]:
    """name (attributes left out) -> body"""
    return {head.split("[")[0]: body for head, body in
            (line.split(" ::= ", 1) for line in ebnf.splitlines() if " ::= " in line)}


def test_equal_rules_merge_recursive_ones_included():
    ebnf = "\n".join([
        'root ::= ((a "," b "," c))',
        'a ::= (("x" a) | ("y"))',
        'b ::= (("x" b) | ("y"))',  # a's body with b for a: the same texts
        'c ::= (("x" d) | ("y"))',  # calls d, which calls c: the same texts again
        'd ::= (("x" c) | ("y"))',
    ])
    merged = rules(merge_equal_rules(ebnf))
    assert merged == {"root": '((a "," a "," a))', "a": '(("x" a) | ("y"))'}


def test_rules_that_differ_stay_apart():
    ebnf = "\n".join([
        'root ::= ((s "," t "," u "," v "," w))',
        's ::= (("a" s) | ("b"))',
        't[max_chars=8] ::= (("a" t) | ("b"))',  # same body, an attribute: not the same texts
        'u ::= (("a" u) | ("c"))',
        'v ::= (("a" s) | ("b" s))',  # calls s, as s does, but its body differs
        'w ::= (("s" w) | ("b"))',  # a literal spelled as a rule's name is not a call
    ])
    merged = merge_equal_rules(ebnf)
    assert set(rules(merged)) == {"root", "s", "t", "u", "v", "w"}
    assert rules(merged)["w"] == '(("s" w) | ("b"))'
    assert "t[max_chars=8] ::= " in merged


def test_the_root_keeps_its_name_and_text_not_printed_by_xgrammar_is_left_alone():
    ebnf = 'root ::= (("x" r2) | ("y"))\nr2 ::= (("x" r2) | ("y"))\n'
    assert rules(merge_equal_rules(ebnf)) == {"root": '(("x" r2) | ("y"))',
                                               "r2": '(("x" r2) | ("y"))'}
    folded = 'root ::= a\n  | b\na ::= "x"\nb ::= "x"\n'  # a rule over two lines
    assert merge_equal_rules(folded) == folded


def _grammars(schema: str) -> tuple[str, str]:
    core, patterns = extract_patterns(prepare_schema(schema, POLICY))
    printed = str(xgr.Grammar.from_json_schema(json.dumps(core), any_whitespace=False,
                                               strict_mode=True))
    unmerged = splice_patterns(printed, patterns)
    return unmerged, merge_equal_rules(unmerged)


@pytest.mark.skipif(not DEV.exists(), reason="jsonschemabench-dev not available")
@pytest.mark.parametrize("name", [
    "Github_hard/o68354.json",  # 26 patterns: whole-string rule ladders spliced in
    "Snowplow/sp_106_Normalized.json",  # max_chars rules
    "JsonSchemaStore/codecov.json",  # $defs used in many places
])
def test_merged_schema_grammars_allow_the_same_tokens_at_every_step(
        backends, walker, vocab_size, eos_ids, name):
    unmerged, merged = _grammars((DEV / name).read_text())
    assert merged.count(" ::= ") < unmerged.count(" ::= ") * 0.8
    compiler = backends["xgrammar"]._compiler
    pair = [XGrammarCompiled(compiler.compile_grammar(g), vocab_size, eos_ids)
            for g in (unmerged, merged)]
    steps = 0
    for seed in range(24):
        rng = random.Random(seed)
        matchers = [g.matcher() for g in pair]
        for _ in range(120):
            allowed = [allowed_ids(m, vocab_size) for m in matchers]
            assert bool((allowed[0] == allowed[1]).all()), (name, seed, steps)
            groups = [g for g in (allowed[1] & walker.eos, allowed[1] & walker.punct,
                                  allowed[1]) if g.any()]
            token = rng.choice(rng.choice(groups).nonzero().flatten().tolist())
            assert all(m.accept_token(token) for m in matchers)
            steps += 1
            if matchers[1].is_terminated():
                assert matchers[0].is_terminated()
                break
    assert steps >= 200, steps
