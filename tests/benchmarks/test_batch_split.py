"""benchmarks/batch_split.py on a tiny checkpoint: a captured decode step of the C++ layer loop,
replayed as the whole batch and as two halves (side by side on one thread each, and in turn),
gives the same output bits each way, and every way is timed."""

from __future__ import annotations

import json
import sys

import pytest

pytestmark = pytest.mark.model


def test_batch_split_halves_equal_the_whole_batch(checkpoint, fused_ops, tmp_path, monkeypatch):
    from benchmarks import batch_split

    out = tmp_path / "split.json"
    monkeypatch.setattr(sys, "argv", [
        "batch_split", "--model", str(checkpoint("tiny-llama")), "--batch", "6",
        "--context", "40", "--repeats", "2", "--out", str(out)])
    batch_split.main()  # raises AssertionError where a split's output differs
    result = json.loads(out.read_text())
    assert set(result["seconds"]) == {"whole", "side by side", "in turn"}
    assert all(len(v) == 2 and min(v) > 0 for v in result["seconds"].values())


@pytest.mark.parametrize("batch", ["7", "4"])
def test_batch_split_rejects_odd_or_small_batches(monkeypatch, batch):
    """Halves of 1-2 rows run the linears' small-row path (another summation order)."""
    from benchmarks import batch_split

    monkeypatch.setattr(sys, "argv", ["batch_split", "--batch", batch])
    with pytest.raises(SystemExit):
        batch_split.main()
