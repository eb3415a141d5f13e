"""Grammar backend on outlines-core: everything becomes one regex, then a token-level DFA.

JSON schemas go through plait's normalizer, then outlines_core's build_regex_from_schema;
regex and choices through plait's portable regex printer. EBNF is not regular: refused.
outlines-core's Index gives token transitions per DFA state; the matcher walks them itself
(state history for rollback/copy) and caches one bitmask row and one jump-forward string per
state, shared by every matcher of the grammar. Index construction releases the GIL.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import outlines_core
import torch

from plait.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
)
from plait.grammar.bitmask import allow_only, copy_row, words_for
from plait.grammar.formats import FORMAT_PATTERNS
from plait.grammar.json_schema import (
    ANNOTATION_KEYWORDS,
    CORE_KEYWORDS,
    TRANSLATION,
    SchemaPolicy,
    map_subschemas,
    prepare_schema,
)
from plait.grammar.kinds import choices_of
from plait.grammar.regex_syntax import choices_regex, normalize_regex
from plait.grammar.vocab import token_bytes

# Measured: outlines-core ignores minimum/maximum/exclusive*/multipleOf, min/maxProperties,
# patternProperties and propertyNames (outputs violated each), so only the core is allowed.
POLICY = SchemaPolicy(backend="outlines", supported=CORE_KEYWORDS)
# longest regular expression handed to outlines_core.Index (see compile)
MAX_REGEX_CHARS = 200_000
_JUMP_LIMIT = 256  # bytes of forced text computed per state

# json_object: outlines' own regex for {"type": "object"} nests three levels and takes ~10 s
# to index on an 8k vocabulary (minutes on 100k), so objects nest two levels here (a subset).
_STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
_SCALAR = rf"(?:{_STRING}|{_NUMBER}|true|false|null)"


def _members(value: str, ws: str) -> str:
    member = rf"{_STRING}{ws}:{ws}{value}"
    return rf"\{{{ws}(?:{member}(?:{ws},{ws}{member})*)?{ws}\}}"


def _json_object_regex(ws: str) -> str:
    flat_array = rf"\[{ws}(?:{_SCALAR}(?:{ws},{ws}{_SCALAR})*)?{ws}\]"
    inner = rf"(?:{_SCALAR}|{flat_array}|{_members(_SCALAR, ws)})"
    return _members(inner, ws)


# outlines-core splices its regex for {} (any value) into objects without parentheses, so a
# property with schema {} breaks the object's regex; and its any-value nests three levels deep
# (slow to index). Both are replaced by this explicit, shallower choice (a subset).
_SCALARS = [{"type": t} for t in ("string", "number", "boolean", "null")]
_ANY_VALUE = {
    "anyOf": _SCALARS
    + [
        {"type": "array", "items": {"anyOf": _SCALARS}},
        {"type": "object", "properties": {}, "additionalProperties": {"anyOf": _SCALARS}},
    ]
}


def _for_outlines(node: dict) -> dict:
    """Adapt one core subschema to outlines-core's regex builder (see _ANY_VALUE)."""
    _check_keys(list(node.get("properties", {})))
    for value in [node["const"]] if "const" in node else node.get("enum", []):
        _check_keys(_object_keys(value))
    if node == {}:
        return _ANY_VALUE
    if node.get("type") == "array" and "items" not in node and "prefixItems" not in node:
        return {**node, "items": _ANY_VALUE}
    return node


def _check_keys(keys: list[str]) -> None:
    """outlines-core writes object keys into its regex without JSON-escaping them (measured:
    the key q"uote comes out as "q"uote"): refuse the keys that need escaping."""
    for key in keys:
        if any(c in key for c in '"\\') or any(ord(c) < 0x20 for c in key):
            raise GrammarError(
                f"json_schema: the object key {key!r} needs JSON escaping, which the outlines "
                "backend does not do; use the xgrammar backend",
                "json_schema",
            )


def _object_keys(value) -> list[str]:
    if isinstance(value, dict):
        return list(value) + [k for v in value.values() for k in _object_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in _object_keys(v)]
    return []


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], **options) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids, **options)
        # compact: no whitespace at all, so the layout is deterministic and jump-forward can
        # force keys and punctuation (outlines' default "[ ]?" leaves every gap open)
        self.whitespace = rf"[ \t\n\r]{{0,{self.max_whitespace}}}" if self.any_whitespace else ""
        self.token_info = _TokenInfo(token_bytes(tokenizer), vocab_size)
        self.vocabulary = self.token_info.vocabulary(self.eos_token_ids[0])

    # ------------------------------------------------------------------ compile
    def compile(self, kind: str, spec: str) -> OutlinesCompiled:
        regex = self.regex_for(kind, spec)
        if len(regex) > MAX_REGEX_CHARS:
            # measured: a 460 MB regex from one dev schema (eslintrc); its automaton would not
            # fit in memory, and building it cannot be interrupted on a thread
            raise GrammarError(
                f"{kind}: the constraint expands to a {len(regex):,}-character regular "
                f"expression, over the outlines backend's limit of {MAX_REGEX_CHARS:,}; use the "
                "xgrammar backend", kind,
            )
        try:
            index = outlines_core.Index(regex, self.vocabulary)
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"{kind}: {str(e).splitlines()[0]}", kind) from None
        return OutlinesCompiled(index, self.token_info, self.eos_token_ids)

    def regex_for(self, kind: str, spec: str) -> str:
        if kind == "json_schema":
            core = map_subschemas(prepare_schema(spec, POLICY), _for_outlines)
            try:
                return outlines_core.json_schema.build_regex_from_schema(
                    json.dumps(core), self.whitespace
                )
            except (ValueError, RuntimeError) as e:
                raise GrammarError(f"json_schema: {str(e).splitlines()[0]}", kind) from None
        if kind == "json_object":
            return _json_object_regex(self.whitespace)
        if kind == "regex":
            return normalize_regex(spec, "regex")
        if kind == "choices":
            return choices_regex(choices_of(spec))
        if kind == "ebnf":
            raise GrammarError(
                "ebnf: the outlines grammar backend does not support EBNF grammars (they are "
                "not regular); use the xgrammar backend",
                "ebnf",
            )
        if kind == "structural_tag":
            raise GrammarError(
                "structural_tag: the outlines grammar backend has no structural tags; use the "
                "xgrammar backend", kind,
            )
        raise GrammarError(f"unknown constraint kind {kind!r}", kind)

    # ------------------------------------------------------------------ persistence
    def serialize(self, grammar: CompiledGrammar) -> bytes | None:
        assert isinstance(grammar, OutlinesCompiled)
        return pickle.dumps(grammar.index)  # Index pickles as its own binary encoding

    def deserialize(self, data: bytes) -> CompiledGrammar:
        index = pickle.loads(data)
        if not isinstance(index, outlines_core.Index):
            raise ValueError("not an outlines_core.Index")
        return OutlinesCompiled(index, self.token_info, self.eos_token_ids)

    def fingerprint(self) -> str:
        import importlib.metadata

        version = importlib.metadata.version("outlines_core")
        return (f"outlines-{version}-p{TRANSLATION}-ws{int(self.any_whitespace)}."
                f"{self.max_whitespace}")

    @classmethod
    def supported_features(cls) -> dict:
        return {
            "kinds": ["json_schema", "json_object", "regex", "choices"],
            "refused_kinds": {"ebnf": "not a regular language",
                              "structural_tag": "xgrammar's format, not outlines'"},
            "json_schema": {
                "supported_keywords": sorted(POLICY.supported),
                "refused_keywords": POLICY.refused(),
                "ignored_keywords": sorted(ANNOTATION_KEYWORDS),
                "formats": sorted(FORMAT_PATTERNS),
                "notes": [
                    "recursive $ref unrolls 3 levels (a subset)",
                    "json_object nests objects/arrays two levels (a subset)",
                    ("oneOf when its branches cannot overlap, or each branch less those it "
                     "may overlap where plait spells that `not`; allOf when they merge exactly"),
                    "pattern is matched against the whole string",
                    ("uniqueItems when maxItems <= 1 or over items of a few values (at most "
                     "400 arrays)"),
                    ("not only of one type list, one required list (closed objects), one "
                     "pattern anchored at both ends that repeats one character class, a const "
                     "or enum of strings, booleans or null, or an object's properties/required "
                     "check (numeric bounds: none on outlines)"),
                    ("if/then/else as anyOf of (if and then) and (not if and else), where plait "
                     "spells `not` of the if"),
                    ("dependencies / dependentRequired / dependentSchemas on closed objects, "
                     "at most 4 optional keys bringing them"),
                ],
            },
            "regex": {
                "dialect": "Python re (what re.fullmatch accepts), matched against the whole "
                "output",
                "refused": [
                    "look-ahead/look-behind", "back-references", "word boundaries",
                    "anchors inside", "inline flags (i, m, a, L)", "possessive quantifiers",
                ],
            },
        }


class _TokenInfo:
    """The vocabulary as outlines-core and the jump-forward walk need it."""

    def __init__(self, spelled: list[bytes | None], vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.spelled = spelled[:vocab_size]
        self.first_byte = np.full(max(vocab_size, len(spelled)), -1, dtype=np.int16)
        self.single_byte: dict[int, int] = {}
        for token_id, text in enumerate(self.spelled):
            if text:
                self.first_byte[token_id] = text[0]
                if len(text) == 1:
                    self.single_byte.setdefault(text[0], token_id)

    def vocabulary(self, eos: int) -> outlines_core.Vocabulary:
        by_text: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(self.spelled):
            if text and token_id != eos:
                by_text.setdefault(text, []).append(token_id)
        return outlines_core.Vocabulary(eos, by_text)


_DONE = -1  # the state after EOS


class OutlinesCompiled(CompiledGrammar):
    def __init__(self, index, token_info: _TokenInfo, eos_token_ids: list[int]) -> None:
        self.index = index
        self.info = token_info
        self.eos_token_ids = eos_token_ids
        self.eos_set = frozenset(eos_token_ids)
        self._rows: dict[int, torch.Tensor] = {}
        self._forced: dict[int, str] = {}

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self, [self.index.get_initial_state()])

    def allowed(self, state: int) -> list[int]:
        """Text tokens allowed in a state (outlines' own EOS entry left out)."""
        tokens = self.index.get_allowed_tokens(state) or []
        return [t for t in tokens if t not in self.eos_set]

    def row(self, state: int) -> torch.Tensor:
        """int32 [words] bitmask row for a state, computed once per state."""
        words = self._rows.get(state)
        if words is None:
            ids = self.allowed(state)
            if self.index.is_final_state(state):
                ids += self.eos_token_ids
            words = words_for(ids, self.info.words)
            self._rows[state] = words
        return words

    def forced_text(self, state: int) -> str:
        text = self._forced.get(state)
        if text is None:
            text = self._walk_forced(state)
            self._forced[state] = text
        return text

    def _walk_forced(self, state: int) -> str:
        """Bytes every continuation must start with: while all allowed tokens share their
        first byte (and EOS is not allowed), step the DFA by that byte's one-byte token."""
        out = bytearray()
        seen = set()
        while state not in seen and len(out) < _JUMP_LIMIT:
            seen.add(state)
            if self.index.is_final_state(state):
                break
            allowed = self.allowed(state)
            firsts = np.unique(self.info.first_byte[np.asarray(allowed, dtype=np.int64)])
            if len(firsts) != 1 or firsts[0] < 0 or int(firsts[0]) not in self.info.single_byte:
                break
            byte = int(firsts[0])
            nxt = self.index.get_next_state(state, self.info.single_byte[byte])
            if nxt is None:
                break
            out.append(byte)
            state = nxt
        return _utf8_prefix(bytes(out))


def _utf8_prefix(data: bytes) -> str:
    """The longest prefix of data that is whole UTF-8 characters."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""


class OutlinesMatcher(Matcher):
    def __init__(self, grammar: OutlinesCompiled, states: list[int]) -> None:
        self._g = grammar
        self._states = states  # history: initial state, then one per accepted token

    @property
    def _state(self) -> int:
        return self._states[-1]

    def accept_token(self, token_id: int) -> bool:
        state = self._state
        if state == _DONE:
            return False
        if token_id in self._g.eos_set:
            if not self._g.index.is_final_state(state):
                return False
            self._states.append(_DONE)
            return True
        if not 0 <= token_id < self._g.info.vocab_size:
            return False
        nxt = self._g.index.get_next_state(state, token_id)
        if nxt is None:
            return False
        self._states.append(nxt)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._state == _DONE:
            allow_only(bitmask, row, self._g.eos_token_ids)
        else:
            copy_row(bitmask, row, self._g.row(self._state))

    def is_terminated(self) -> bool:
        return self._state == _DONE

    def can_terminate(self) -> bool:
        return self._state != _DONE and self._g.index.is_final_state(self._state)

    def find_jump_forward_string(self) -> str:
        return "" if self._state == _DONE else self._g.forced_text(self._state)

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens < len(self._states):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self._states) - 1} tokens")
        if num_tokens:
            del self._states[-num_tokens:]

    def copy(self) -> OutlinesMatcher:
        return OutlinesMatcher(self._g, list(self._states))
