"""Constrained decoding: JSON schema, JSON object, regex, EBNF and choices constraints.

    base.py               the contract (GrammarBackend -> CompiledGrammar -> Matcher, bitmasks)
    manager.py            GrammarManager: compile off-thread with a budget, caches; backend registry
    xgrammar_backend.py   the default backend (all kinds)
    outlines_backend.py   the second backend (regular kinds only: no EBNF)
    json_schema.py        schema -> a core the backends enforce exactly, or GrammarError
    regex_syntax.py       one regex dialect for both backends (and JSON-string contents)
    formats.py            JSON-schema formats as exact regexes
"""

from plait.grammar.base import (
    GRAMMAR_KINDS,
    CompiledGrammar,
    GrammarBackend,
    GrammarError,
    Matcher,
    allocate_token_bitmask,
    apply_token_bitmask,
)

__all__ = [
    "GRAMMAR_KINDS",
    "CompiledGrammar",
    "GrammarBackend",
    "GrammarError",
    "Matcher",
    "allocate_token_bitmask",
    "apply_token_bitmask",
]
