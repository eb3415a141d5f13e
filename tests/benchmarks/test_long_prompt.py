"""benchmarks/long_prompt.py end to end on a tiny checkpoint: real `plait serve` processes over
HTTP, every request answered, each engine's figures written (no timing is asserted)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model


def test_long_prompt_benchmark_runs_each_plait_variant(checkpoint, tmp_path):
    from benchmarks.long_prompt import main

    out = tmp_path / "long.json"
    main(["--model", checkpoint("tiny-llama"), "--prompt-tokens", "300", "--engines",
          "plait,plait-share0", "--repeats", "1", "--delays", "0.05,0.1",
          "--stream-tokens", "6", "--out", str(out)])
    got = json.loads(out.read_text())
    assert set(got["results"]) == {"plait", "plait-share0"}
    for r in got["results"].values():
        assert r["long_s"] > 0 and set(r["short_s"]) == {"0.05", "0.1"}
        assert len(r["rounds"]) == 1 and r["stream_max_gap_s"] > 0


def test_long_prompt_benchmark_refuses_unknown_engines_and_too_long_prompts(checkpoint):
    from benchmarks.long_prompt import main

    with pytest.raises(SystemExit):
        main(["--engines", "plait,sglang"])
    with pytest.raises(SystemExit):
        main(["--model", checkpoint("tiny-llama"), "--prompt-tokens", "5000"])
