"""Grammar backend on xgrammar (the default): JSON schema, JSON object, regex, EBNF, choices,
structural tags.

xgrammar compiles a pushdown automaton with per-state token-mask caches and releases the GIL
while it does (measured: a 2 s compile on a worker thread left a 10 ms ticker on the main
thread on schedule), so the manager compiles it on plain threads.
"""

from __future__ import annotations

import json
import os

import torch
import xgrammar as xgr

from plait.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
)
from plait.grammar.bitmask import allow_only, copy_row
from plait.grammar.formats import FORMAT_PATTERNS
from plait.grammar.json_schema import (
    ANNOTATION_KEYWORDS,
    CORE_KEYWORDS,
    TRANSLATION,
    SchemaPolicy,
    prepare_schema,
)
from plait.grammar.kinds import choices_of, json_object_schema
from plait.grammar.regex_syntax import choices_regex, normalize_regex
from plait.grammar.vocab import special_token_ids
from plait.grammar.xgrammar_patterns import (
    extract_patterns,
    merge_equal_rules,
    splice_patterns,
)

POLICY = SchemaPolicy(
    backend="xgrammar",
    supported=CORE_KEYWORDS
    | {
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "divisibleBy", "patternProperties", "propertyNames", "minProperties", "maxProperties",
    },
)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], **options) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids, **options)
        self.tokenizer_info = _tokenizer_info(tokenizer, vocab_size, self.eos_token_ids)
        # our manager caches compiled grammars; xgrammar's own cache would only double memory
        self._compiler = xgr.GrammarCompiler(
            self.tokenizer_info, max_threads=min(4, os.cpu_count() or 1), cache_enabled=False
        )

    # ------------------------------------------------------------------ compile
    def compile(self, kind: str, spec: str) -> XGrammarCompiled:
        compile_fn = {
            "json_schema": self._json_schema,
            "json_object": lambda _spec: self._schema(json_object_schema(), "json_object"),
            "regex": lambda s: self._call(self._compiler.compile_regex, normalize_regex(s), "regex"),
            "ebnf": lambda s: self._call(self._compiler.compile_grammar, s, "ebnf"),
            "choices": lambda s: self._call(
                self._compiler.compile_regex, choices_regex(choices_of(s)), "choices"
            ),
            "structural_tag": self._structural_tag,
        }.get(kind)
        if compile_fn is None:
            raise GrammarError(f"unknown constraint kind {kind!r}", kind)
        return XGrammarCompiled(compile_fn(spec), self.vocab_size, self.eos_token_ids)

    def _json_schema(self, spec: str) -> xgr.CompiledGrammar:
        return self._schema(prepare_schema(spec, POLICY), "json_schema")

    def _schema_options(self) -> dict:
        return {
            "any_whitespace": self.any_whitespace,
            "max_whitespace_cnt": self.max_whitespace if self.any_whitespace else None,
            "strict_mode": True,
        }

    def _schema(self, core: dict, param: str) -> xgr.CompiledGrammar:
        return self._call(self._compiler.compile_grammar, self._schema_ebnf(core, param), param)

    def _schema_ebnf(self, core: dict, param: str) -> str:
        """The EBNF of a prepared schema: xgrammar's grammar of it, with plait's grammar of each
        pattern spliced in and rules that match the same texts merged (xgrammar_patterns.py)."""
        core, patterns = extract_patterns(core)
        grammar = self._call(lambda text: xgr.Grammar.from_json_schema(
            text, **self._schema_options()), json.dumps(core), param)
        return merge_equal_rules(splice_patterns(str(grammar), patterns))

    def _structural_tag(self, spec: str) -> xgr.CompiledGrammar:
        """xgrammar's structural tag, its JSON-schema parts held to plait's schema rules: each
        becomes the EBNF the json_schema kind compiles for it (unsupported keywords refused,
        patterns spliced as there), so a schema inside a tag is enforced exactly as one in
        response_format is."""
        param = "structural_tag"
        try:
            tag = json.loads(spec)
        except ValueError as e:
            raise GrammarError(f"{param}: not valid JSON ({e})", param) from None

        def rewrite(node):
            if isinstance(node, list):
                return [rewrite(v) for v in node]
            if not isinstance(node, dict):
                return node
            if node.get("type") == "json_schema" and "json_schema" in node:
                if node.get("style", "json") != "json":
                    raise GrammarError(f"{param}: json_schema style {node['style']!r} is not "
                                       "supported (only 'json')", param)
                schema = node["json_schema"]
                core = prepare_schema(json.dumps(schema) if not isinstance(schema, str)
                                      else schema, POLICY)
                return {"type": "grammar", "grammar": self._schema_ebnf(core, param)}
            return {k: rewrite(v) for k, v in node.items()}

        return self._call(self._compiler.compile_structural_tag, json.dumps(rewrite(tag)), param)

    @staticmethod
    def _call(fn, arg: str, param: str) -> xgr.CompiledGrammar:
        try:
            return fn(arg)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar reports bad input so
            raise GrammarError(f"{param}: {_first_line(e)}", param) from None

    # ------------------------------------------------------------------ persistence
    def serialize(self, grammar: CompiledGrammar) -> bytes | None:
        assert isinstance(grammar, XGrammarCompiled)
        return grammar.compiled.serialize_json().encode("utf-8")

    def deserialize(self, data: bytes) -> CompiledGrammar:
        compiled = xgr.CompiledGrammar.deserialize_json(data.decode("utf-8"), self.tokenizer_info)
        return XGrammarCompiled(compiled, self.vocab_size, self.eos_token_ids)

    def fingerprint(self) -> str:
        import importlib.metadata

        version = importlib.metadata.version("xgrammar")
        return (f"xgrammar-{version}-p{TRANSLATION}"
                f"-ws{int(self.any_whitespace)}.{self.max_whitespace}")

    @classmethod
    def supported_features(cls) -> dict:
        return {
            "kinds": ["json_schema", "json_object", "regex", "ebnf", "choices", "structural_tag"],
            "json_schema": {
                "supported_keywords": sorted(POLICY.supported),
                "refused_keywords": POLICY.refused(),
                "ignored_keywords": sorted(ANNOTATION_KEYWORDS),
                "formats": sorted(FORMAT_PATTERNS),
                "notes": _SCHEMA_NOTES,
            },
            "regex": _REGEX_NOTES,
        }


_SCHEMA_NOTES = [
    "objects carry only declared properties unless additionalProperties/patternProperties "
    "allow more; arrays only declared items",
    ("oneOf when its branches cannot overlap, or each branch less those it may overlap where "
     "plait spells that `not`; allOf when its branches merge exactly"),
    ("pattern is matched against the whole string; minLength/maxLength with a pattern or "
     "format: exact where it has one variable-length part, where it has several each part "
     "gets a share of the lengths (every output valid, some valid strings out of reach)"),
    "a maxLength more than 32 above minLength is enforced on the raw JSON text: an escape "
    "(\\n, \\u00XX) counts its 2 or 6 characters, so strings with escapes may end shorter "
    "than maxLength allows (never longer)",
    ("a minLength above 64 (or inside a pattern) is met by plain characters: no escape "
     "among a string's first minLength characters"),
    ("multipleOf on whole numbers only; uniqueItems when maxItems <= 1 or over items of a few "
     "values (at most 400 arrays)"),
    ("not only of one type list, one required list (closed objects), one pattern anchored "
     "at both ends that repeats one character class, one numeric bound, a const or enum of "
     "scalars (strings only where no pattern, format or length applies), or an object's "
     "properties/required check"),
    ("if/then/else as anyOf of (if and then) and (not if and else): the `if` must be a "
     "schema whose `not` plait spells (above); at most 16 branches where anyOf lists meet"),
    ("dependencies / dependentRequired / dependentSchemas on closed objects, at most 4 "
     "optional keys bringing them"),
]
_REGEX_NOTES = {
    "dialect": "Python re (what re.fullmatch accepts), matched against the whole output",
    "refused": [
        "look-ahead/look-behind", "back-references", "word boundaries", "anchors inside",
        "inline flags (i, m, a, L)", "possessive quantifiers", "atomic groups",
    ],
    "classes": "\\d \\w \\s print as ASCII; \\D \\W \\S and negated sets exclude all of "
    "Python's Unicode digits/word/space characters",
}


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    # xgrammar prefixes "[time] /project/cpp/file.cc:line: " to its messages
    text = text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text
    return text.splitlines()[0] if text else type(e).__name__


def _tokenizer_info(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> xgr.TokenizerInfo:
    """TokenizerInfo in which special tokens other than EOS spell nothing (xgrammar would
    otherwise allow e.g. '<|im_start|>' inside a JSON string as ordinary text)."""
    detected = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=eos_token_ids
    )
    hidden = special_token_ids(tokenizer) - set(eos_token_ids)
    if not hidden:
        return detected
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size and token_id not in hidden:
            encoded[token_id] = token
    return xgr.TokenizerInfo(
        encoded,
        detected.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=eos_token_ids,
        add_prefix_space=detected.add_prefix_space,
    )


class XGrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int, eos: list[int]) -> None:
        self.compiled = compiled
        self.vocab_size = vocab_size
        self.eos_token_ids = eos

    def matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled), self)


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: xgr.GrammarMatcher, grammar: XGrammarCompiled) -> None:
        self._m = matcher
        self._grammar = grammar
        self._words = (grammar.vocab_size + 31) // 32
        self._num_accepted = 0

    def accept_token(self, token_id: int) -> bool:
        if self._m.is_terminated() or not 0 <= token_id < self._grammar.vocab_size:
            return False
        if not self._m.accept_token(token_id):
            return False
        self._num_accepted += 1
        return True

    def accept_prefix(self, tokens: list[int]) -> int:
        # the C++ matcher's own call, without two Python layers a token (the closing planner
        # checks a plan of ~10 tokens after every sampled token of a short budget). It would
        # refuse an id out of range, and anything once terminated (by a stop token), with a
        # logged warning each: those are refused here, as accept_token does
        if self._m.is_terminated():
            return 0
        accept, stops, n = self._m._handle.accept_token, self._grammar.eos_token_ids, 0
        vocab = self._grammar.vocab_size
        for tok in tokens:
            if not 0 <= tok < vocab or not accept(tok, False):
                break
            n += 1
            if tok in stops and self._m.is_terminated():
                break
        self._num_accepted += n
        return n

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():  # only EOS again: never leave a row with nothing allowed
            allow_only(bitmask, row, self._grammar.eos_token_ids)
            return
        if bitmask.shape[1] == self._words and bitmask.device.type == "cpu":
            self._m.fill_next_token_bitmask(bitmask, row)
            return
        scratch = torch.empty((1, self._words), dtype=torch.int32)
        self._m.fill_next_token_bitmask(scratch, 0)
        copy_row(bitmask, row, scratch[0])

    def is_terminated(self) -> bool:
        return self._m.is_terminated()

    def can_terminate(self) -> bool:
        return not self._m.is_terminated() and self._m.is_completed()

    def find_jump_forward_string(self) -> str:
        if self._m.is_terminated() or self._m.is_completed():
            return ""  # EOS is a valid continuation: nothing is forced
        try:
            return self._m.find_jump_forward_string()
        except UnicodeDecodeError:
            # the forced bytes begin inside a UTF-8 character (a byte-level token took its
            # first bytes, e.g. of a regex's 4-byte character): xgrammar hands them over as
            # str and the decode fails. Nothing is forced then; the model decodes the rest
            # under the mask (the outlines backend keeps the whole-character prefix instead)
            return ""

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_accepted} tokens")
        if num_tokens:
            self._m.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def copy(self) -> XGrammarMatcher:
        twin = XGrammarMatcher(self._m.fork(), self._grammar)
        twin._num_accepted = self._num_accepted
        return twin
