"""Wall-clock time per scheduler phase (forward, sample, schedule, grammar, io)."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class StepTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start
            self.calls[phase] += 1

    def summary(self) -> dict[str, dict[str, float]]:
        return {p: {"seconds": s, "calls": self.calls[p]} for p, s in self.seconds.items()}

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
