"""Constraint specs: validation and the canonical text used as a cache key."""

from __future__ import annotations

import json
from typing import Any

from plait.grammar.base import GRAMMAR_KINDS, GrammarError


def choices_of(spec: str) -> list[str]:
    """The alternatives of a "choices" spec (a JSON list of non-empty strings)."""
    try:
        options = json.loads(spec)
    except (json.JSONDecodeError, TypeError) as e:
        raise GrammarError(f"choices: not a JSON list ({e})", "choices") from None
    if not isinstance(options, list) or not options:
        raise GrammarError("choices: must be a non-empty list of strings", "choices")
    if not all(isinstance(o, str) and o for o in options):
        raise GrammarError("choices: every choice must be a non-empty string", "choices")
    return options


def json_object_schema() -> dict:
    """Any JSON object (the json_object kind)."""
    return {"type": "object", "additionalProperties": True}


def canonical_spec(kind: str, spec: str) -> str:
    """Equal constraints get equal text (JSON re-serialized compactly, keys sorted), except
    for the order of a schema's `properties`, which is the order they are generated in (all
    sorted, schemas that differed only there shared one cache entry, and the second was
    generated in the first one's order)."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown constraint kind {kind!r} (known: {', '.join(GRAMMAR_KINDS)})")
    if kind == "json_object":
        return ""
    if kind in ("json_schema", "choices", "structural_tag"):
        try:
            return json.dumps(_sort_keys(json.loads(spec)), separators=(",", ":"))
        except (json.JSONDecodeError, TypeError) as e:
            raise GrammarError(f"{kind}: not valid JSON ({e})", kind) from None
    if not isinstance(spec, str) or not spec:
        raise GrammarError(f"{kind}: must be a non-empty string", kind)
    return spec


def _sort_keys(value: Any, ordered: bool = False) -> Any:
    """value with every object's keys sorted but a `properties` object's (`ordered`)."""
    if isinstance(value, dict):
        keys = value if ordered else sorted(value)
        return {k: _sort_keys(value[k], k == "properties" and not ordered) for k in keys}
    if isinstance(value, list):
        return [_sort_keys(v) for v in value]
    return value
