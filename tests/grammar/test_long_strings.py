"""Schemas with long `maxLength` strings (a signup form: nine fields of 1024-2048 characters)
must cost about what an unconstrained token costs. The mechanisms, not timings: xgrammar gets
the long bound as a `max_chars` rule (its counted repetition had no cached token mask), the
bound is still enforced, and the budget-closing planner's work per call is bounded whatever
the maxLength."""

from __future__ import annotations

import json

import pytest

from plait.grammar.xgrammar_patterns import CHAIN_LIMIT, LONG_REPEAT, bound_long_repeats
from plait.runtime import constraints
from plait.runtime.constraints import ConstraintTracker

SIGNUP_FIELDS = [("first_name", 1024), ("last_name", 1024), ("email", 2048), ("password", 2048),
                 ("address", 2048), ("city", 1024), ("country", 1024), ("bio", 2048),
                 ("website", 2048)]


def signup_schema(max_length: int | None = None) -> dict:
    return {
        "type": "object",
        "properties": {k: {"type": "string", "maxLength": max_length or n}
                       for k, n in SIGNUP_FIELDS},
        "required": [k for k, _ in SIGNUP_FIELDS],
        "additionalProperties": False,
    }


def one_field(max_length: int, min_length: int = 0) -> str:
    return json.dumps({"type": "object", "required": ["a"], "additionalProperties": False,
                       "properties": {"a": {"type": "string", "maxLength": max_length,
                                            "minLength": min_length}}})


def accepts(backend, spec: str, text: str, tokenizer) -> bool:
    m = backend.compile("json_schema", spec).matcher()
    return all(m.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
        m.can_terminate())


def test_length_bounds_leave_no_counted_repetition_of_the_character_alternation():
    """xgrammar caches no token mask for `c{lo, hi}` with c a class-or-escape alternation (a
    20-40 ms fill on a 100k vocabulary, 0.4-0.8 s at a minimum of 5000): every bound becomes a
    repetition of the class alone and/or a max_chars rule, long minimums too."""
    import re

    import xgrammar as xgr

    from plait.grammar.regex_syntax import json_string_regex

    def rewritten(lo, hi):
        out = bound_long_repeats(str(xgr.Grammar.from_regex(json_string_regex(None, lo, hi))))
        xgr.Grammar.from_ebnf(out)  # parses
        return out

    counted_char = re.compile(r"\broot_1\{")
    long = rewritten(3, 2048)
    assert "[max_chars=2048]" in long and "]{3, -1}" in long and not counted_char.search(long)
    short = rewritten(0, LONG_REPEAT)
    assert f"[max_chars={LONG_REPEAT}] ::= ((root_1*))" in short and not counted_char.search(short)
    minimum = rewritten(9, None)
    assert "]{9, -1}" in minimum and "max_chars" not in minimum
    assert not counted_char.search(minimum)
    one = rewritten(1, 20)  # exact: the first character may be an escape
    assert "[max_chars=20]" in one and "| (root_1_len0_tail))" in one
    assert not counted_char.search(one)
    # a minimum past LONG_REPEAT: its first characters the class repeated, the bound max_chars
    far = rewritten(LONG_REPEAT + 8, 2048)
    assert f"]{{{LONG_REPEAT + 8}, -1}}" in far and "[max_chars=2048]" in far
    assert not counted_char.search(far)
    # past XGR_REPEAT the plain characters are nested counts (5000 = 39 x 128 + 8); was
    # `c{5000, -1}`: 0.4-0.8 s a mask fill
    huge = rewritten(5000, None)
    assert "_blk1 ::= (([" in huge and "]{128, 128}))" in huge and "_blk1{39, 39} [" in huge
    assert "]{8, 8} [" in huge and "max_chars" not in huge and not counted_char.search(huge)
    # a repeated multi-character group is not one character per repeat: left as it is
    group = bound_long_repeats(str(xgr.Grammar.from_regex("(?:ab){0,500}")))
    assert "max_chars" not in group


def test_fast_length_forms_accept_and_refuse_as_documented(backends, tokenizer):
    xg = backends["xgrammar"]
    one = one_field(20, min_length=1)
    assert accepts(xg, one, '{"a": "\\nab"}', tokenizer)  # minLength 1: exact
    assert accepts(xg, one, '{"a": "x"}', tokenizer)
    assert not accepts(xg, one, '{"a": ""}', tokenizer)
    assert not accepts(xg, one, '{"a": "' + "x" * 21 + '"}', tokenizer)
    two = one_field(20, min_length=2)
    assert accepts(xg, two, '{"a": "xy\\n"}', tokenizer)
    assert not accepts(xg, two, '{"a": "x"}', tokenizer)
    # a whole string's chain counts an escape as one character, among the first ones too
    assert accepts(xg, two, '{"a": "\\nx"}', tokenizer)
    assert not accepts(xg, two, '{"a": "\\n"}', tokenizer)
    nomax = json.dumps({"type": "object", "required": ["a"], "additionalProperties": False,
                        "properties": {"a": {"type": "string", "minLength": 9}}})
    assert accepts(xg, nomax, '{"a": "' + "x" * 9 + '"}', tokenizer)
    assert accepts(xg, nomax, '{"a": "' + "x" * 40 + '\\"q"}', tokenizer)
    assert not accepts(xg, nomax, '{"a": "' + "x" * 8 + '"}', tokenizer)
    short = one_field(5)
    assert accepts(xg, short, '{"a": "abcde"}', tokenizer)
    assert not accepts(xg, short, '{"a": "abcdef"}', tokenizer)
    assert accepts(xg, short, '{"a": "' + "\\n" * 5 + '"}', tokenizer)  # exact up to CHAIN_LIMIT
    assert not accepts(xg, short, '{"a": "' + "\\n" * 6 + '"}', tokenizer)


def test_a_long_minimum_is_enforced_exactly_for_plain_characters(backends, tokenizer):
    """minLength past the chains (CHAIN_LIMIT): the first minLength characters are the class
    repeated (no escape among them; mask fills from xgrammar's cache), then any characters."""
    xg = backends["xgrammar"]
    lo = CHAIN_LIMIT + 36
    spec = json.dumps({"type": "object", "required": ["a"], "additionalProperties": False,
                       "properties": {"a": {"type": "string", "minLength": lo}}})
    assert accepts(xg, spec, '{"a": "' + "x" * lo + '"}', tokenizer)
    assert not accepts(xg, spec, '{"a": "' + "x" * (lo - 1) + '"}', tokenizer)
    assert accepts(xg, spec, '{"a": "' + "x" * lo + '\\n\\"q"}', tokenizer)  # escapes after
    assert not accepts(xg, spec, '{"a": "\\n' + "x" * lo + '"}', tokenizer)  # not among them
    bounded = one_field(lo + 100, min_length=lo)
    assert accepts(xg, bounded, '{"a": "' + "x" * (lo + 100) + '"}', tokenizer)
    assert not accepts(xg, bounded, '{"a": "' + "x" * (lo + 101) + '"}', tokenizer)
    assert not accepts(xg, bounded, '{"a": "' + "x" * (lo - 1) + '"}', tokenizer)


@pytest.mark.parametrize("min_length, max_length", [(129, None), (300, None), (300, 700),
                                                    (20000, None)])
def test_long_minimums_mask_only_tokens_the_matcher_takes(backends, walker, min_length,
                                                          max_length):
    """Past XGR_REPEAT xgrammar's masks for `[...]{lo, -1}` inside a string let through tokens
    its matcher refuses (a raw newline), so longer minimums are nested counted repetitions of
    at most XGR_REPEAT: random walks (every allowed token must be taken) stay in step."""
    spec = one_field(max_length, min_length) if max_length else json.dumps(
        {"type": "object", "required": ["a"], "additionalProperties": False,
         "properties": {"a": {"type": "string", "minLength": min_length}}})
    grammar = backends["xgrammar"].compile("json_schema", spec)
    for seed in range(6):
        walk = walker.walk(grammar.matcher(), seed=seed, max_steps=40)
        assert not walk.stuck


@pytest.mark.parametrize("max_length", [40, 300])
def test_long_bound_is_enforced(backends, tokenizer, max_length):
    xg = backends["xgrammar"]
    spec = one_field(max_length, min_length=2)
    body = "ab" * (max_length // 2)
    assert accepts(xg, spec, '{"a": "' + body + '"}', tokenizer)
    assert not accepts(xg, spec, '{"a": "' + body + 'c"}', tokenizer)
    assert not accepts(xg, spec, '{"a": "a"}', tokenizer)  # minLength still counted exactly
    # past CHAIN_LIMIT escapes count their raw width toward the bound (sound: never longer
    # than maxLength); up to it, one character each
    assert accepts(xg, spec, '{"a": "xy' + "x\\n" * 4 + '"}', tokenizer)
    escapes = '{"a": "' + "x\\n" * (max_length // 2) + '"}'
    assert accepts(xg, spec, escapes, tokenizer) == (max_length <= CHAIN_LIMIT)


def test_signup_schema_compiles_to_max_chars_rules(backends):
    grammar = str(backends["xgrammar"].compile("json_schema",
                                               json.dumps(signup_schema())).compiled.grammar)
    # fields with equal bounds share their rules: one max_chars rule per distinct maxLength
    assert grammar.count("max_chars=") == len({n for _, n in SIGNUP_FIELDS})


def test_whole_strings_become_chains_with_a_lookahead_for_the_closing_quote(backends, tokenizer):
    """The mechanism behind a cached mask in every position of a bounded string: right-recursive
    rules closed by a lookahead (no counted repetition, no `c*` after an escape); a pattern with
    more than its repeated character keeps the forms of bound_long_repeats."""
    import re

    from plait.grammar.xgrammar_patterns import splice_patterns

    def grammar(prop: dict) -> str:
        spec = json.dumps({"type": "object", "required": ["a"], "additionalProperties": False,
                           "properties": {"a": prop}})
        return str(backends["xgrammar"].compile("json_schema", spec).compiled.grammar)

    counted = re.compile(r"\{\d+, (-1|\d+)\}")
    for prop in ({"type": "string", "minLength": 1}, {"type": "string", "maxLength": 64},
                 {"type": "string", "minLength": 3, "maxLength": 4096},
                 {"type": "string", "pattern": "^[a-z]{2,30}$"}):
        text = grammar(prop)
        assert "plait_len_0" in text and '(=("\\""))' in text, prop
        assert not counted.search(text), (prop, text)
    assert grammar({"type": "string", "maxLength": 4096}).count("max_chars=4096") == 1
    assert "max_chars" not in grammar({"type": "string", "maxLength": CHAIN_LIMIT})
    mixed = grammar({"type": "string", "pattern": "^ab[a-z]{1,8}$"})
    assert "plait_len" not in mixed
    # a pattern rule used anywhere but before a closing quote is not a whole string
    body = 'r ::= (("\\"" h "\\""))\nq ::= ((h "x"))\nh ::= Regex("PLAITPAT0X", json_string=true)\n'
    assert "plait_len" not in splice_patterns(body, ["[ab]{1,5}"])
    ok = 'r ::= (("\\"" h "\\""))\nh ::= Regex("PLAITPAT0X", json_string=true)\n'
    assert "plait_len_0" in splice_patterns(ok, ["[ab]{1,5}"])
    pattern = json.dumps({"type": "object", "required": ["a"], "additionalProperties": False,
                          "properties": {"a": {"type": "string", "pattern": "^[a-z]{2,30}$"}}})
    assert accepts(backends["xgrammar"], pattern, '{"a": "ab"}', tokenizer)
    assert not accepts(backends["xgrammar"], pattern, '{"a": "a"}', tokenizer)
    assert not accepts(backends["xgrammar"], pattern, '{"a": "aB"}', tokenizer)
    assert not accepts(backends["xgrammar"], pattern, '{"a": "' + "a" * 31 + '"}', tokenizer)


class CountingMatcher:
    """Forwards to a matcher and counts every call (the planner's unit of work)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def counted(*a, **k):
            self.calls += 1
            return fn(*a, **k)

        return counted


@pytest.mark.parametrize("inside", ['{"first_name": "Ann', '{"first_name": "Ann", "last_name": '])
def test_closing_planner_work_is_bounded_whatever_the_max_length(backends, tokenizer, eos_ids,
                                                                 inside):
    tracker = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
    calls, plans = {}, {}
    for max_length in (16, 2048):
        m = backends["xgrammar"].compile("json_schema",
                                         json.dumps(signup_schema(max_length))).matcher()
        for t in tokenizer.encode(inside, add_special_tokens=False):
            assert m.accept_token(t)
        counting = CountingMatcher(m)
        plans[max_length] = tracker._plan_closing(counting, 200)
        calls[max_length] = counting.calls
    # the node budget is fixed: a unit is one node taken (a few matcher calls) or as many
    # tries the matcher refuses as make one unit at CLOSE_REFUSED_COST each (a call each)
    bound = max(6, round(1 / constraints.CLOSE_REFUSED_COST)) * constraints.CLOSE_SEARCH_NODES
    assert all(0 < c <= bound for c in calls.values()), calls
    assert plans[16] is not None and plans[2048] is not None
    assert len(plans[2048]) == len(plans[16])  # the same short closing, not a walk to the bound


def test_utf8_missing_bytes():
    assert constraints.utf8_missing_bytes(b'"ab') == 0
    assert constraints.utf8_missing_bytes("é".encode()) == 0
    assert constraints.utf8_missing_bytes(b"a\xc3") == 1  # the first of 2 bytes
    assert constraints.utf8_missing_bytes(b"\xe2\x82") == 1  # 2 of 3 (the euro sign)
    assert constraints.utf8_missing_bytes(b"\xf0") == 3
    assert constraints.utf8_missing_bytes(b"\x80\x80") == 0  # no first byte: not ours to end
    assert constraints.utf8_missing_bytes(b"") == 0


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
@pytest.mark.parametrize("open_bytes", [b"\xc3", b"\xe2\x82"])
def test_closing_completes_a_character_left_open(backends, tokenizer, eos_ids, spelled, backend,
                                                 open_bytes):
    """An output that stops inside a UTF-8 character near the budget (a byte-level token of its
    first bytes) still gets a closing: the missing continuation bytes, then the closers. The
    search alone found none there (no quote or closer is allowed mid-character), and the string
    ran to max_new_tokens unclosed."""
    from plait.runtime.core import Req
    from plait.sampling import SamplingParams

    schema = '{"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}'
    m = backends[backend].compile("json_schema", schema).matcher()
    for prefix in ('{"s": "ab', '{"s":"ab'):  # (the backends' JSON whitespace differs)
        ids = tokenizer.encode(prefix, add_special_tokens=False)
        ids += [spelled.index(bytes([b])) for b in open_bytes]
        accepted = 0
        while accepted < len(ids) and m.accept_token(ids[accepted]):
            accepted += 1
        m.rollback(accepted)
        if accepted == len(ids):
            break
    assert accepted == len(ids)
    for t in ids:
        assert m.accept_token(t)
    # 5 tokens left: a closing (a byte, '"}', EOS) is planned
    req = Req("r", [1], SamplingParams(max_new_tokens=len(ids) + 5), output_ids=list(ids))
    req.grammar = m
    tracker = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
    tracker.plan_closing(req)
    plan = tracker.current_plan(req)
    assert plan and len(plan) + 1 <= 5
    text = b"".join(spelled[t] for t in ids + plan).decode("utf-8")  # whole characters
    assert json.loads(text)["s"].startswith("ab")
    for t in plan:  # the matcher was left where it was: the plan is accepted from there
        assert m.accept_token(t)
    assert m.can_terminate()


def test_bounded_strings_share_one_ladder_of_rules(backends, tokenizer):
    """Each chain rule costs compile time (~5-10 ms on a 100k vocabulary): twenty strings of
    distinct maximums near CHAIN_LIMIT share one ladder (at most CHAIN_LIMIT + 1 `r` rules,
    not one chain each: 10.7 s of compile before), and each keeps its own bounds."""
    import re

    from plait.grammar.xgrammar_patterns import extract_patterns, splice_patterns
    from plait.grammar.json_schema import prepare_schema
    from plait.grammar.xgrammar_backend import POLICY

    import xgrammar as xgr

    props = {f"f{i}": {"type": "string", "minLength": i % 3, "maxLength": CHAIN_LIMIT - i}
             for i in range(20)}
    schema = {"type": "object", "properties": props, "required": list(props),
              "additionalProperties": False}
    core, patterns = extract_patterns(prepare_schema(json.dumps(schema), POLICY))
    ebnf = splice_patterns(str(xgr.Grammar.from_json_schema(json.dumps(core), strict_mode=True)),
                           patterns)
    ladder = set(re.findall(r"^(plait_len_0_r\d+) ::=", ebnf, re.MULTILINE))
    assert len(ladder) == CHAIN_LIMIT + 1
    # the minimums' characters: at most minLength rules a string (most are 0-2)
    mandatory = re.findall(r"^plait_len_\d+_m\d+_\S+ ::=", ebnf, re.MULTILINE)
    assert len(mandatory) <= sum(p["minLength"] for p in props.values())
    two = json.dumps({"type": "object", "required": ["a", "b"], "additionalProperties": False,
                      "properties": {"a": {"type": "string", "maxLength": 5},
                                     "b": {"type": "string", "minLength": 2, "maxLength": 3}}})
    xg = backends["xgrammar"]
    assert accepts(xg, two, '{"a": "abcde", "b": "xyz"}', tokenizer)
    assert not accepts(xg, two, '{"a": "abcde", "b": "xyzw"}', tokenizer)
    assert not accepts(xg, two, '{"a": "abcdef", "b": "xy"}', tokenizer)
    assert not accepts(xg, two, '{"a": "", "b": "x"}', tokenizer)
    assert accepts(xg, two, '{"a": "", "b": "x\\n"}', tokenizer)


def _req_at(backends, tokenizer, spec: str, prefix: str, budget: int):
    """A Req under JSON schema `spec` whose output so far is `prefix` (its matcher there)."""
    from plait.runtime.core import Req
    from plait.sampling import SamplingParams

    m = backends["xgrammar"].compile("json_schema", spec).matcher()
    ids = tokenizer.encode(prefix, add_special_tokens=False)
    assert m.accept_prefix(ids) == len(ids)
    req = Req("r", [1], SamplingParams(max_new_tokens=budget, json_schema=spec),
              output_ids=list(ids))
    req.grammar = m
    return req


def test_a_closing_plan_is_searched_once_per_constraint_and_output(backends, tokenizer, eos_ids):
    """Requests under one schema start from the same states (the first token, forced keys):
    a plan searched from one request's output is reused for another request at the same output
    (its matcher untouched), and only there: another output, another schema or a flush
    searches again. Each plan is the one a fresh tracker finds."""
    spec = json.dumps(signup_schema(64))
    other = json.dumps(signup_schema(16))
    tracker = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
    first = _req_at(backends, tokenizer, spec, '{"first_name": "Ann', 200)
    plan = tracker._plan_after(first, 150, True)
    assert plan
    for prefix, schema, searched in [('{"first_name": "Ann', spec, False),
                                     ('{"first_name": "Bo', spec, True),
                                     ('{"first_name": "Ann', other, True)]:
        req = _req_at(backends, tokenizer, schema, prefix, 200)
        counting = CountingMatcher(req.grammar)
        req.grammar = counting
        got = tracker._plan_after(req, 150, True)
        assert (counting.calls > 0) == searched, (prefix, schema == spec)
        req.grammar = counting.inner
        fresh = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
        assert got == fresh._plan_after(req, 150, True)
    tracker.flush()
    req = _req_at(backends, tokenizer, spec, '{"first_name": "Ann', 200)
    req.grammar = counting = CountingMatcher(req.grammar)
    assert tracker._plan_after(req, 150, True) == plan and counting.calls > 0


def test_a_search_for_a_shorter_closing_than_one_that_still_ends_the_output_is_bounded(
        backends, tokenizer, eos_ids):
    """A digit of an integer leaves the closing as it was; where that closing no longer fits
    after it, admit() looks for a shorter one with CLOSE_SHORTER_NODES, not the full search
    budget (a failing search spent all of it: 2 ms a request on plait-tiny's JSON workload),
    then puts the closing in the digit's place."""
    spec = json.dumps({"type": "object", "properties": {
        "age": {"type": "integer"}, "name": {"type": "string"}, "city": {"type": "string"}},
        "required": ["age", "name", "city"], "additionalProperties": False})
    req = _req_at(backends, tokenizer, spec, '{"age": 12', 64)
    tracker = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
    closing = tracker._plan_after(req, 60, True)
    assert closing and len(closing) > 3
    # as many tokens left as the closing and EOS take: one more digit leaves no room
    n = len(req.output_ids)
    req.sampling.max_new_tokens = n + len(closing) + 1
    req.closing_plan = constraints.ClosingPlan(len(closing) + 1, tuple(closing), n)
    assert tracker.current_plan(req) == closing
    digit = tokenizer.encode("3", add_special_tokens=False)[0]
    req.grammar = counting = CountingMatcher(req.grammar)
    out = tracker.admit(req, digit)
    assert out == closing + [out[-1]] and out[-1] in eos_ids
    bound = max(6, round(1 / constraints.CLOSE_REFUSED_COST)) * constraints.CLOSE_SHORTER_NODES
    assert counting.calls <= bound + 50, counting.calls  # (+ admit's own checks)


def test_searches_for_a_closing_the_budget_cannot_hold_back_off(backends, tokenizer, eos_ids):
    """A string of minLength 5000 under a 48-token budget can never close: each search finds
    nothing. After a search that found nothing the next waits CLOSE_RECHECK_EVERY tokens, and
    each later one twice as long as the one before; a failed plan does not count as tight (it
    was searched again at each of the budget's last 4 tokens: 10 searches in 48 tokens, 14.7x an
    unconstrained token on plait-tiny)."""
    spec = json.dumps({"type": "object", "properties": {"text": {"type": "string",
                                                                  "minLength": 5000}},
                       "required": ["text"], "additionalProperties": False})
    req = _req_at(backends, tokenizer, spec, '{"text": "', 48 + 4)
    tracker = ConstraintTracker(None, tokenizer, 8256, tuple(eos_ids))
    searched = []
    search = tracker._search_after

    def counted(r, max_len, *a, **k):
        searched.append(r.remaining_new_tokens)
        return search(r, max_len, *a, **k)

    tracker._search_after = counted
    word = tokenizer.encode("ab", add_special_tokens=False)
    while req.remaining_new_tokens > 0:
        tracker.plan_closing(req)
        for t in word[:1]:
            assert req.grammar.accept_token(t)
            req.output_ids.append(t)
    assert req.closing_plan.length == -1 and req.closing_plan.failures == len(searched)
    gaps = [a - b for a, b in zip(searched, searched[1:])]
    assert len(searched) <= 4 and gaps == [constraints.CLOSE_RECHECK_EVERY << i
                                           for i in range(len(gaps))], searched
