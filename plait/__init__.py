"""plait: a runtime for LLM programs."""

from __future__ import annotations

from plait.args import ServerArgs
from plait.sampling import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # heavy modules load on first use so `import plait` stays fast
    if name == "Engine":
        from plait.frontend.engine import Engine

        return Engine
    if name == "Runtime":
        from plait.frontend.runtime import Runtime

        return Runtime
    raise AttributeError(f"module 'plait' has no attribute {name!r}")


__all__ = ["Engine", "Runtime", "SamplingParams", "ServerArgs"]
