"""benchmarks/grammar.py's extraction on a tiny checkpoint: the unconstrained run at matched
lengths gives each request as many tokens as its constrained output, and the report shows
both ratios."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


def test_extraction_matches_lengths_request_by_request(checkpoint):
    from benchmarks.grammar import extraction, markdown

    out = extraction(checkpoint("tiny-llama"), "xgrammar", n=4, repeats=1)
    lengths = out["output_lengths"]
    assert len(lengths) == 4 and lengths == sorted(lengths) and min(lengths) > 0
    on = out["jump_forward_on"]
    assert on["output_tokens"] == sum(lengths)
    # matched: the same tokens in all; the mean-length run: round(mean) each
    assert out["unconstrained_matched"]["output_tokens"] == sum(lengths)
    assert out["unconstrained"]["output_tokens"] == 4 * max(1, round(sum(lengths) / 4))
    assert len(on["repeats"]["matched_s"]) == 1
    assert out["constrained_vs_unconstrained_matched"] == pytest.approx(
        on["out_tok_s"] / out["unconstrained_matched"]["out_tok_s"])
    assert "lengths" not in on and "lengths" not in out["jump_forward_off"]
    res = {"model_name": "tiny", "when": "now", "backends": {"xgrammar": {
        "extraction": out, "compile": {}, "dev": {"error": "skipped"}}}}
    row = next(line for line in markdown(res).splitlines() if line.startswith("| xgrammar |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[3:5] == [f"{out['constrained_vs_unconstrained']:.2f}x",
                          f"{out['constrained_vs_unconstrained_matched']:.2f}x"]


def test_dev_costs_time_each_schema_against_as_many_free_tokens(checkpoint, tmp_path):
    import json

    from benchmarks.grammar import dev_costs, markdown

    schemas = {
        "person.json": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
            "required": ["name", "age"]},
        "long.json": {"type": "object", "properties": {
            "text": {"type": "string", "maxLength": 2048}}, "required": ["text"]},
        "refused.json": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    }
    files = []
    for name, schema in schemas.items():
        (tmp_path / name).write_text(json.dumps(schema))
        files.append(tmp_path / name)
    out = dev_costs(checkpoint("tiny-llama"), "xgrammar", 8, files=files, repeats=1)
    assert out["measured"] == 2 and out["refused"] == 1 and out["speculative_ngram"] == 0
    for row in out["schemas"].values():
        assert 0 < row["tokens"] <= 8
        assert row["cost_ratio"] == pytest.approx(
            row["constrained_s_per_token"] / row["unconstrained_s_per_token"])
    ratios = {k: v["cost_ratio"] for k, v in out["schemas"].items()}
    assert set(ratios) == {"person.json", "long.json"}
    assert out["max_ratio"] == max(ratios.values())
    assert out["over_2x"] == {k: r for k, r in ratios.items() if r > 2.0}
    res = {"model_name": "tiny", "when": "now", "backends": {"xgrammar": {
        "compile": {}, "dev": {"error": "skipped"}, "dev_costs": out}}}
    lines = markdown(res).splitlines()
    row = next(line for line in lines
               if line.startswith("| xgrammar (n-gram speculation off) | 2 |"))
    assert f"{out['max_ratio']:.2f}x" in row
