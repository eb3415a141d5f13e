"""Route JSON-string patterns around xgrammar's string-pattern converter.

xgrammar 0.2.8 converts a schema's `pattern` with its own JSON-string regex mode, which
mis-handles an optional group that contains a repetition: for `a(?:x[0-9]+)?b` it accepts
"a12b" (the `x` is skipped). Its plain regex converter gets the same regex right. So every
pattern in the core schema is replaced by a marker, xgrammar prints the schema's grammar as
EBNF, and each marker's rule is replaced by the plain-regex grammar of the real pattern.
"""

from __future__ import annotations

import re
from typing import Any

import xgrammar as xgr

from plait.grammar.base import GrammarError
from plait.grammar.json_schema import map_subschemas

_MARKER = "PLAITPAT{}X"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def extract_patterns(core: Any) -> tuple[Any, list[str]]:
    """(core with every pattern replaced by a marker regex, the patterns by marker index)."""
    patterns: list[str] = []

    def mark(regex: str) -> str:
        patterns.append(regex)
        return _MARKER.format(len(patterns) - 1)

    def replace(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = dict(node)
        if isinstance(out.get("pattern"), str):
            out["pattern"] = mark(out["pattern"])
        if "patternProperties" in out:
            out["patternProperties"] = {mark(k): v for k, v in out["patternProperties"].items()}
        return out

    return map_subschemas(core, replace), patterns


def splice_patterns(ebnf: str, patterns: list[str]) -> str:
    """Replace each marker's Regex(...) rule body by the plain-regex grammar of its pattern."""
    rules = []
    for k, pattern in enumerate(patterns):
        call = f'Regex("{_MARKER.format(k)}", json_string=true)'
        if call not in ebnf:
            continue  # xgrammar pruned that part (e.g. a property under maxProperties 0)
        name = f"plait_pattern_{k}"
        ebnf = ebnf.replace(call, f"(({name}))")
        try:
            rules.append(_rename_root(str(xgr.Grammar.from_regex(pattern)), name))
        except RuntimeError as e:
            raise GrammarError(f"json_schema: pattern not supported by xgrammar: {e}",
                               "json_schema") from None
    if "PLAITPAT" in ebnf:  # a marker printed in some other form: never compile it as text
        raise GrammarError("json_schema: internal error: unreplaced pattern", "json_schema")
    return ebnf.rstrip("\n") + "\n" + "\n".join(rules) + "\n"


def _rename_root(ebnf: str, name: str) -> str:
    """Rename the rules `root`, `root_1`, ... of a printed grammar, outside literals/classes."""
    out, i = [], 0
    while i < len(ebnf):
        ch = ebnf[i]
        if ch in "\"[":
            end = _closing(ebnf, i, '"' if ch == '"' else "]")
            out.append(ebnf[i:end])
            i = end
            continue
        m = _IDENT.match(ebnf, i)
        if m:
            word = m.group()
            if word == "root" or word.startswith("root_"):
                word = name + word[len("root") :]
            out.append(word)
            i = m.end()
            continue
        out.append(ch)
        i += 1
    return "".join(out)


def _closing(text: str, start: int, close: str) -> int:
    """Index just past the literal or class that opens at start (backslash escapes skipped)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == close:
            return i + 1
        i += 1
    return len(text)
