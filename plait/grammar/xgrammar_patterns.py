"""Route JSON-string patterns around xgrammar's string-pattern converter.

xgrammar 0.2.8 converts a schema's `pattern` with its own JSON-string regex mode, which
mis-handles an optional group that contains a repetition: for `a(?:x[0-9]+)?b` it accepts
"a12b" (the `x` is skipped). Its plain regex converter gets the same regex right. So every
pattern in the core schema is replaced by a marker, xgrammar prints the schema's grammar as
EBNF, and each marker's rule is replaced by the plain-regex grammar of the real pattern.

Length bounds. `minLength` and `maxLength` fold into a counted repetition of one JSON
character, `c{lo,hi}` (hi -1: no maximum), where c is a class or an escape (`\\n`, `\\u001f`).
xgrammar 0.2.8 has no cached token mask for a counted repetition of such an alternation: every
mask fill walks the whole vocabulary through its parser (measured on a 100k vocabulary: 0.15 s
per fill at hi=16, 0.6-1.6 s at hi=256..1024, growing with the string; nine such fields made a
request cost seconds per token and stalled its batch; later, with the bounds below LONG_REPEAT
left counted: `c{0,20}` 33-43 ms and `c{9,-1}` 22-38 ms a fill, a 35x token for a dev schema on
plait-tiny, 11-20 ms on SmolLM2's 49k vocabulary). Cached forms (0.1-1.1 ms a fill there): a
counted repetition of the class alone, `[...]{lo,-1}`, and a rule with xgrammar's `max_chars`
attribute over an unbounded repetition. So (bound_long_repeats) c{lo,hi} becomes

    N[max_chars=hi] ::= [...]{lo,-1} ("" | escape c*)       (lo >= 2; no attribute when hi = -1)
    N[max_chars=hi] ::= [...]{1,-1} ("" | escape c*) | escape c*                        (lo = 1)
    N[max_chars=hi] ::= c*                                                             (lo = 0)

Both departures keep the bound sound (never a string outside the schema):
- `max_chars` counts raw code points, so an escape costs its width (2 or 6) instead of one
  character: exact for strings without escapes; one with escapes may stop up to 5 characters
  per escape short of maxLength;
- from lo = 2 the first lo characters are plain (no escape among them); lo = 1 is exact.
Minimums above LONG_REPEAT keep the counted repetition of lo characters (`c{lo,lo}`, then a
`max_chars` rule for long maximums), as before.
"""

from __future__ import annotations

import re
from typing import Any

import xgrammar as xgr

from plait.grammar.base import GrammarError
from plait.grammar.json_schema import map_subschemas

_MARKER = "PLAITPAT{}X"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# counted repetitions with more optional repeats than this become a max_chars rule
LONG_REPEAT = 32
# one printed alternative that is exactly one JSON character: a class, or one escape sequence
_ONE = r'(?:"[^"\\]"|\[(?:\\.|[^\]\\])*\])'
_JSON_CHAR_ALT = re.compile(
    r'\[(?:\\.|[^\]\\])*\]'  # a character class
    r'|"\\\\" "(?:[bfnrt/]|\\"|\\\\)"'  # a short escape: \n, \", \\ ...
    r'|"\\\\" "u"(?: ' + _ONE + r'){4}'  # \uXXXX
)
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$", re.MULTILINE)
_COUNTED = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\{(\d+), (-1|\d+)\}")


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
            rules.append(bound_long_repeats(_rename_root(str(xgr.Grammar.from_regex(pattern)), name)))
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


def bound_long_repeats(ebnf: str) -> str:
    """Rewrite each counted repetition `c{lo, hi}` of a rule c that is exactly one JSON character
    into the cached forms of the module docstring."""
    bodies = {m.group(1): m.group(2) for m in _RULE.finditer(ebnf)}
    extra: list[str] = []

    def rewrite(m: re.Match) -> str:
        rule, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        body = bodies.get(rule, "")
        if not _is_json_char(body):
            return m.group(0)
        split = _class_and_escapes(body)
        if split is not None and lo <= LONG_REPEAT:
            cls, escapes = split
            name = f"{rule}_len{len(extra)}"
            attr = f"[max_chars={hi}]" if hi >= 0 else ""
            if lo == 0:
                extra.append(f"{name}{attr} ::= (({rule}*))")
                return name
            extra.append(f"{name}_esc ::= ({escapes})")
            extra.append(f"{name}_tail ::= ((({name}_esc {rule}*)))")
            extra.append(f'{name}_rest ::= ("" | ({name}_tail))')
            head = f"({cls}{{{lo}, -1}} {name}_rest)"
            extra.append(f"{name}{attr} ::= ({head}" + (f" | ({name}_tail)" if lo == 1 else "")
                         + ")")
            return name
        if hi < 0 or hi - lo <= LONG_REPEAT:
            return m.group(0)
        upto = f"{rule}_upto{len(extra)}"
        extra.append(f"{upto}[max_chars={hi - lo}] ::= (({rule}*))")
        return f"{rule}{{{lo}, {lo}}} {upto}" if lo else upto

    lines = []
    for line in ebnf.splitlines():
        head, sep, body = line.partition(" ::= ")
        lines.append(head + sep + _COUNTED.sub(rewrite, body) if sep else line)
    return "\n".join(lines + extra) + "\n"


def _class_and_escapes(body: str) -> tuple[str, str] | None:
    """(the class, the escape alternatives joined by |) of a JSON-character rule body whose first
    alternative is its only class and the others escapes; None for any other shape."""
    alts = _alternatives(body)
    if len(alts) < 2 or not alts[0].startswith("[") or any(a.startswith("[") for a in alts[1:]):
        return None
    return alts[0], " | ".join(f"({a})" for a in alts[1:])


def _is_json_char(body: str) -> bool:
    """The printed rule body is an alternation of single JSON characters (classes, escapes)."""
    body = body.strip()
    if not (body.startswith("((") and body.endswith("))")):
        return False
    return all(_JSON_CHAR_ALT.fullmatch(a) for a in _alternatives(body))


def _alternatives(body: str) -> list[str]:
    """The alternatives of a printed rule body `((a) | (b) | ...)`, without their parentheses."""
    return body.strip()[2:-2].split(") | (")
