"""Model architectures, keyed by config.json's `architectures[0]`.

A model module calls `register_model` for each architecture it serves; this module imports
nothing of plait's, so anything (ServerArgs, ModelConfig) may read it. The built-in model
modules are imported on the first lookup, so reading the registry costs a torch import only
when a model is actually wanted.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

# modules whose import registers the built-in architectures
_BUILTIN_MODULES = ("plait.models.llama",)


@dataclass(frozen=True)
class ModelEntry:
    cls: type
    defaults: dict[str, Any] = field(default_factory=dict)  # config values the arch implies


_REGISTRY: dict[str, ModelEntry] = {}


def register_model(arch_name: str, cls: type, defaults: dict[str, Any] | None = None) -> None:
    """Serve `arch_name` checkpoints with `cls`; `defaults` fill config keys the arch implies."""
    if arch_name in _REGISTRY and _REGISTRY[arch_name].cls is not cls:
        raise ValueError(f"model architecture {arch_name!r} is already registered")
    _REGISTRY[arch_name] = ModelEntry(cls, dict(defaults or {}))


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def model_architectures() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def get_model_entry(arch_name: str | None) -> ModelEntry:
    """The entry for `arch_name`; a ValueError naming the supported ones if there is none."""
    _load_builtins()
    if arch_name not in _REGISTRY:
        raise ValueError(
            f"model architecture {arch_name!r} is not supported "
            f"(supported: {', '.join(sorted(_REGISTRY))})"
        )
    return _REGISTRY[arch_name]
