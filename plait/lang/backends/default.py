"""The backend a program runs on when it names none, and what a `backend=` argument may be.

A leaf of the language: the interpreter (program.py) and the public functions (api.py) both
read it, and it imports neither.
"""

from __future__ import annotations

import weakref
from typing import Any

from plait.lang.backends.base import Backend
from plait.lang.backends.engine import EngineBackend

# The backend programs use when run() names none (SGLang's global_config.default_backend).
_default_backend: dict[str, Backend | None] = {"backend": None}
_engine_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_default_backend(backend: Any) -> None:
    """A RuntimeEndpoint, Runtime, EngineBackend, OpenAI, or a plait.Engine."""
    _default_backend["backend"] = resolve_backend(backend) if backend is not None else None


def get_default_backend() -> Backend | None:
    return _default_backend["backend"]


def resolve_backend(backend: Any = None) -> Backend:
    backend = backend if backend is not None else _default_backend["backend"]
    if backend is None:
        raise ValueError(
            "no backend: call pl.set_default_backend(...) (e.g. pl.EngineBackend(), "
            "pl.RuntimeEndpoint(url)) or pass backend=..."
        )
    if isinstance(backend, Backend):
        return backend
    from plait.engine import Engine

    if isinstance(backend, Engine):
        if backend not in _engine_backends:
            _engine_backends[backend] = EngineBackend(backend)
        return _engine_backends[backend]
    raise TypeError(f"not a backend: {type(backend).__name__}")
