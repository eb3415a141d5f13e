"""JSON schema -> a small core schema that a backend enforces exactly, or GrammarError.

Both backends were tested keyword by keyword (compile, random-walk outputs, validate with
jsonschema): each silently ignores some keywords and gets others subtly wrong (see
`tests/grammar/test_keyword_probes.py`). So a schema never reaches a backend as written. It is
rewritten into a core that uses only:

    type (one name) | enum | anyOf | $ref to #/$defs/<name> | {} (anything)
    string: pattern (printed by plait: escapes, lengths and formats folded in)
    integer/number: minimum, maximum, exclusiveMinimum, exclusiveMaximum, multipleOf (integer)
    object: properties, required, additionalProperties, patternProperties, propertyNames,
            minProperties, maxProperties
    array: items, prefixItems, minItems, maxItems

Every other assertion keyword is either rewritten exactly into those (allOf -> merged,
oneOf -> anyOf when its branches provably cannot overlap (or of each branch and
not the others where that `not` is one of the forms below), enum/const filtered by the sibling
keywords with jsonschema itself, type lists -> anyOf, draft-4 forms, `items` arrays,
dependencies / dependentRequired / dependentSchemas -> anyOf over the conditional keys' presence,
if/then/else -> anyOf of (if and then) and (not if and else), `not` of an always-true schema ->
false, of a type, a required list, a bound, a constant or enum, an object's properties check
-> the values that fail it) or refused
with a GrammarError naming the keyword and its JSON path. Outputs may be a *subset* of what the
schema allows (objects and arrays carry only declared members, patterns match whole strings,
one spelling per escape), never a superset. Annotations and unknown keywords have no validation
effect and are ignored.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import urllib.parse
from dataclasses import dataclass
from typing import Any

import jsonschema
import jsonschema.validators

from plait.grammar.base import GrammarError
from plait.grammar.formats import FORMAT_PATTERNS, SPEC_FORMATS
from plait.grammar.regex_automata import includes
from plait.grammar.regex_syntax import (
    VALID,
    json_key_regex,
    json_string_regex,
    json_string_regex_not,
    literal_of,
    parse,
    strings_but,
    to_regex,
)

# Keywords with a validation effect in some draft (3 to 2020-12). Everything else is an
# annotation (title, description, default, examples, $comment, readOnly, ...) or unknown.
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "divisibleBy"}
)
OBJECT_KEYWORDS = frozenset(
    {
        "properties", "required", "additionalProperties", "patternProperties", "propertyNames",
        "minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
        "dependencies", "unevaluatedProperties",
    }
)
ARRAY_KEYWORDS = frozenset(
    {
        "items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems",
        "contains", "minContains", "maxContains", "unevaluatedItems",
    }
)
GENERAL_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
        "$dynamicRef", "$recursiveRef", "disallow", "extends",
    }
)
ASSERTION_KEYWORDS = (
    STRING_KEYWORDS | NUMBER_KEYWORDS | OBJECT_KEYWORDS | ARRAY_KEYWORDS | GENERAL_KEYWORDS
)
ANNOTATION_KEYWORDS = (
    "title", "description", "$schema", "$id", "id", "examples", "default", "$comment",
    "deprecated", "readOnly", "writeOnly", "$anchor", "$dynamicAnchor", "$defs", "definitions",
    "contentEncoding", "contentMediaType", "contentSchema", "$vocabulary",
)
# plait's schema-to-grammar translation (this module, regex_syntax.py, xgrammar_patterns.py):
# a new number when it changes, so that --grammar-cache-dir never serves grammars of the
# earlier forms (2: whole strings as shared ladders of rules; 3: dependencies, not,
# patternProperties over declared names, class escapes printed for xgrammar's class parser;
# 4: rules that match the same texts merged)
TRANSLATION = 4
DEPENDENCY_KEYWORDS = ("dependencies", "dependentRequired", "dependentSchemas")
CONDITIONAL_KEYWORDS = ("if", "then", "else")
# keywords every backend enforces once plait has rewritten the schema (some conditionally:
# oneOf if disjoint, allOf if mergeable, uniqueItems over <= 1 item or a few values, formats,
# not of one type / required list / pattern, dependencies of at most 4 optional keys)
CORE_KEYWORDS = frozenset(
    {
        "type", "enum", "const", "allOf", "anyOf", "oneOf", "$ref", "properties", "required",
        "additionalProperties", "items", "prefixItems", "additionalItems", "minItems",
        "maxItems", "uniqueItems", "minLength", "maxLength", "pattern", "format",
        "unevaluatedProperties", "unevaluatedItems", "not", *DEPENDENCY_KEYWORDS,
        *CONDITIONAL_KEYWORDS,
    }
)
_FAMILY_TYPE = (
    [(k, "string") for k in STRING_KEYWORDS]
    + [(k, "number") for k in NUMBER_KEYWORDS]
    + [(k, "object") for k in OBJECT_KEYWORDS]
    + [(k, "array") for k in ARRAY_KEYWORDS]
)
FAMILY_OF = dict(_FAMILY_TYPE)
JSON_TYPES = ("string", "number", "integer", "object", "array", "boolean", "null")
_MIN_KEYWORDS = ("minimum", "exclusiveMinimum", "minLength", "minItems", "minProperties")
_MAX_KEYWORDS = ("maximum", "exclusiveMaximum", "maxLength", "maxItems", "maxProperties")
_MAX_MERGE_DEPTH = 32
_MAX_UNION_DEPTH = 4  # nested anyOf/oneOf levels never_valid looks through
# integer ranges up to this many values become an exact enum where bounds alone do not work
_SMALL_RANGE = 128
# an object's dependencies become one anyOf branch per combination of its conditional keys
# (each absent, or present with what it brings): at most this many keys, 2**4 = 16 branches
_MAX_CONDITIONAL_KEYS = 4
# two anyOf lists merged (allOf, if/then/else beside an anyOf) become the anyOf of every pair:
# at most this many
_MAX_ANY_OF_PRODUCT = 16
# uniqueItems over items of a few values: the anyOf of the arrays of distinct values, at most
# this many (4 values: 65 arrays; 5: 326)
_MAX_UNIQUE_ARRAYS = 400


@dataclass(frozen=True)
class SchemaPolicy:
    """What one backend enforces: the assertion keywords it may receive (after rewriting)."""

    backend: str
    supported: frozenset[str]

    def refused(self) -> list[str]:
        return sorted(ASSERTION_KEYWORDS - self.supported)


def parse_schema(spec: str) -> Any:
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, TypeError) as e:
        raise GrammarError(f"json_schema: not valid JSON ({e})", "json_schema") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("json_schema: a schema must be a JSON object or a boolean", "json_schema")
    return schema


def prepare_schema(spec: str, policy: SchemaPolicy) -> dict:
    """The core schema for `spec` (canonical JSON text), or GrammarError."""
    root = parse_schema(spec)
    try:
        return _Normalizer(root, policy).run()
    except RecursionError:
        raise GrammarError("json_schema: schema nested too deeply", "json_schema") from None


def check_schema(schema: Any) -> None:
    """GrammarError unless `schema` is valid under a draft it may be written in, as a
    constraint's root is checked (a schema placed below another's root, as tool_calls.py's
    list of calls places each tool's, escapes its root's check)."""
    try:
        normalizer = _Normalizer(schema, SchemaPolicy("check", CORE_KEYWORDS))
        normalizer.check_refs(schema, "$")
    except RecursionError:
        raise GrammarError("json_schema: schema nested too deeply", "json_schema") from None


def _at(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if re.fullmatch(r"[A-Za-z_$][\w$-]*", key) else f"{path}[{key!r}]"


def _error(message: str) -> GrammarError:
    return GrammarError(f"json_schema: {message}", "json_schema")


class _Unsatisfiable(GrammarError):
    """No value passes the schema at some path (a dependency branch may drop it; elsewhere it
    is the user's error like any other GrammarError)."""


def _unsatisfiable(path: str, why: str) -> GrammarError:
    return _Unsatisfiable(f"json_schema: the schema at {path} cannot be satisfied ({why})",
                          "json_schema")


def _canon(value: Any) -> str:
    """JSON identity as jsonschema sees it (1 == 1.0, but True != 1)."""

    def norm(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items()}
        if isinstance(v, list):
            return [norm(x) for x in v]
        return v

    return json.dumps(norm(value), sort_keys=True)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(value)]


def _assertions(schema: dict) -> dict:
    return {k: v for k, v in schema.items() if k in ASSERTION_KEYWORDS}


def _without(schema: dict, *keys: str) -> dict:
    return {k: v for k, v in schema.items() if k not in keys}


# a number fails one bound exactly when it passes the other side's opposite bound
_NEGATED_BOUND = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum",
                  "exclusiveMinimum": "maximum", "exclusiveMaximum": "minimum"}


def _pattern_but(words: list[str]) -> str:
    """A regex (Python's, anchored at both ends) of every string except `words`."""
    return r"\A(?:" + to_regex(strings_but(VALID, words)) + r")\Z"


def _conditional(schema: dict) -> bool:
    """`if` with a `then` or an `else` (an `if` alone asserts nothing)."""
    return "if" in schema and ("then" in schema or "else" in schema)


def _cases(schema: dict) -> dict:
    """if/then/else as the anyOf it means: (if and then) or (not if and else)."""
    cond, then, other = schema["if"], schema.get("then", True), schema.get("else", True)
    if cond is True or cond is False:
        return {"allOf": [then if cond else other]}
    return {"anyOf": [{"allOf": [cond, then]}, {"allOf": [{"not": cond}, other]}]}


def _all_of(a: Any, b: Any) -> Any:
    """Conjunction of two raw schemas, simplified where trivial."""
    if a is True or a == {} or a is None:
        return b
    if b is True or b == {} or b is None or _canon(a) == _canon(b):
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


class _Normalizer:
    def __init__(self, root: Any, policy: SchemaPolicy) -> None:
        self.root = root
        self.policy = policy
        self.validator = self._validator(root)
        self.def_names: dict[str, str] = {}  # JSON pointer -> name in the output $defs
        self.defs: dict[str, Any] = {}

    @staticmethod
    def _validator(root: Any):
        """jsonschema's validator for the schema's draft (the reference for enum filtering).
        Without $schema, the newest draft whose meta-schema accepts the schema: real schemas
        often use draft-4/7 forms (boolean exclusiveMinimum, items as a list) undeclared."""
        if isinstance(root, dict) and "$schema" in root:
            candidates = [jsonschema.validators.validator_for(root)]
        else:
            candidates = [jsonschema.Draft202012Validator, jsonschema.Draft7Validator,
                          jsonschema.Draft4Validator]
        first_error = None
        for cls in candidates:
            try:
                cls.check_schema(root)
            except jsonschema.SchemaError as e:
                first_error = first_error or e
                continue
            return cls(root, format_checker=cls.FORMAT_CHECKER)
        where = "$" + "".join(f"[{p!r}]" for p in first_error.path)
        raise _error(f"invalid schema at {where}: {first_error.message}")

    def run(self) -> dict:
        core = self.node(self.root, "$")
        if core is False:
            raise _unsatisfiable("$", "it is false")
        return {**core, "$defs": self.defs} if self.defs else core

    # ------------------------------------------------------------------ dispatch
    def need(self, keyword: str, path: str) -> None:
        if keyword not in self.policy.supported:
            raise _error(
                f"keyword '{keyword}' at {path} is not supported by the {self.policy.backend} "
                "grammar backend (it would not be enforced)"
            )

    def node(self, schema: Any, path: str) -> Any:
        """Raw schema -> core schema, or False (nothing matches)."""
        if schema is True:
            return {}
        if schema is False:
            return False
        if not isinstance(schema, dict):
            raise _error(f"{path} is not a schema (expected an object or a boolean)")
        s = _assertions(schema)
        if "not" in s:
            if s["not"] is True or (isinstance(s["not"], dict) and not _assertions(s["not"])):
                return False  # not of a schema that everything passes: nothing passes
            if s["not"] is False:
                s = _without(s, "not")
        if "enum" in s or "const" in s:
            return self.enum(schema, s, path)
        if _conditional(s):
            return self.node(self.merge_all([s], path), path)
        if "$ref" in s:
            if len(s) == 1:
                return self.ref(s["$ref"], path)
            return self.node(self.merge_all([{"$ref": s["$ref"]}, _without(s, "$ref")], path), path)
        if "allOf" in s:
            return self.node(self.merge_all(list(s["allOf"]) + [_without(s, "allOf")], path), path)
        if "anyOf" in s or "oneOf" in s:
            return self.union(s, path)
        if "not" in s:
            return self.negation(s, path)
        self.check_general(s, path)
        return self.typed(s, path)

    def negation(self, s: dict, path: str) -> Any:
        """`not` of a schema that asserts one thing, exactly: {type} removes types; {required}
        (non-objects pass it, so only objects remain) drops one of the names from a closed
        object; {pattern} (only strings remain) is the pattern's complement where
        regex_syntax can spell it; a bound, the other side's opposite bound; a const or enum,
        the values but those (values_but); an object's properties/required check, the objects
        that fail it (objects_failing); {anyOf: [A, B]} (what merging `not: A` and `not: B`
        gives) is `not: A` with `not: B` left in the rest. Anything else is refused."""
        negated, rest = s["not"], _without(s, "not")
        where = _at(path, "not")
        self.need("not", path)
        n = _assertions(negated) if isinstance(negated, dict) else {}
        if n.keys() == {"anyOf"} and isinstance(n["anyOf"], list) and n["anyOf"]:
            negated, *others = n["anyOf"]
            if others:
                rest = {**rest, "not": others[0] if len(others) == 1 else {"anyOf": others}}
            if negated is False:
                return self.node(rest, path)
            if negated is True or (isinstance(negated, dict) and not _assertions(negated)):
                raise _unsatisfiable(path, "not excludes everything")
            n = _assertions(negated) if isinstance(negated, dict) else {}
        keyword, value = next(iter(n.items())) if len(n) == 1 else (None, None)
        if keyword == "type":
            excluded = set(_type_list(value))
            excluded |= {"integer"} if "number" in excluded else set()
            # (a number that is not an integer is dropped whole: a subset)
            options = [t for t in self.type_options(rest) if t not in excluded]
            kept = [t for t in options if not (t == "number" and "integer" in excluded)]
            if options and not kept:
                raise _error(f"keyword 'not' at {path} is not supported here: it leaves only "
                             "numbers that are not integers, which plait cannot write alone")
            if not kept:
                raise _unsatisfiable(path, "not excludes every type the schema allows")
            return self.node({**rest, "type": kept}, path)
        if keyword == "required" and isinstance(value, list) and value:
            if "type" in rest and "object" not in _type_list(rest["type"]):
                raise _unsatisfiable(path, "not: {required} leaves only objects")
            core = self.node({**rest, "type": "object"}, path)
            options = [o for b in core.get("anyOf", [core])
                       for o in self.without_one_of(b, value, where)]
            if not options:
                raise _unsatisfiable(path, "every object it allows has the names not excludes")
            return options[0] if len(options) == 1 else {"anyOf": options}
        if keyword == "pattern" and isinstance(value, str) and not (
            {"pattern", "format", "not"} & rest.keys()
        ) and ("type" not in rest or "string" in _type_list(rest["type"])):
            self.needs(rest, STRING_KEYWORDS, path)
            regex = json_string_regex_not(value, _count(rest, "minLength", path) or 0,
                                          _count(rest, "maxLength", path), path)
            if regex is not None:
                return {"type": "string", "pattern": regex}
        if keyword in _NEGATED_BOUND and _is_number(value) and not isinstance(value, bool):
            numeric = [t for t in self.type_options(rest) if t in ("integer", "number")]
            if not numeric:
                raise _unsatisfiable(path, f"not: {{{keyword}}} leaves only numbers")
            return self.node({"allOf": [{**rest, "type": numeric},
                                        {_NEGATED_BOUND[keyword]: value}]}, path)
        if isinstance(negated, dict) and "properties" in n and isinstance(
            n["properties"], dict
        ) and n.keys() <= {"properties", "required", "type"} and n.get("type", "object") == "object":
            return self.node({"anyOf": self.objects_failing(n, rest)}, path)
        if keyword in ("const", "enum"):
            if keyword == "enum" and not isinstance(value, list):
                raise _error(f"enum at {where} must be a list")
            return self.node({"anyOf": self.values_but(value if keyword == "enum" else [value],
                                                       rest, path)}, path)
        raise _error(f"keyword 'not' at {path} is not supported here: {where} is not one "
                     "type, required list, anchored pattern, constant, enum or object "
                     "properties check that plait can negate exactly")

    @staticmethod
    def objects_failing(cond: dict, rest: dict) -> list:
        """Raw schemas whose union is `rest` and not `cond`, cond being {properties, required,
        type: object} (the form of an if/then/else discriminator): a non-object if cond asks
        for objects, an object without one of the required names, or one with a declared name
        whose value fails that name's schema."""
        branches: list = []
        if "type" in cond:
            branches.append({"allOf": [rest, {"not": {"type": "object"}}]})
        for name in cond.get("required", []):
            branches.append({"allOf": [rest, {"type": "object", "not": {"required": [name]}}]})
        for name, sub in cond["properties"].items():
            if sub is True:
                continue  # every value passes it
            branches.append({"allOf": [rest, {"type": "object", "required": [name],
                                              "properties": {name: {"not": sub}}}]})
        return branches or [False]

    def values_but(self, excluded: list, rest: dict, path: str) -> list:
        """Raw schemas whose union is `rest` less the values `excluded`, one per JSON type rest
        allows: the other boolean, null unless excluded, numbers in the ranges between the
        excluded ones, strings spelled around the excluded ones (a trie complement); an
        excluded object or array cannot be taken out (refused)."""
        keys = {_canon(v) for v in excluded}
        options = self.type_options(rest)
        if "number" in options and "integer" in options:
            options.remove("integer")
        branches: list = []
        for t in options:
            mine = [v for v in excluded if _json_type(v) == t
                    or (t == "number" and _json_type(v) == "integer")
                    or (t == "integer" and _json_type(v) == "number" and float(v).is_integer())]
            if not mine:
                branches.append({**rest, "type": t})
            elif t in ("boolean", "null"):
                left = [v for v in ((True, False) if t == "boolean" else (None,))
                        if _canon(v) not in keys]
                if left:
                    branches.append({**_without(rest, "type"), "enum": left})
            elif t in ("integer", "number"):
                # exact values (a float would round integers past 2**53)
                points = sorted({_canon(v): int(v) if t == "integer" else v
                                 for v in mine}.values())
                cuts = [None, *points, None]
                for lo, hi in zip(cuts, cuts[1:]):
                    extra: dict = {"type": t}
                    if lo is not None:
                        extra["exclusiveMinimum"] = lo
                    if hi is not None:
                        extra["exclusiveMaximum"] = hi
                    branches.append({"allOf": [rest, extra]})
            elif t == "string":
                if {"pattern", "format", "minLength", "maxLength"} & rest.keys():
                    raise _error(f"keyword 'not' at {path} is not supported here: it excludes "
                                 "strings from a string with a pattern, format or length")
                branches.append({**rest, "type": "string",
                                 "pattern": _pattern_but([str(v) for v in mine])})
            else:
                raise _error(f"keyword 'not' at {path} is not supported here: it excludes "
                             f"{'an object' if t == 'object' else 'an array'} value")
        return branches or [False]

    def type_options(self, s: dict) -> list[str]:
        """The types a schema's outputs may have (as typed() reads them)."""
        if "type" in s:
            return _type_list(s["type"])
        families = list(dict.fromkeys(FAMILY_OF[k] for k in s if k in FAMILY_OF))
        return families or list(JSON_TYPES)

    def without_one_of(self, core: Any, names: list, where: str) -> list:
        """Variants of a core object, each unable to write one of `names` (together: the
        objects that lack at least one of them)."""
        if not _closed_object(core):
            raise _error(f"keyword 'not' at {where} is not supported here: the object allows "
                         "undeclared properties, which could spell the names it excludes")
        out = []
        for name in names:
            if name in core["required"]:
                continue
            props = {k: v for k, v in core["properties"].items() if k != name}
            variant = {**core, "properties": props}
            if all(_canon(variant) != _canon(o) for o in out):
                out.append(variant)
        return out

    def check_general(self, s: dict, path: str) -> None:
        for keyword in s:
            if keyword in ("then", "else") or keyword in FAMILY_OF or keyword == "type":
                continue  # then/else act only with `if`; family keywords are checked per type
            if keyword == "if" and "then" not in s and "else" not in s:
                continue  # `if` alone asserts nothing
            self.need(keyword, path)

    # ------------------------------------------------------------------ enum / const
    def enum(self, schema: dict, s: dict, path: str) -> Any:
        if "enum" in s and not isinstance(s["enum"], list):
            raise _error(f"enum at {path} must be a list")
        values = list(s["enum"]) if "enum" in s else [s["const"]]
        if "enum" in s and "const" in s:
            values = [v for v in values if _canon(v) == _canon(s["const"])]
        rest = _without(s, "enum", "const")
        if rest:  # other keywords: keep exactly the values that pass them (jsonschema decides)
            values = [v for v in values if self.is_valid(v, rest, path)]
        unique = list({_canon(v): v for v in values}.values())
        if not unique:
            raise _unsatisfiable(path, "no value of enum/const passes the other keywords")
        return {"const": unique[0]} if len(unique) == 1 else {"enum": unique}

    def is_valid(self, value: Any, schema: dict, path: str) -> bool:
        try:
            return self.validator.evolve(schema=schema).is_valid(value)
        except Exception as e:  # noqa: BLE001 - unresolvable $ref, bad pattern, ...
            raise _error(f"cannot check enum/const values at {path}: {e}") from None

    # ------------------------------------------------------------------ $ref
    def ref(self, ref: Any, path: str) -> dict:
        pointer = self.pointer_of(ref, path)
        name = self.def_names.get(pointer)
        if name is None:
            name = f"d{len(self.def_names)}"
            self.def_names[pointer] = name
            self.defs[name] = {}  # placeholder while a recursive definition refers to itself
            core = self.node(self.resolve(pointer, path), "$" + pointer.replace("/", "."))
            if core is False:
                raise _unsatisfiable(path, f"$ref {ref!r} is false")
            self.defs[name] = core
        return {"$ref": f"#/$defs/{name}"}

    def check_refs(self, schema: Any, path: str) -> None:
        """Every $ref below `schema` points inside the root and resolves (what ref() would
        find at compile time, found without compiling: the error names the $ref's path)."""
        if isinstance(schema, list):
            for i, sub in enumerate(schema):
                self.check_refs(sub, _at(path, i))
        elif isinstance(schema, dict):
            if isinstance(schema.get("$ref"), str):
                self.resolve(self.pointer_of(schema["$ref"], path), path)
            for key, sub in schema.items():
                if key not in ("const", "enum", "default", "examples"):  # values, not schemas
                    self.check_refs(sub, _at(path, key))

    def pointer_of(self, ref: Any, path: str) -> str:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise _error(
                f"$ref {ref!r} at {path} is not supported: only references inside the schema "
                "(#/...) are"
            )
        return ref[1:]

    def resolve(self, pointer: str, path: str) -> Any:
        target = self.root
        for part in pointer.split("/")[1:]:
            key = urllib.parse.unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(target, list) and key.isdigit() and int(key) < len(target):
                target = target[int(key)]
            elif isinstance(target, dict) and key in target:
                target = target[key]
            else:
                raise _error(f"$ref '#{pointer}' at {path} does not resolve")
        return target

    # ------------------------------------------------------------------ allOf (merging)
    def merge_all(self, schemas: list, path: str) -> Any:
        merged: Any = {}
        for i, schema in enumerate(schemas):
            merged = self.merge(merged, self.inline(schema, _at(path, i), ()), path)
        return merged

    def inline(self, schema: Any, path: str, stack: tuple[str, ...]) -> Any:
        """A raw schema with top-level $ref and allOf expanded (for merging)."""
        if schema is True or schema is False:
            return {} if schema else False
        if not isinstance(schema, dict):
            raise _error(f"{path} is not a schema")
        if len(stack) > _MAX_MERGE_DEPTH:
            raise _error(f"keyword 'allOf' at {path} is not supported here: it nests too deeply")
        out: Any = _without(schema, "$ref", "allOf")
        if _conditional(out):
            out = self.merge(_without(out, *CONDITIONAL_KEYWORDS),
                             self.inline(_cases(out), path, stack), path)
        if "$ref" in schema:
            pointer = self.pointer_of(schema["$ref"], path)
            if pointer in stack:
                raise _error(f"keyword 'allOf' at {path} is not supported here: it contains the recursive "
                             f"$ref {schema['$ref']!r}")
            target = self.inline(self.resolve(pointer, path), path, stack + (pointer,))
            out = self.merge(target, out, path)
        for i, sub in enumerate(schema.get("allOf", [])):
            out = self.merge(out, self.inline(sub, _at(_at(path, "allOf"), i), stack), path)
        return out

    def merge(self, a: Any, b: Any, path: str) -> Any:
        if a is False or b is False:
            return False
        out = dict(a)
        for key, value in b.items():
            if key not in out:
                out[key] = value
            elif key in ASSERTION_KEYWORDS and _canon(out[key]) != _canon(value):
                out[key] = self.merge_keyword(key, out[key], value, path)
        members = {"properties", "additionalProperties", "patternProperties"}
        if members & a.keys() and members & b.keys():  # else one side's members stand as they are
            out.update(self.merge_objects(a, b, path))
        return out

    def merge_keyword(self, key: str, a: Any, b: Any, path: str) -> Any:
        if key == "type":
            return self.merge_types(a, b, path)
        if key == "required":
            return list(dict.fromkeys(list(a) + list(b)))
        if key in _MIN_KEYWORDS and _both_numbers(a, b):
            return max(a, b)
        if key in _MAX_KEYWORDS and _both_numbers(a, b):
            return min(a, b)
        if key == "enum":
            return [v for v in a if _canon(v) in {_canon(x) for x in b}]
        if key in ("items", "propertyNames", "additionalItems") and not isinstance(a, list):
            return _all_of(a, b)
        if key == "uniqueItems":
            return bool(a or b)
        if key == "multipleOf" and all(isinstance(x, int) for x in (a, b)):
            return a * b // math.gcd(a, b)
        if key in ("properties", "additionalProperties", "patternProperties"):
            return a  # merge_objects decides
        if key == "not":
            return {"anyOf": [a, b]}  # neither a nor b: not (a or b)
        if key == "anyOf" and isinstance(a, list) and isinstance(b, list):
            if len(a) * len(b) > _MAX_ANY_OF_PRODUCT:
                raise _error(f"keyword 'allOf' at {path} is not supported here: it joins anyOf "
                             f"lists of {len(a)} and {len(b)} branches (at most "
                             f"{_MAX_ANY_OF_PRODUCT} pairs)")
            return [{"allOf": [x, y]} for x in a for y in b]  # (a1 or a2) and (b1 or b2) ...
        if key == "const":
            raise _unsatisfiable(path, "allOf branches require different constants")
        raise _error(f"keyword 'allOf' at {path} is not supported here: its branches have "
                     f"different '{key}' keywords that cannot be merged exactly")

    def merge_types(self, a: Any, b: Any, path: str) -> list[str]:
        ta, tb = _type_list(a), _type_list(b)
        both = [t for t in ta if t in tb]
        both += ["integer" for x, y in ((ta, tb), (tb, ta)) if "integer" in x and "number" in y]
        if not both:
            raise _unsatisfiable(path, f"allOf branches require types {ta} and {tb}")
        return list(dict.fromkeys(both))

    def merge_objects(self, a: dict, b: dict, path: str) -> dict:
        """Exact conjunction of two branches' properties/additionalProperties: a property of
        one branch must also satisfy the other's additionalProperties."""
        if "patternProperties" in a or "patternProperties" in b:
            raise _error(f"keyword 'allOf' at {path} is not supported here: it merges branches that "
                         "use patternProperties")
        pa, pb = a.get("properties", {}), b.get("properties", {})
        aa, ab = a.get("additionalProperties", True), b.get("additionalProperties", True)
        props = {k: _all_of(pa.get(k, aa), pb.get(k, ab)) for k in list(pa) + list(pb)}
        out: dict = {"properties": props} if props else {}
        if "additionalProperties" in a or "additionalProperties" in b:
            out["additionalProperties"] = _all_of(aa, ab)
        return out

    # ------------------------------------------------------------------ anyOf / oneOf
    def union(self, s: dict, path: str) -> Any:
        if "anyOf" in s and "oneOf" in s:
            raise _error(f"anyOf together with oneOf at {path} is not supported")
        key = "anyOf" if "anyOf" in s else "oneOf"
        self.need(key, path)
        if not isinstance(s[key], list) or not s[key]:
            raise _error(f"{key} at {path} must be a non-empty list")
        rest = _without(s, key)
        raws, cores, branches = [], [], []
        for i, branch in enumerate(s[key]):
            where = _at(_at(path, key), i)
            names, defs = dict(self.def_names), dict(self.defs)
            try:
                # oneOf needs each branch's own keywords (to prove exclusivity): expand its $ref
                raw = self.merge_all([rest, branch], where) if rest or key == "oneOf" else branch
                core = self.node(raw, where)
            except _Unsatisfiable:  # no value passes this branch: it adds nothing
                self.def_names, self.defs = names, defs
                continue
            if core is not False:
                raws.append(raw)
                cores.append(core)
                branches.append(branch)
        if not cores:
            raise _unsatisfiable(path, f"no {key} branch can match")
        if key == "oneOf":
            cores = [self.exclusive(i, cores, raws, branches, path) for i in range(len(cores))]
            cores = [c for c in cores if c is not False]
            if not cores:
                raise _unsatisfiable(path, "every value passes none or several oneOf branches")
        return cores[0] if len(cores) == 1 else {"anyOf": cores}

    def exclusive(self, i: int, cores: list, raws: list, branches: list, path: str) -> Any:
        """Branch i's core, restricted if need be so that none of its outputs passes another
        branch (then oneOf = anyOf): shown as is, or without an optional key another branch
        requires, or else written as branch i and not each branch it may overlap (where plait
        spells those `not`s; False if nothing is left); GrammarError when none of that works."""
        core, overlapping = cores[i], []
        for j, raw in enumerate(raws):
            if j == i or self.never_valid(cores[i], raw):
                continue
            overlapping.append(j)
            if core is not None and not self.never_valid(core, raw):
                narrowed = self.drop_required_of(core, raw)
                core = narrowed if narrowed is not None and self.never_valid(narrowed, raw) else None
        if core is not None:
            return core
        names, defs = dict(self.def_names), dict(self.defs)
        try:
            nots = [{"not": self.inline(branches[j], path, ())} for j in overlapping]
            return self.node(self.merge_all([raws[i], *nots], path), path)
        except _Unsatisfiable:  # every value of branch i passes another branch too
            self.def_names, self.defs = names, defs
            return False
        except GrammarError:
            self.def_names, self.defs = names, defs
            raise _error(
                f"keyword 'oneOf' at {path} is not supported here: branch {i} may also match "
                f"branch {overlapping[0]}, and 'exactly one' cannot be enforced (anyOf can)"
            ) from None

    def never_valid(self, core: Any, raw: Any, depth: int = 0) -> bool:
        """True if no output of `core` can pass the raw schema `raw` (a sufficient test)."""
        core = self.deref(core)
        if raw is False:
            return True
        if not isinstance(raw, dict) or depth > _MAX_UNION_DEPTH:
            return False
        if isinstance(core, dict) and "anyOf" in core:
            return all(self.never_valid(branch, raw, depth) for branch in core["anyOf"])
        for key in ("anyOf", "oneOf"):  # an output that fails every branch fails the union
            branches = raw.get(key)
            if isinstance(branches, list) and branches and self.fails_each(core, branches, depth):
                return True
        produced, accepted = self.core_types(core), self.accepted_types(raw, 0)
        if produced is not None and accepted is not None and not (
            _widen(produced) & _widen(accepted)
        ):
            return True
        values = _values(core)
        if values is not None:
            return not any(self.is_valid(json.loads(v), raw, "oneOf") for v in values)
        return isinstance(core, dict) and core.get("type") == "object" and (
            self.object_excluded(core, raw))

    def fails_each(self, core: Any, branches: list, depth: int) -> bool:
        try:
            return all(self.never_valid(core, self.inline(b, "$", ()), depth + 1)
                       for b in branches)
        except GrammarError:  # a branch that cannot be inlined: not shown
            return False

    def object_excluded(self, core: dict, raw: dict) -> bool:
        required = raw.get("required")
        if _closed_object(core) and isinstance(required, list) and any(
            k not in core["properties"] for k in required
        ):
            return True  # core never writes a key that raw requires
        raw_props = raw.get("properties")
        if not isinstance(raw_props, dict):
            return False
        if raw.get("additionalProperties") is False and not raw.get("patternProperties"):
            if any(k not in raw_props for k in core["required"]):
                return True  # core always writes a key that raw forbids
        for name in core["required"]:  # a discriminator: core's constant fails raw's schema
            values = _values(self.deref(core["properties"][name]))
            sub = raw_props.get(name, True)
            if values is not None and not any(
                _valid_bool(sub) if isinstance(sub, bool)
                else self.is_valid(json.loads(v), sub, "oneOf")
                for v in values
            ):
                return True
        return False

    def drop_required_of(self, core: Any, raw: Any) -> Any:
        """core without the one optional property whose absence fails raw's `required`."""
        if not (isinstance(core, dict) and _closed_object(core) and isinstance(raw, dict)):
            return None
        required = raw.get("required")
        if not isinstance(required, list):
            return None
        optional = [k for k in required if k not in core["required"] and k in core["properties"]]
        if not optional:
            return None
        props = {k: v for k, v in core["properties"].items() if k != optional[0]}
        return {**core, "properties": props}

    def accepted_types(self, raw: Any, depth: int) -> set[str] | None:
        """JSON types a raw schema may accept (None: any, or not worked out)."""
        if raw is False:
            return set()
        if not isinstance(raw, dict) or depth > _MAX_MERGE_DEPTH:
            return None
        raw = self.inline(raw, "$", ()) if "$ref" in raw or "allOf" in raw else raw
        if raw is False:
            return set()
        if "const" in raw or "enum" in raw:
            values = [raw["const"]] if "const" in raw else raw.get("enum", [])
            return {_json_type(v) for v in values} if isinstance(values, list) else None
        types = set(_type_list(raw["type"])) if "type" in raw else None
        for key in ("anyOf", "oneOf"):
            if isinstance(raw.get(key), list):
                parts = [self.accepted_types(b, depth + 1) for b in raw[key]]
                if None not in parts:
                    union = _widen(set().union(*parts))  # type: ignore[arg-type]
                    types = union if types is None else types & union
        return types

    def deref(self, core: Any, depth: int = 0) -> Any:
        while isinstance(core, dict) and "$ref" in core and depth < _MAX_MERGE_DEPTH:
            core = self.defs[core["$ref"].rsplit("/", 1)[1]]
            depth += 1
        return core

    def core_types(self, core: Any) -> set[str] | None:
        """JSON types the outputs of a core schema can have (None: any)."""
        core = self.deref(core)
        if not isinstance(core, dict):
            return None
        if "type" in core:
            return {core["type"]}
        values = _values(core)
        if values is not None:
            return {_json_type(json.loads(v)) for v in values}
        if "anyOf" in core:
            parts = [self.core_types(b) for b in core["anyOf"]]
            return None if None in parts else set().union(*parts)  # type: ignore[arg-type]
        return None

    # ------------------------------------------------------------------ types
    def typed(self, s: dict, path: str) -> Any:
        if "type" in s:
            types = _type_list(s["type"])
        else:  # no type: only the families whose keywords are present can be constrained
            types = list(dict.fromkeys(FAMILY_OF[k] for k in s if k in FAMILY_OF))
            if not types:
                return {}
        if "integer" in types and "number" in types:
            types.remove("integer")
        options = [self.single(t, s, path) for t in types]
        options = [o for o in options if o is not False]
        if not options:
            raise _unsatisfiable(path, "no type can match")
        return options[0] if len(options) == 1 else {"anyOf": options}

    def single(self, type_name: str, s: dict, path: str) -> Any:
        if type_name == "string":
            return self.string(s, path)
        if type_name in ("integer", "number"):
            return self.number(s, path, integer=type_name == "integer")
        if type_name == "object":
            return self.object(s, path)
        if type_name == "array":
            return self.array(s, path)
        return {"type": type_name}

    def needs(self, s: dict, family: frozenset[str], path: str) -> None:
        for keyword in s:
            if keyword in family:
                self.need(keyword, path)

    # ------------------------------------------------------------------ strings
    def string(self, s: dict, path: str) -> dict:
        self.needs(s, STRING_KEYWORDS, path)
        pattern = s.get("pattern")
        fmt = s.get("format")
        if fmt in FORMAT_PATTERNS:
            pattern = FORMAT_PATTERNS[fmt] if pattern is None else _format_and_pattern(
                fmt, pattern, path)
        elif fmt in SPEC_FORMATS:
            raise _error(f"keyword 'format' ({fmt!r}) at {path} is not supported: plait enforces "
                         f"the formats {sorted(FORMAT_PATTERNS)}")
        min_len, max_len = _count(s, "minLength", path) or 0, _count(s, "maxLength", path)
        if pattern is None and min_len == 0 and max_len is None:
            return {"type": "string"}
        return {"type": "string", "pattern": json_string_regex(pattern, min_len, max_len, path)}

    # ------------------------------------------------------------------ numbers
    def number(self, s: dict, path: str, integer: bool) -> Any:
        multiple = s.get("multipleOf", s.get("divisibleBy"))
        if multiple is not None and not integer:
            if not (isinstance(multiple, (int, float)) and float(multiple).is_integer()):
                raise _error(f"keyword 'multipleOf' at {path} is not supported with a fractional "
                             "value")
            integer = True  # numbers that are multiples of a whole number: print integers
        out: dict = {"type": "integer" if integer else "number"}
        lo, lo_open, hi, hi_open = _bounds(s)
        if integer:
            _integer_bounds(out, lo, lo_open, hi, hi_open, path)
        else:
            _number_bounds(out, lo, lo_open, hi, hi_open, path)
        step = _integer_step(multiple, path) if multiple is not None else None
        if step == 1:
            step = None
        small = self.small_range(out, step)
        if small is not None:
            return small
        self.needs(s, NUMBER_KEYWORDS, path)
        if step is not None:
            if "minimum" in out or "maximum" in out:
                # measured: xgrammar drops multipleOf next to a bound (and outlines has neither)
                raise _error(f"keyword 'multipleOf' at {path} together with minimum/maximum is "
                             f"not supported unless the range holds at most {_SMALL_RANGE} "
                             "values")
            out["multipleOf"] = step
        return out

    def small_range(self, out: dict, step: int | None) -> Any:
        """A bounded integer range as an exact enum, when the backend cannot bound integers
        itself or a multipleOf must hold too (None: keep the bounds)."""
        if out["type"] != "integer" or "minimum" not in out or "maximum" not in out:
            return None
        native = {"minimum", "maximum"} <= self.policy.supported
        if native and step is None:
            return None
        first = out["minimum"] if step is None else -(-out["minimum"] // step) * step
        # counted, not len(range(...)): never list a huge range, and len() overflows past
        # 2**63 values (a 64-bit range: OverflowError)
        if (out["maximum"] - first) // (step or 1) + 1 > _SMALL_RANGE:
            return None
        values = list(range(first, out["maximum"] + 1, step or 1))
        if not values:
            raise _unsatisfiable("$", "no integer in range is a multiple of multipleOf")
        return {"const": values[0]} if len(values) == 1 else {"enum": values}

    # ------------------------------------------------------------------ objects
    def object(self, s: dict, path: str) -> Any:
        if any(k in s for k in DEPENDENCY_KEYWORDS):
            return self.dependent(s, path)
        additional = s.get("additionalProperties")
        unevaluated = s.get("unevaluatedProperties")
        if unevaluated is False and additional is None:
            additional = False  # nothing else evaluates properties in a core object
        elif unevaluated not in (None, True, False):
            raise _error(f"keyword 'unevaluatedProperties' at {path} is not supported (only false)")
        patterns = s.get("patternProperties") or {}
        literal = {p: literal_of(p) for p in patterns}
        rest = {p: sub for p, sub in patterns.items() if literal[p] is None}
        if len(rest) < len(patterns):
            # a pattern of one name (`^kafka_topic$`, as protobuf's JSON schemas write them)
            # is that name declared, optional: properties() gives it the pattern's schema, and
            # an additional key cannot take the name (nor, where additional keys are allowed,
            # the name and a newline, which Python's `$` also lets the pattern match)
            raw = dict(s.get("properties") or {})
            for name in literal.values():
                if name is not None:
                    raw.setdefault(name, True)
                    if additional not in (None, False):
                        raw.setdefault(name + "\n", True)
            s = {**_without(s, "patternProperties"), "properties": raw,
                 **({"patternProperties": rest} if rest else {})}
        self.needs(s, OBJECT_KEYWORDS - {"minProperties", "maxProperties"}, path)
        if len(rest) > 1 or (rest and additional not in (None, False)):
            raise _error(f"keyword 'patternProperties' at {path} is not supported with several "
                         "patterns or with additionalProperties (unless each but one pattern "
                         "is one name, `^name$`)")
        required = list(dict.fromkeys(s.get("required", [])))
        props = self.properties(s, required, additional, patterns, path)
        patterns = rest
        out: dict = {"type": "object", "properties": props, "required": required}
        out["additionalProperties"] = (
            False if additional in (None, False) else self.node(additional, _at(path, "additionalProperties"))
        )
        if patterns:
            (regex, sub), = patterns.items()
            where = _at(path, "patternProperties")
            names = [n for n in props if re.search(regex, n)]
            key = json_key_regex(regex, names) if names else json_string_regex(regex, where=where)
            if key is None:  # a pattern key could repeat a declared name (and skip its schema)
                raise _error(f"keyword 'patternProperties' at {path} is not supported when its "
                             f"pattern matches the declared property {names[0]!r} (unless the "
                             "pattern is one character class repeated)")
            out["patternProperties"] = {key: self.node(sub, where)}
        if "propertyNames" in s:
            self.property_names(s["propertyNames"], out, path)
        self.property_counts(s, out, path)
        return out

    def dependent(self, s: dict, path: str) -> Any:
        """An object with dependencies (draft 4-7), dependentRequired or dependentSchemas
        (2019-09 on), exactly: a key whose dependency always applies (it is required) merges
        it in; a conditional key (optional, may appear) doubles the object into a branch
        without the key and one with the key required together with what it brings. The anyOf
        of the satisfiable combinations allows what the schema allows (within the core's
        subset: declared members only)."""
        rest = {**_without(s, *DEPENDENCY_KEYWORDS), "type": "object"}
        required = set(rest.get("required", []))
        declared = rest.get("properties") or {}
        closed = (rest.get("additionalProperties") in (None, False)
                  and not rest.get("patternProperties"))
        always: list = []
        conditional: dict[str, list] = {}
        for key, extra in self.dependencies(s, path).items():
            if key in required:
                always += extra
            elif closed and key not in declared:
                continue  # the key never appears
            elif all(isinstance(d, dict) and set(d) == {"required"}
                     and set(d["required"]) <= required for d in extra):
                continue  # whatever the key brings is required anyway
            elif not closed:
                raise _error(f"keyword 'dependencies' at {path} is not supported on an object "
                             f"that allows undeclared properties (the key {key!r} could not be "
                             "kept out)")
            else:
                conditional[key] = extra
        if len(conditional) > _MAX_CONDITIONAL_KEYS:
            raise _error(f"keyword 'dependencies' at {path} is not supported with more than "
                         f"{_MAX_CONDITIONAL_KEYS} optional keys that bring dependencies "
                         f"({len(conditional)} here: {sorted(conditional)})")
        if conditional:
            self.need("anyOf", path)
        cores: list = []
        first_error: GrammarError | None = None
        for present in itertools.product((True, False), repeat=len(conditional)):
            parts = [rest, *always]
            absent = {k: False for k, p in zip(conditional, present) if not p}
            if absent:
                parts.append({"properties": absent})
            for (key, extra), p in zip(conditional.items(), present):
                if p:
                    parts += [{"required": [key]}, *extra]
            names, defs = dict(self.def_names), dict(self.defs)
            try:
                core = self.node(self.merge_all(parts, path), path)
            except _Unsatisfiable as e:  # this combination cannot hold; undo its $defs
                self.def_names, self.defs = names, defs
                first_error = first_error or e
                continue
            if core is not False and all(_canon(core) != _canon(c) for c in cores):
                cores.append(core)
        if not cores:
            raise first_error or _unsatisfiable(path, "no combination of its dependencies holds")
        return cores[0] if len(cores) == 1 else {"anyOf": cores}

    @staticmethod
    def dependencies(s: dict, path: str) -> dict[str, list]:
        """key -> the raw schemas an object must also pass when it has the key (a list of
        names is the schema that requires them)."""
        out: dict[str, list] = {}
        for keyword in DEPENDENCY_KEYWORDS:
            value = s.get(keyword)
            if value is None:
                continue
            if not isinstance(value, dict):
                raise _error(f"{keyword} at {path} must be an object")
            for key, dep in value.items():
                where = _at(_at(path, keyword), key)
                if isinstance(dep, list) and keyword != "dependentSchemas":
                    if not all(isinstance(n, str) for n in dep):
                        raise _error(f"{where} must be a list of property names")
                    dep = {"required": list(dep)}
                elif keyword == "dependentRequired" or not isinstance(dep, (dict, bool)):
                    raise _error(f"{where} must be a "
                                 + ("list of property names" if keyword == "dependentRequired"
                                    else "schema"))
                out.setdefault(key, []).append(dep)
        return out

    def properties(self, s: dict, required: list, additional: Any, patterns: dict, path: str):
        props = {}
        raw = s.get("properties") or {}
        for name in list(raw) + [r for r in required if r not in raw]:
            where = _at(_at(path, "properties"), name)
            matching = [sub for p, sub in patterns.items() if re.search(p, name)]
            if matching:  # the name's value passes the pattern's schema too
                sub = self.merge_all([raw.get(name, True), *matching], where)
            else:
                sub = raw.get(name, True if additional is None else additional)
            names, defs = dict(self.def_names), dict(self.defs)
            try:
                core = self.node(sub, where)
            except _Unsatisfiable:  # no value passes it: the property cannot be present
                self.def_names, self.defs = names, defs
                core = False
            if core is False:
                if name in required:
                    raise _unsatisfiable(path, f"required property {name!r} cannot be present")
                continue
            props[name] = core
        return props

    def property_names(self, names: Any, out: dict, path: str) -> None:
        where = _at(path, "propertyNames")
        for name in list(out["properties"]):
            if not self.name_allowed(name, names, where):
                if name in out["required"]:
                    raise _unsatisfiable(path, f"required property {name!r} fails propertyNames")
                del out["properties"][name]
        core = self.node(names, where)
        if core is False:
            out["additionalProperties"] = False
            out.pop("patternProperties", None)
            return
        open_keys = out["additionalProperties"] is not False or "patternProperties" in out
        if core == {} or not open_keys:
            return  # declared names were checked above
        if core.get("type") != "string":
            raise _error(f"keyword 'propertyNames' at {path} is not supported (only string schemas)")
        out["propertyNames"] = core

    def name_allowed(self, name: str, names: Any, where: str) -> bool:
        if isinstance(names, bool):
            return names
        return self.is_valid(name, names, where)

    def property_counts(self, s: dict, out: dict, path: str) -> None:
        low = _count(s, "minProperties", path) or 0
        high = _count(s, "maxProperties", path)
        open_keys = out["additionalProperties"] is not False or "patternProperties" in out
        if low > len(out["required"]):  # else implied by the required properties
            self.need("minProperties", path)
            if open_keys:  # a grammar cannot stop an undeclared key from repeating
                raise _error(f"keyword 'minProperties' at {path} is not supported together with "
                             "additional or pattern properties")
            out["minProperties"] = low
        if high is not None and (open_keys or high < len(out["properties"])):
            self.need("maxProperties", path)
            if high < len(out["required"]):
                raise _unsatisfiable(path, "maxProperties is below the required properties")
            out["maxProperties"] = high

    # ------------------------------------------------------------------ arrays
    def array(self, s: dict, path: str) -> Any:
        self.needs(s, ARRAY_KEYWORDS, path)
        items, prefix = s.get("items"), s.get("prefixItems")
        if isinstance(items, list):  # draft <= 2019-09 tuple form
            if prefix is not None:
                raise _error(f"keyword 'items' as a list together with prefixItems at {path} is not "
                             "supported")
            prefix, items = items, s.get("additionalItems")
        unevaluated = s.get("unevaluatedItems")
        if unevaluated not in (None, True, False):
            raise _error(f"keyword 'unevaluatedItems' at {path} is not supported (only false)")
        if items is None and (prefix or unevaluated is False):
            items = False  # only the declared positions (a subset when items was absent)
        out: dict = {"type": "array"}
        low, high = _count(s, "minItems", path) or 0, _count(s, "maxItems", path)
        if prefix:
            out["prefixItems"], high = self.prefix_items(prefix, high, path)
        if items is not None:
            core = self.node(items, _at(path, "items"))
            out["items"] = core
            if core is False and not prefix:
                high = 0
        if high is not None and low > high:
            raise _unsatisfiable(path, "minItems exceeds the items allowed")
        if s.get("uniqueItems") is True and not (high is not None and high <= 1):
            return self.distinct(out, low, high, path)
        if low:
            out["minItems"] = low
        if high is not None:
            out["maxItems"] = high
        return out

    def distinct(self, out: dict, low: int, high: int | None, path: str) -> Any:
        """uniqueItems over items of a few values (an enum, booleans, null): the anyOf of every
        array of distinct values with an allowed length, at most _MAX_UNIQUE_ARRAYS of them.
        Distinct items are otherwise beyond a grammar (refused)."""
        values = None if "prefixItems" in out else _finite_values(self.deref(out.get("items", {})))
        if values is None:
            raise _error(f"keyword 'uniqueItems' at {path} is not supported (a grammar cannot "
                         "enforce distinct items, except over items of a few values)")
        top = len(values) if high is None else min(high, len(values))
        if low > top:
            raise _unsatisfiable(path, f"minItems {low} exceeds the {len(values)} distinct "
                                 "values the items allow")
        count = sum(math.perm(len(values), n) for n in range(low, top + 1))
        if count > _MAX_UNIQUE_ARRAYS:
            raise _error(f"keyword 'uniqueItems' at {path} is not supported here: its items' "
                         f"{len(values)} values make {count} arrays of distinct items (at most "
                         f"{_MAX_UNIQUE_ARRAYS})")
        arrays = [{"type": "array", "prefixItems": [{"const": v} for v in a], "items": False,
                   "minItems": n, "maxItems": n}  # (an enum of arrays: another layout)
                  for n in range(low, top + 1) for a in itertools.permutations(values, n)]
        return arrays[0] if len(arrays) == 1 else {"anyOf": arrays}

    def prefix_items(self, prefix: list, high: int | None, path: str) -> tuple[list, int | None]:
        cores = []
        for i, item in enumerate(prefix):
            core = self.node(item, _at(_at(path, "prefixItems"), i))
            if core is False:  # no array can reach position i
                return cores, i if high is None else min(high, i)
            cores.append(core)
        return cores, high


# ----------------------------------------------------------------------------- helpers
def _type_list(value: Any) -> list[str]:
    types = [value] if isinstance(value, str) else list(value)
    for t in types:
        if t not in JSON_TYPES:
            raise _error(f"unknown type {t!r}")
    return list(dict.fromkeys(types))


def _widen(types: set[str]) -> set[str]:
    return types | ({"number"} if "integer" in types else set()) | (
        {"integer"} if "number" in types else set()
    )


def _closed_object(core: Any) -> bool:
    """A core object that writes only its declared properties."""
    return (
        isinstance(core, dict)
        and core.get("type") == "object"
        and core.get("additionalProperties") is False
        and "patternProperties" not in core
    )


def _valid_bool(schema: bool) -> bool:
    return schema


def _finite_values(core: Any) -> list | None:
    """The values a core schema allows, in its order, if it names them all (enum, const,
    boolean, null); else None."""
    if not isinstance(core, dict):
        return None
    if "const" in core:
        return [core["const"]]
    if "enum" in core:
        return list({_canon(v): v for v in core["enum"]}.values())
    return {"boolean": [True, False], "null": [None]}.get(core.get("type")) if len(core) == 1 else None


def _values(core: Any) -> set[str] | None:
    if not isinstance(core, dict):
        return None
    if "const" in core:
        return {_canon(core["const"])}
    if "enum" in core:
        return {_canon(v) for v in core["enum"]}
    return None


def _both_numbers(a: Any, b: Any) -> bool:
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))


def _count(s: dict, key: str, path: str) -> int | None:
    value = s.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
        isinstance(value, float) and not value.is_integer()
    ):
        raise _error(f"{key} at {path} must be a non-negative integer")
    return int(value)


def _bounds(s: dict) -> tuple[float | None, bool, float | None, bool]:
    """(low, low exclusive?, high, high exclusive?), reading the draft-4 boolean forms too."""
    lo, hi = s.get("minimum"), s.get("maximum")
    lo_open = hi_open = False
    ex_lo, ex_hi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    if ex_lo is True:
        lo_open = lo is not None
    elif _is_number(ex_lo) and (lo is None or ex_lo >= lo):
        lo, lo_open = ex_lo, True
    if ex_hi is True:
        hi_open = hi is not None
    elif _is_number(ex_hi) and (hi is None or ex_hi <= hi):
        hi, hi_open = ex_hi, True
    return lo, lo_open, hi, hi_open


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _format_and_pattern(fmt: str, pattern: str, path: str) -> str:
    """The one regex for a string of a format that matches a pattern too: the format's where
    every string of it matches the pattern (`date` and `^\\d{4}-\\d{2}-\\d{2}$`), the
    pattern where every string it matches is of the format; else refused."""
    format_tree, pattern_tree = parse(FORMAT_PATTERNS[fmt], "json_schema"), parse(
        pattern, "json_schema")
    if includes(pattern_tree, format_tree):
        return FORMAT_PATTERNS[fmt]
    if includes(format_tree, pattern_tree):
        return pattern
    raise _error(f"format {fmt!r} together with pattern {pattern!r} at {path} is not supported "
                 "(plait enforces the two together where the strings of one all match the "
                 "other)")


# xgrammar bounds integers within 64 bits (a bound past them fails its compile): a bound
# beyond is taken in to the 64-bit limit, a subset (`"maximum": 9223372036854776000`, 2**63 - 1
# rounded by a JavaScript writer, allows every 64-bit integer from the minimum up)
_INT64 = (-(2**63), 2**63 - 1)


def _integer_bounds(out: dict, lo, lo_open: bool, hi, hi_open: bool, path: str) -> None:
    if lo is not None:
        out["minimum"] = max(math.floor(lo) + 1 if lo_open else math.ceil(lo), _INT64[0])
    if hi is not None:
        out["maximum"] = min(math.ceil(hi) - 1 if hi_open else math.floor(hi), _INT64[1])
    if out.get("minimum", 0) > _INT64[1] or out.get("maximum", 0) < _INT64[0]:
        raise _error(f"integer bounds at {path} beyond 64 bits are not supported")
    if lo is not None and hi is not None and out["minimum"] > out["maximum"]:
        raise _unsatisfiable(path, "no integer lies within minimum..maximum")


def _number_bounds(out: dict, lo, lo_open: bool, hi, hi_open: bool, path: str) -> None:
    if lo is not None:
        out["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        out["exclusiveMaximum" if hi_open else "maximum"] = hi
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_open or hi_open))):
        raise _unsatisfiable(path, "no number lies within minimum..maximum")


def _integer_step(multiple: Any, path: str) -> int | None:
    """multipleOf for integers: a whole step, or None when every integer qualifies."""
    if not _is_number(multiple) or multiple <= 0:
        raise _error(f"multipleOf at {path} must be a positive number")
    if float(multiple).is_integer():
        return int(multiple)
    inverse = 1 / multiple
    if inverse.is_integer() and math.log2(inverse).is_integer():  # 0.5, 0.25: exact in floats
        return None
    raise _error(f"keyword 'multipleOf' ({multiple}) at {path} is not supported for integers")


_SUBSCHEMA_LISTS = ("anyOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SUBSCHEMA_VALUES = ("items", "additionalProperties", "propertyNames")


def map_subschemas(core: Any, fn) -> Any:
    """Apply fn bottom-up to every object subschema of a core schema (and to the core itself);
    boolean subschemas are left as they are."""
    if not isinstance(core, dict):
        return core
    out = dict(core)
    for key in _SUBSCHEMA_LISTS:
        if key in out:
            out[key] = [map_subschemas(x, fn) for x in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if key in out:
            out[key] = {k: map_subschemas(v, fn) for k, v in out[key].items()}
    for key in _SUBSCHEMA_VALUES:
        if key in out:
            out[key] = map_subschemas(out[key], fn)
    return fn(out)
