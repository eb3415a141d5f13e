"""Backends the interpreter runs programs on (see base.py for the contract)."""

from __future__ import annotations

from plait.lang.backends.base import Backend, BackendError, UnsupportedFeature, Usage
from plait.lang.backends.engine import EngineBackend
from plait.lang.backends.openai import OpenAI
from plait.lang.backends.runtime_endpoint import Runtime, RuntimeEndpoint

__all__ = [
    "Backend",
    "BackendError",
    "EngineBackend",
    "OpenAI",
    "Runtime",
    "RuntimeEndpoint",
    "UnsupportedFeature",
    "Usage",
]
