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
This holds for every minimum: longer ones once kept their counted characters (`c{lo,lo}`, then
a `max_chars` rule), whose fills had no cache either (20 ms at lo = 100 and 0.4-0.8 s at lo =
5000 on a 100k vocabulary: one `{"type": "string", "minLength": 5000}` request held a server's
every request for two minutes); `[...]{lo,-1}` compiles in ~0.6 s and fills in ~0.02 ms at
lo = 100 to 1,000,000. Such a string's first lo characters are plain (no escape). Past XGR_REPEAT
the lo plain characters are nested repetitions of at most XGR_REPEAT (`[...]{lo,-1}` itself
masked wrong there).

Whole strings (whole_string_rules). Most bounded strings are nothing but one repeated character
(`minLength`/`maxLength` alone, or a pattern like `^[a-z]{1,64}$`), and there the forms above
still cost 0.3-0.6 ms a fill on a 100k vocabulary (`[...]{lo,-1}` has no cached mask either),
36 ms after an escape, and 7-23 ms in the last ~16 characters before a `max_chars` bound
(xgrammar checks every token longer than the characters left, one by one). When the pattern's
rule is the whole content of a JSON string (every use of it is followed by the closing quote),
it becomes right-recursive rules with a lookahead for that quote, which xgrammar masks from its
cache (0.03-0.06 ms a fill). With c the class and e the escapes:

    r_0 ::= ("") (= "\"")                                    nothing more, then the quote
    r_k ::= ("" | (c r_k-1) | (e r_k-1)) (= "\"")             up to k more characters
    t   ::= ("" | (c t) | (e t)) (= "\"")                     any number
    m_k_X ::= (c m_k-1_X) | (e m_k-1_X)                        exactly k characters, then X

A string of lo..hi characters is m_lo_r_(hi-lo) when hi <= CHAIN_LIMIT: exact, escapes
included. Past it, m_lo_t under a `max_chars=hi` rule: sound as above (an escape counts its
raw width), paying the boundary cost only in its last characters before maxLength. The rules
are shared by every string of a grammar that repeats the same character: each costs ~5-10 ms
of compile time on a 100k vocabulary, so a grammar has at most CHAIN_LIMIT + 1 `r` rules
however many bounded strings it has (20 strings of distinct maximums near 64 compile in
0.9 s; with a chain each, 10.7 s, past the default compile deadline).

Equal rules (merge_equal_rules). xgrammar prints one rule per schema node, so a schema that
uses the same sub-schema in many places (a `$ref` to a string definition, the same
string-escape rules under each pattern) prints it as many rules with equal bodies, and its
compiler builds the token-mask cache of every one of them: 3,152 rules for a WashingtonPost
schema (60 definitions), 987 once rules that match the same texts are merged, and 25 s of
compile time became 3.7 s on SmolLM2's 49k vocabulary (2 cores). Two rules are merged when
their attributes and bodies are equal with the rules they call taken as equal classes (a
partition refined until stable, so recursive rules merge too): the grammar accepts the same
texts, rule for rule.
"""

from __future__ import annotations

import re
from typing import Any

import xgrammar as xgr

from plait.grammar.base import GrammarError
from plait.grammar.json_schema import map_subschemas
from plait.grammar.regex_syntax import Repeat, parse, to_regex

_MARKER = "PLAITPAT{}X"
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# counted repetitions with more optional repeats than this become a max_chars rule
LONG_REPEAT = 32
# xgrammar 0.2.8 rewrites a counted repetition of more than this many (`X{lo, -1}` as `X*`, an
# inner repetition and XGR_REPEAT copies of X, with lookaheads), and inside a JSON string's
# rules its token masks for that form let through tokens the matcher then refuses (a raw
# newline: plait's random walks from lo = 129 on, none up to 128). Longer exact counts are
# written as nested repetitions of at most this many (_exactly).
XGR_REPEAT = 128
# whole strings of one repeated character: exact chains up to this maxLength (module docstring)
CHAIN_LIMIT = 64
_CLOSES = '(= "\\"")'  # lookahead: the closing quote of the JSON string comes next
# one printed alternative that is exactly one JSON character: a class, or one escape sequence
_ONE = r'(?:"[^"\\]"|\[(?:\\.|[^\]\\])*\])'
_JSON_CHAR_ALT = re.compile(
    r'\[(?:\\.|[^\]\\])*\]'  # a character class
    r'|"\\\\" "(?:[bfnrt/]|\\"|\\\\)"'  # a short escape: \n, \", \\ ...
    r'|"\\\\" "u"(?: ' + _ONE + r'){4}'  # \uXXXX
)
_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= (.*)$", re.MULTILINE)
# a printed rule: its name, its attributes (`[max_chars=64]`) if any, its body
_RULE_LINE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(\[[^\]]*\])? ::= (.*)$")
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
    rules: list[str] = []
    chains: dict = {}  # one _Ladder of rules per repeated character, shared by its strings
    for k, pattern in enumerate(patterns):
        call = f'Regex("{_MARKER.format(k)}", json_string=true)'
        if call not in ebnf:
            continue  # xgrammar pruned that part (e.g. a property under maxProperties 0)
        name = f"plait_pattern_{k}"
        whole = _closes_string(ebnf, call)
        ebnf = ebnf.replace(call, f"(({name}))")
        if whole and (rule := whole_string_rules(pattern, name, chains)) is not None:
            rules.append(rule)
            continue
        try:
            rules.append(bound_long_repeats(_rename_root(str(xgr.Grammar.from_regex(pattern)), name)))
        except RuntimeError as e:
            raise GrammarError(f"json_schema: pattern not supported by xgrammar: {e}",
                               "json_schema") from None
    if "PLAITPAT" in ebnf:  # a marker printed in some other form: never compile it as text
        raise GrammarError("json_schema: internal error: unreplaced pattern", "json_schema")
    return ebnf.rstrip("\n") + "\n" + "\n".join(rules) + "\n"


def _closes_string(ebnf: str, call: str) -> bool:
    """The marker's call is the whole body of a rule, and every use of that rule is followed by
    the closing quote of its JSON string (so the pattern is the string's whole content)."""
    m = re.search(r"^([A-Za-z_][A-Za-z0-9_]*) ::= " + re.escape(call) + "$", ebnf, re.MULTILINE)
    if m is None:
        return False
    uses = [u for u in re.finditer(rf"(?<![A-Za-z0-9_]){m.group(1)}(?![A-Za-z0-9_])", ebnf)
            if u.start() != m.start()]
    return bool(uses) and all(ebnf.startswith(' "\\""', u.end()) for u in uses)


def whole_string_rules(pattern: str, name: str, chains: dict) -> str | None:
    """The rules of `name` for a pattern that is one repeated JSON character and the whole
    content of its string (the forms of the module docstring), or None for any other pattern.
    `chains` holds the rules already written for this grammar (_Ladder per character)."""
    try:
        node = parse(pattern, "json_schema")
    except GrammarError:
        return None
    if not isinstance(node, Repeat) or node.lo > CHAIN_LIMIT:
        return None
    item = _rename_root(str(xgr.Grammar.from_regex(to_regex(node.item))), "x").strip()
    m = re.fullmatch(r"x ::= (.*)", item)
    if m is None or not _is_json_char(m.group(1)):
        return None
    alts = tuple(_alternatives(m.group(1)))
    if alts not in chains:
        chains[alts] = _Ladder(f"plait_len_{len(chains)}", alts)
    ladder = chains[alts]
    entry = ladder.entry(node.lo, node.hi)
    new, ladder.written = ladder.rules[ladder.written:], len(ladder.rules)
    return "\n".join([f"{name} ::= (({entry}))", *new])


class _Ladder:
    """The rules of one repeated character (r_k, t, m_k_X of the module docstring), made once
    per grammar and shared by every string that repeats it."""

    def __init__(self, base: str, alts: tuple[str, ...]) -> None:
        self.base = base
        self.classes = [a for a in alts if a.startswith("[")]
        escapes = [a for a in alts if not a.startswith("[")]
        self.escape = f"{base}_esc" if escapes else None
        self.rules: list[str] = []  # in the order made
        self.names: set[str] = set()
        self.written = 0  # rules already in the grammar
        if escapes:
            self._add(self.escape, "(" + " | ".join(f"({a})" for a in escapes) + ")")

    def _add(self, name: str, body: str, attr: str = "") -> str:
        if name not in self.names:
            self.names.add(name)
            self.rules.append(f"{name}{attr} ::= {body}")
        return name

    def _step(self, nxt: str) -> str:
        return " | ".join([f"({c} {nxt})" for c in self.classes]
                          + ([f"({self.escape} {nxt})"] if self.escape else []))

    def upto(self, k: int) -> str:
        """Up to k characters, then the closing quote."""
        for r in range(k + 1):  # _add skips the rules made already
            body = '("")' if r == 0 else f'("" | {self._step(f"{self.base}_r{r - 1}")})'
            name = self._add(f"{self.base}_r{r}", f"{body} {_CLOSES}")
        return name

    def tail(self) -> str:
        """Any number of characters, then the closing quote."""
        name = f"{self.base}_t"
        return self._add(name, f'("" | {self._step(name)}) {_CLOSES}')

    def exactly(self, k: int, then: str) -> str:
        """k characters, then `then`."""
        for i in range(1, k + 1):
            prev = then if i == 1 else f"{self.base}_m{i - 1}_{then}"
            self._add(f"{self.base}_m{i}_{then}", f"({self._step(prev)})")
        return f"{self.base}_m{k}_{then}" if k else then

    def entry(self, lo: int, hi: int | None) -> str:
        """The rule of a string of lo..hi characters (hi None: no maximum)."""
        if hi is not None and hi <= CHAIN_LIMIT:
            return self.exactly(lo, self.upto(hi - lo))
        first = self.exactly(lo, self.tail())
        if hi is None:
            return first
        return self._add(f"{self.base}_max{hi}_{lo}", f"(({first}))", f"[max_chars={hi}]")


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


def merge_equal_rules(ebnf: str, root: str = "root") -> str:
    """The grammar with rules that match the same texts merged into one (module docstring):
    `ebnf` as xgrammar prints it, one rule a line; any other text is returned as it is."""
    order: list[str] = []
    heads: dict[str, str] = {}
    bodies: dict[str, list[str]] = {}
    for line in ebnf.splitlines():
        if not line.strip():
            continue
        m = _RULE_LINE.match(line)
        if m is None:  # a rule over several lines, a comment: not a grammar printed by xgrammar
            return ebnf
        name = m.group(1)
        order.append(name)
        heads[name] = m.group(2) or ""
        bodies[name] = _body_tokens(m.group(3))
    # start: rules alike but for the names they call (the root apart: it keeps its name)
    shapes: dict = {}
    cls = {
        n: shapes.setdefault(
            (n == root, heads[n], tuple("\0" if t in bodies else t for t in bodies[n])),
            len(shapes),
        )
        for n in order
    }
    while True:  # split each class by the classes its rules call, until nothing splits
        keys: dict = {}
        refined = {
            n: keys.setdefault((cls[n], tuple(cls[t] for t in bodies[n] if t in bodies)),
                               len(keys))
            for n in order
        }
        if len(keys) == len(shapes):
            break
        cls, shapes = refined, keys
    first: dict[int, str] = {}
    for n in order:
        first.setdefault(cls[n], n)  # the root is alone in its class
    lines = [
        f"{n}{heads[n]} ::= " + "".join(first[cls[t]] if t in bodies else t for t in bodies[n])
        for n in order
        if first[cls[n]] == n
    ]
    return "\n".join(lines) + "\n"


def _body_tokens(body: str) -> list[str]:
    """A rule body split into literals, classes, names and single other characters."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch in "\"[":
            end = _closing(body, i, '"' if ch == '"' else "]")
        elif m := _IDENT.match(body, i):
            end = m.end()
        else:
            end = i + 1
        out.append(body[i:end])
        i = end
    return out


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
        if split is not None:
            cls, escapes = split
            name = f"{rule}_len{len(extra)}"
            attr = f"[max_chars={hi}]" if hi >= 0 else ""
            if lo == 0:
                extra.append(f"{name}{attr} ::= (({rule}*))")
                return name
            extra.append(f"{name}_esc ::= ({escapes})")
            extra.append(f"{name}_tail ::= ((({name}_esc {rule}*)))")
            extra.append(f'{name}_rest ::= ("" | ({name}_tail))')
            head = (f"({cls}{{{lo}, -1}} {name}_rest)" if lo <= XGR_REPEAT
                    else f"({_exactly(cls, lo, name, extra)} {cls}* {name}_rest)")
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


def _exactly(cls: str, n: int, name: str, extra: list[str]) -> str:
    """Exactly n repeats of the class `cls` in counted repetitions of at most XGR_REPEAT: n's
    digits in base XGR_REPEAT, each a repetition of a block rule (block i = XGR_REPEAT^i
    characters, written into `extra`)."""
    digits = []
    while n:
        n, d = divmod(n, XGR_REPEAT)
        digits.append(d)
    for i in range(1, len(digits)):
        inner = cls if i == 1 else f"{name}_blk{i - 1}"
        extra.append(f"{name}_blk{i} ::= (({inner}{{{XGR_REPEAT}, {XGR_REPEAT}}}))")
    return " ".join(f"{cls if i == 0 else f'{name}_blk{i}'}{{{d}, {d}}}"
                    for i, d in reversed(list(enumerate(digits))) if d)


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
