"""Matcher behaviour on both backends: masks (padded vocabulary, special tokens, EOS),
jump-forward, rollback, copy, termination."""

from __future__ import annotations

import json

import pytest
import torch

from plait.grammar.base import GrammarError, allocate_token_bitmask
from tests.grammar.conftest import BACKENDS
from tests.grammar.walker import allowed_ids

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


def compile_(backends, name, kind, spec):
    return backends[name].compile(kind, spec if isinstance(spec, str) else json.dumps(spec))


def accept_text(matcher, tokenizer, text: str) -> list[int]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    for t in ids:
        assert matcher.accept_token(t), (text, t)
    return ids


@pytest.mark.parametrize("name", BACKENDS)
def test_padded_and_special_tokens_are_never_allowed(backends, tokenizer, vocab_size, eos_ids,
                                                     name):
    matcher = compile_(backends, name, "json_schema", {"type": "string"}).matcher()
    accept_text(matcher, tokenizer, '"')
    allowed = allowed_ids(matcher, vocab_size)
    assert allowed[: len(tokenizer)].sum() > 1000  # inside a string: most text tokens
    assert not allowed[len(tokenizer) :].any()  # padded embedding rows
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert not allowed[im_start] and not allowed[eos_ids].any()
    assert not matcher.accept_token(im_start) and not matcher.accept_token(vocab_size - 1)


@pytest.mark.parametrize("name", BACKENDS)
def test_eos_allowed_exactly_when_complete(backends, tokenizer, vocab_size, eos_ids, name):
    matcher = compile_(backends, name, "regex", "ab?").matcher()
    assert not matcher.can_terminate() and not matcher.accept_token(eos_ids[0])
    accept_text(matcher, tokenizer, "a")
    assert matcher.can_terminate()
    allowed = allowed_ids(matcher, vocab_size)
    assert allowed[eos_ids].all()
    assert matcher.find_jump_forward_string() == ""  # EOS or "b": nothing is forced
    assert matcher.accept_token(eos_ids[1]) and matcher.is_terminated()
    assert not matcher.can_terminate() and not matcher.accept_token(eos_ids[0])
    assert allowed_ids(matcher, vocab_size).nonzero().flatten().tolist() == sorted(eos_ids)


@pytest.mark.parametrize("name", BACKENDS)
def test_jump_forward_after_brace_starts_with_the_required_key(backends, tokenizer, name):
    matcher = compile_(backends, name, "json_schema", PERSON).matcher()
    assert matcher.find_jump_forward_string().startswith("{")
    accept_text(matcher, tokenizer, "{")
    forced = matcher.find_jump_forward_string()
    assert forced.startswith('"name"'), forced
    assert forced.rstrip().endswith(":") or forced.endswith('"'), forced
    state_before = allowed_ids(matcher, 8256)
    ids = accept_text(matcher, tokenizer, forced)  # the forced text really is accepted
    matcher.rollback(len(ids))
    assert torch.equal(allowed_ids(matcher, 8256), state_before)


@pytest.mark.parametrize("name", BACKENDS)
def test_jump_forward_inside_a_multibyte_character(backends, tokenizer, spelled, name):
    """A byte-level token took the first byte of a 4-byte character the regex requires: the
    forced rest starts inside it (xgrammar raised UnicodeDecodeError there, a 500 for the
    request, found by the fuzz test). Forced text is whole characters (or nothing), and the
    character's remaining bytes are still the only allowed continuation."""
    matcher = compile_(backends, name, "regex", "\U0004AC77\x89").matcher()
    first = spelled.index(b"\xf1")  # the one-byte token of U+4AC77's first UTF-8 byte
    assert matcher.accept_token(first)
    forced = matcher.find_jump_forward_string()
    assert forced in ("", "\x89"), forced
    rest = "\U0004AC77\x89".encode()[1:]
    allowed = allowed_ids(matcher, len(spelled)).nonzero().flatten().tolist()
    assert allowed and all(rest.startswith(spelled[t]) for t in allowed)


@pytest.mark.parametrize("name", BACKENDS)
def test_jump_forward_in_choices_and_regex(backends, tokenizer, name):
    matcher = compile_(backends, name, "choices", ["yes please", "yes sir"]).matcher()
    assert matcher.find_jump_forward_string() == "yes "
    matcher = compile_(backends, name, "regex", r"é[a-z]\d").matcher()
    assert matcher.find_jump_forward_string() == "é"
    matcher = compile_(backends, name, "regex", r"[ab]c").matcher()
    assert matcher.find_jump_forward_string() == ""


@pytest.mark.parametrize("name", BACKENDS)
def test_rollback_restores_state(backends, tokenizer, vocab_size, eos_ids, name):
    matcher = compile_(backends, name, "json_schema", PERSON).matcher()
    masks = [allowed_ids(matcher, vocab_size)]
    ids = tokenizer.encode('{"name": "Al", "age": 4}', add_special_tokens=False)
    if name == "outlines":  # compact layout: no spaces
        ids = tokenizer.encode('{"name":"Al","age":4}', add_special_tokens=False)
    for t in ids:
        assert matcher.accept_token(t)
        masks.append(allowed_ids(matcher, vocab_size))
    assert matcher.accept_token(eos_ids[0]) and matcher.is_terminated()
    matcher.rollback(1)  # undo EOS
    assert not matcher.is_terminated() and matcher.can_terminate()
    for k in range(len(ids), 0, -1):
        assert torch.equal(allowed_ids(matcher, vocab_size), masks[k])
        matcher.rollback(1)
    assert torch.equal(allowed_ids(matcher, vocab_size), masks[0])
    with pytest.raises(ValueError):
        matcher.rollback(1)


@pytest.mark.parametrize("name", BACKENDS)
def test_accept_prefix_takes_what_accept_token_takes(backends, tokenizer, vocab_size, eos_ids,
                                                     name):
    """accept_prefix (the closing planner's call; xgrammar's goes to the C++ matcher directly)
    takes the tokens one accept_token at a time would, up to the first refused: a refused
    token, an id out of range, anything after a stop token. Its tokens roll back one by one."""
    text = '{"name": "Al", "age": 4}' if name == "xgrammar" else '{"name":"Al","age":4}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    bad = tokenizer.encode("x", add_special_tokens=False)[0]
    for tokens in ([], ids, ids[:3] + [bad] + ids[3:], ids[:2] + [vocab_size + 5],
                   ids + [eos_ids[0], ids[0]], ids + [eos_ids[0]]):
        one = compile_(backends, name, "json_schema", PERSON).matcher()
        expected = 0
        for tok in tokens:
            if not one.accept_token(tok):
                break
            expected += 1
        many = compile_(backends, name, "json_schema", PERSON).matcher()
        assert many.accept_prefix(tokens) == expected, tokens
        assert (many.is_terminated(), many.can_terminate()) == (one.is_terminated(),
                                                                one.can_terminate())
        assert torch.equal(allowed_ids(many, vocab_size), allowed_ids(one, vocab_size))
        many.rollback(expected)
        with pytest.raises(ValueError):
            many.rollback(1)
    terminated = compile_(backends, name, "json_schema", PERSON).matcher()
    assert terminated.accept_prefix(ids + [eos_ids[0]]) == len(ids) + 1
    assert terminated.accept_prefix(ids[:1]) == 0


@pytest.mark.parametrize("name", BACKENDS)
def test_rejected_token_leaves_state_unchanged(backends, tokenizer, vocab_size, name):
    matcher = compile_(backends, name, "regex", "[0-9]+").matcher()
    accept_text(matcher, tokenizer, "1")
    before = allowed_ids(matcher, vocab_size)
    assert not matcher.accept_token(tokenizer.encode("x", add_special_tokens=False)[0])
    assert torch.equal(allowed_ids(matcher, vocab_size), before)
    matcher.rollback(1)  # only the one accepted token is on the history


@pytest.mark.parametrize("name", BACKENDS)
def test_copy_is_independent(backends, tokenizer, vocab_size, eos_ids, name):
    matcher = compile_(backends, name, "regex", "(ab|cd)+").matcher()
    accept_text(matcher, tokenizer, "ab")
    twin = matcher.copy()
    assert torch.equal(allowed_ids(twin, vocab_size), allowed_ids(matcher, vocab_size))
    accept_text(twin, tokenizer, "cd")
    assert twin.accept_token(eos_ids[0]) and twin.is_terminated()
    assert not matcher.is_terminated() and matcher.can_terminate()
    matcher.rollback(1)  # the original's history is its own
    assert not matcher.can_terminate()
    twin.rollback(2)
    assert twin.can_terminate()


@pytest.mark.parametrize("name", BACKENDS)
def test_bitmask_row_of_another_width(backends, tokenizer, vocab_size, name):
    matcher = compile_(backends, name, "regex", "[0-9]+").matcher()
    narrow = allocate_token_bitmask(1, vocab_size)
    matcher.fill_bitmask(narrow, 0)
    wide = allocate_token_bitmask(3, vocab_size + 320)  # e.g. logits wider than the vocab
    matcher.fill_bitmask(wide, 2)
    words = narrow.shape[1]
    assert torch.equal(wide[2, :words], narrow[0])
    assert not wide[2, words:].any()
    assert (wide[:2] == -1).all()  # other rows untouched


def test_invalid_specs_are_grammar_errors(backends):
    cases = [
        ("regex", "(unclosed", "regex"),
        ("regex", r"(?<=a)b", "regex"),
        ("json_schema", "{not json", "json_schema"),
        ("json_schema", '{"type": "strin"}', "json_schema"),
        ("json_schema", '{"minLength": "x"}', "json_schema"),
        ("json_schema", "[1, 2]", "json_schema"),
        ("choices", '["a", 3]', "choices"),
        ("choices", "[]", "choices"),
    ]
    for backend in backends.values():
        for kind, spec, param in cases:
            with pytest.raises(GrammarError) as info:
                backend.compile(kind, spec)
            assert info.value.param == param, (backend.name, kind, spec, info.value)


def test_ebnf_errors(backends):
    with pytest.raises(GrammarError, match="ebnf") as info:
        backends["xgrammar"].compile("ebnf", 'root ::= "a" missing_rule')
    assert info.value.param == "ebnf"
    with pytest.raises(GrammarError, match="ebnf: .*does not support EBNF") as info:
        backends["outlines"].compile("ebnf", 'root ::= "a"')
    assert info.value.param == "ebnf"
    grammar = backends["xgrammar"].compile("ebnf", 'root ::= "x" [0-9]')
    assert grammar.matcher().find_jump_forward_string() == "x"
