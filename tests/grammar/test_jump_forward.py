"""Jump-forward on real xgrammar and the tiny tokenizer: the forced text's own tokenization must
not end at a boundary the model would not choose, and --disable-jump-forward forces nothing.

Found on SmolLM2 (benchmarks/quality.py): after `"amount": 249` the grammar forces
`, "items": [`; tokenized alone its last token is ` [`, so the model never got to pick ` ["`
(its greedy choice, and vLLM's, which has no jump-forward) and wrote a different list."""

from __future__ import annotations

import json

import pytest

from plait.args import ServerArgs
from plait.runtime.constraints import ConstraintTracker
from plait.runtime.core import Req
from plait.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["n", "tags"],
    "additionalProperties": False,
}


def tracker(tokenizer, vocab_size, eos_ids, **args) -> ConstraintTracker:
    return ConstraintTracker(
        ServerArgs.from_kwargs(model_path="unused", **args), tokenizer, vocab_size, tuple(eos_ids)
    )


def request(backends, schema, text_so_far, tokenizer) -> Req:
    req = Req("r", [1], SamplingParams(max_new_tokens=200))
    req.grammar = backends["xgrammar"].compile("json_schema", json.dumps(schema)).matcher()
    for tok in tokenizer.encode(text_so_far, add_special_tokens=False):
        assert req.grammar.accept_token(tok)
    return req


def decode(tokenizer, ids):
    return [tokenizer.decode([t]) for t in ids]


def test_forced_text_leaves_the_boundary_token_to_the_model(tokenizer, vocab_size, eos_ids, backends):
    assert tokenizer.encode(' ["', add_special_tokens=False) == [tokenizer.convert_tokens_to_ids('Ġ["')]
    t = tracker(tokenizer, vocab_size, eos_ids)
    req = request(backends, SCHEMA, '{"n": 5', tokenizer)
    forced_text = req.grammar.find_jump_forward_string()
    assert forced_text == ""  # a digit may follow
    assert req.grammar.accept_token(tokenizer.encode(",", add_special_tokens=False)[0])
    assert req.grammar.find_jump_forward_string() == ' "tags": ['
    ids = t.jump_forward(req, limit=100)
    # ` [` is held back: ` ["` (and ` []`) are allowed and start with its text
    assert "".join(decode(tokenizer, ids)) == ' "tags":'
    # the matcher is unchanged, and what was held back is still allowed next
    for tok in ids:
        assert req.grammar.accept_token(tok)
    assert req.grammar.accept_token(tokenizer.encode(' ["', add_special_tokens=False)[0])


def test_forced_text_kept_whole_where_nothing_longer_fits(tokenizer, vocab_size, eos_ids, backends):
    t = tracker(tokenizer, vocab_size, eos_ids)
    schema = {"type": "object", "properties": {"a": {"const": "xyz"}}, "required": ["a"],
              "additionalProperties": False}
    req = request(backends, schema, "", tokenizer)
    ids = t.jump_forward(req, limit=100)
    # `}` ends the value (only EOS may follow), so no token longer than `}` can be taken there
    assert tokenizer.decode(ids) == '{"a": "xyz"}'


def test_disable_jump_forward_forces_nothing(tokenizer, vocab_size, eos_ids, backends):
    t = tracker(tokenizer, vocab_size, eos_ids, disable_jump_forward=True)
    req = request(backends, SCHEMA, "", tokenizer)
    assert req.grammar.find_jump_forward_string()  # `{"n": ` is forced text
    assert t.jump_forward(req, limit=100) == []


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_whitespace_option_reaches_the_grammar(tokenizer, vocab_size, eos_ids, any_whitespace):
    from plait.grammar.manager import GrammarManager

    t = tracker(tokenizer, vocab_size, eos_ids, grammar_any_whitespace=any_whitespace)
    try:
        matcher = t.manager.submit("json_schema", json.dumps(SCHEMA)).result(timeout=60).matcher()
    finally:
        if t._manager is not None:
            t.shutdown()
    assert isinstance(t._manager, GrammarManager)
    newline = tokenizer.encode("{\n", add_special_tokens=False)
    accepted = all(matcher.accept_token(tok) for tok in newline)
    assert accepted == any_whitespace


def test_prefix_successor_bounds_exactly_the_prefixed_strings():
    from plait.runtime.constraints import _prefix_successor

    assert _prefix_successor(b'"') == b"#"
    assert _prefix_successor(b"a\xff\xff") == b"b"
    assert _prefix_successor(b"\xff\xff") is None and _prefix_successor(b"") is None
    for prefix in (b'"', b"a\xff", b"\x00"):
        succ = _prefix_successor(prefix)
        assert prefix + b"\xff" * 4 < succ and prefix < succ
        assert not succ.startswith(prefix)


def test_extension_check_matches_a_scan_of_the_whole_vocabulary(tokenizer, vocab_size, eos_ids,
                                                                   backends):
    """_extension_allowed (a bisected range of the sorted spellings, bits read in one gather)
    gives what a scan of every token does: is some allowed token longer than the tail's text and
    spelled with it as a prefix."""
    from plait.grammar.base import allocate_token_bitmask

    t = tracker(tokenizer, vocab_size, eos_ids)
    spelled, _ = t._spelling()
    seen = set()
    for so_far in ('{"n": 5,', '{"n": 5, "tags": [', '{"n": 5, "tags": ["a'):
        req = request(backends, SCHEMA, so_far, tokenizer)
        mask = allocate_token_bitmask(1, vocab_size)
        req.grammar.fill_bitmask(mask, 0)
        allowed = [i for i in range(vocab_size) if (int(mask[0, i >> 5]) >> (i & 31)) & 1]
        for x in ('"', " ", "a", ",", ' "', "[", "t"):
            tail = tokenizer.encode(x, add_special_tokens=False)[:1]
            text = spelled[tail[0]]
            expected = any(spelled[i] is not None and len(spelled[i]) > len(text)
                           and spelled[i].startswith(text) for i in allowed)
            assert t._extension_allowed(req.grammar, tail) == expected, (so_far, text)
            seen.add(expected)
    assert seen == {True, False}  # both answers were exercised


def test_spelling_index_is_built_off_the_loop_once_a_grammar_is_used(tokenizer, vocab_size,
                                                                    eos_ids):
    """The first constrained request starts the index's build in a background thread (the
    first hold-back check then finds it ready instead of building it on the scheduler loop);
    with jump-forward off too (the closing planner reads the tokens' bytes)."""
    t = tracker(tokenizer, vocab_size, eos_ids)
    off = tracker(tokenizer, vocab_size, eos_ids, disable_jump_forward=True)
    try:
        assert t._spelling_thread is None and t._spelled is None
        t.manager, off.manager  # noqa: B018 - created on first use, as the scheduler does
        assert t._spelling_thread is not None and off._spelling_thread is not None
        off._spelling_thread.join(timeout=60)
        t._spelling_thread.join(timeout=60)
        assert t._spelled is not None
        spelled, (keys, ids) = t._spelling()
        assert keys == sorted(keys) and [spelled[i] for i in ids.tolist()] == keys
    finally:
        t.shutdown()
        off.shutdown()


def test_forced_text_is_encoded_once_per_string(tokenizer, vocab_size, eos_ids, backends,
                                                monkeypatch):
    """Jump-forward and the closing planner share one memo of forced texts' tokens: the same
    ids as the tokenizer's, one encode per distinct string, and bounded."""
    import plait.runtime.constraints as constraints

    t = tracker(tokenizer, vocab_size, eos_ids)
    calls = []
    encode = tokenizer.encode

    def counted(text, **kw):
        calls.append(text)
        return encode(text, **kw)

    reqs = [request(backends, SCHEMA, '{"n": 5,', tokenizer) for _ in range(3)]
    monkeypatch.setattr(tokenizer, "encode", counted)
    for req in reqs:
        ids = t.jump_forward(req, limit=100)
        assert "".join(decode(tokenizer, ids)) == ' "tags":'
    assert calls == [' "tags": [']  # once, though three requests were forced the same text
    first = t._encode_forced(' "tags": [')
    first.append(-1)  # a caller's list is its own: the memo is not changed through it
    assert t._encode_forced(' "tags": [') == encode(' "tags": [', add_special_tokens=False)
    monkeypatch.setattr(constraints, "FORCED_ENCODINGS", 2)
    for text in ("a", "b", "c"):
        assert t._encode_forced(text) == encode(text, add_special_tokens=False)
    assert len(t._forced_ids) <= 2
