"""JSON-schema `format`s as exact regexes for the string's value.

Each regex accepts only strings that the strictest common checker accepts (jsonschema's
FORMAT_CHECKER with its `format-nongpl` checkers installed, as the dev extras do: rfc3986-validator
for uri, fqdn, isoduration, jsonpointer, rfc3987-syntax for iri; Python's datetime/ipaddress/
uuid parsers): a subset of the format, never more.
Neither backend's own format support is used: both were found to accept invalid values
(xgrammar: 2020-02-30, ipv4 leading zeros; outlines: Unicode digits in dates, time without
offset). Spec formats missing here are refused; non-spec formats ("int32", "password") are
annotations and ignored.
"""

from __future__ import annotations

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"  # 0001-9999 (Python's range)
# leap years; 0000 is left out (Python's date starts at year 1)
_LEAP_YEAR = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    r"(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    r"|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE = rf"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME_OFFSET = r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# RFC 3339 full-time; no leap second (60): Python's datetime rejects it
TIME = rf"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{{1,6}})?{_TIME_OFFSET}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
# A label of any length, for uri (RFC 3986's reg-name sets no label limit). xgrammar keeps no
# mask cache for a counted repetition like {0,61}: on plait-tiny's 100k vocabulary those fills
# made a uri string cost 3x an unconstrained token (JsonSchemaStore/host-meta.json 3.06x ->
# 1.59-1.62x with this label, `benchmarks/grammar.py`'s dev costs). email keeps its bounded
# labels: unbounded ones measured slower there (Github_easy/o76909.json 2.49x -> 2.83-2.96x).
_ANY_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
# An IDNA-valid ASCII label (idna.encode, jsonschema's idn-hostname checker, refuses hyphens in
# both the 3rd and 4th places, "ab--cd", besides a hyphen at either end and over 63
# characters): from 4 characters on the 3rd is a letter or digit (a subset).
_IDN_LABEL = (r"[A-Za-z0-9](?:[A-Za-z0-9]"
              r"|[A-Za-z0-9-][A-Za-z0-9](?:[A-Za-z0-9-]{0,59}[A-Za-z0-9])?)?")
_HEX4 = r"[0-9a-f]{1,4}"
# A uri's path and query leave out RFC 3986's percent-encoding: a % alone is no URI (rfc3987,
# jsonschema's uri checker, refuses "https://a/%_"), and the exact `(?:[...]|%[0-9A-Fa-f]{2})*`
# is an alternation repeated, which xgrammar masks without its cache: a uri under maxLength
# 2048 cost 1.49x an unconstrained token on SmolLM2 that way, 0.92x without it.

_SEGMENT = r"[A-Za-z0-9._~!$&'()*+,;=:@-]"
_QUERY = r"(?:\?[A-Za-z0-9._~!$&'()*+,;=:@/?-]*)?"
_URI = (rf"https?://{_ANY_LABEL}(?:\.{_ANY_LABEL})*(?::[1-9][0-9]{{0,3}})?(?:/{_SEGMENT}*)*"
        rf"{_QUERY}")
_EMAIL = rf"[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*@{_LABEL}(?:\.{_LABEL}){{1,2}}"
_URI_REFERENCE = rf"(?:{_URI}|/(?:{_SEGMENT}+(?:/{_SEGMENT}*)*)?{_QUERY})"
_POINTER = r"(?:/(?:[^~/]|~[01])*)*"
_DUR_TIME = r"T(?:[0-9]+H(?:[0-9]+M(?:[0-9]+S)?)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DURATION = (rf"P(?:(?:[0-9]+D|[0-9]+M(?:[0-9]+D)?|[0-9]+Y(?:[0-9]+M(?:[0-9]+D)?)?)"
             rf"(?:{_DUR_TIME})?|{_DUR_TIME}|[0-9]+W)")

FORMAT_PATTERNS: dict[str, str] = {
    "date": DATE,
    "time": TIME,
    "date-time": rf"{DATE}T{TIME}",
    "uuid": r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    "ipv4": rf"{_OCTET}(?:\.{_OCTET}){{3}}",
    # the full eight-group form only (a subset of RFC 4291 text forms)
    "ipv6": rf"{_HEX4}(?::{_HEX4}){{7}}",
    # at most 3 labels of <= 63 characters: well under the 253-character limit
    "hostname": rf"{_LABEL}(?:\.{_LABEL}){{0,2}}",
    # ASCII hostnames are internationalized ones (RFC 5890) when IDNA takes their labels
    "idn-hostname": rf"{_IDN_LABEL}(?:\.{_IDN_LABEL}){{0,2}}",
    "email": _EMAIL,
    "uri": _URI,
    # an absolute uri, or a path from the root (RFC 3986 path-absolute) with its query
    "uri-reference": _URI_REFERENCE,
    # ASCII IRIs: every uri is an iri (RFC 3987)
    "iri": _URI,
    "iri-reference": _URI_REFERENCE,
    # RFC 6570: a uri without expressions is a template of itself
    "uri-template": _URI,
    # ASCII addresses are internationalized ones (RFC 6531)
    "idn-email": _EMAIL,
    # RFC 6901: "/"-separated tokens, `~` only as ~0 or ~1
    "json-pointer": _POINTER,
    # a non-negative integer, then `#` or a json-pointer; no digit after a 0 (jsonschema's
    # checker refuses one, "100" too, not only a leading zero)
    "relative-json-pointer": rf"(?:0|[1-9]+0?)(?:#|{_POINTER})",
    # RFC 3339 appendix A (ISO 8601): years, months, days, then a time; or weeks
    "duration": _DURATION,
}

# Formats defined by JSON Schema 2020-12 (and earlier drafts): asserting validators check these,
# so one we cannot enforce must be refused rather than ignored.
SPEC_FORMATS = frozenset(
    {
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
        "uri-template", "json-pointer", "relative-json-pointer", "regex", "color", "host-name",
        "ip-address", "utc-millisec",
    }
)
