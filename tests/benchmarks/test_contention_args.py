"""benchmarks/contention.py's plait variants (an A/B of thread counts and OpenMP waits)."""

from __future__ import annotations

import pytest

from benchmarks.contention import SPIN, plait_variant


def test_plait_variants_set_threads_and_spin():
    assert plait_variant("plait", None, "plait") == (None, "plait")
    assert plait_variant("plait-t2", None, "plait") == (2, "plait")
    assert plait_variant("plait-spin:default", 4, "plait") == (4, "default")
    assert plait_variant("plait-t1-spin:bounded", None, "plait") == (1, "bounded")
    assert SPIN["default"]["GOMP_SPINCOUNT"] == "300000" and SPIN["plait"] == {}
    with pytest.raises(SystemExit, match="unknown plait variant"):
        plait_variant("plait-spin:fast", None, "plait")
