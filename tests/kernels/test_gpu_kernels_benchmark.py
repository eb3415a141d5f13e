"""benchmarks/gpu_kernels.py runs on a GPU only, but its check/timing/report code is exercised
here on tiny shapes under the Triton interpreter (`--cpu-smoke`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


@pytest.mark.heavy
def test_gpu_kernel_benchmark_cpu_smoke(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_kernels", "--cpu-smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((tmp_path / "gpu_kernels.json").read_text())
    kernels = {r["kernel"] for r in report["results"]}
    assert kernels == {"store_kv", "extend", "decode"}
    assert all(r["ok"] for r in report["results"])
    assert report["environment"]["interpreter"] is True
    table = (tmp_path / "gpu_kernels.md").read_text()
    assert "of the measured copy bandwidth" in table
