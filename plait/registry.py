"""The registries of plait's pluggable parts: name -> "module:attribute", imported on use.

Attention backends, grammar backends and schedule policies register here (built-ins below;
`register_*` adds more at run time), and `ServerArgs` reads its choices from these tables,
so a part added through a registry can be selected from the CLI and keyword arguments.
Targets are strings so that listing the choices imports nothing heavy (`plait serve --help`
stays instant and an optional dependency fails only when its part is selected).
"""

from __future__ import annotations

import importlib
from typing import Any


class Registry:
    def __init__(self, kind: str, builtins: dict[str, str]) -> None:
        self.kind = kind  # the ServerArgs field it feeds, used in error messages
        self._targets = dict(builtins)

    def register(self, name: str, target: str) -> None:
        """target: "package.module:attribute", imported when `name` is first used."""
        if ":" not in target:
            raise ValueError(f"{self.kind}: target must be 'module:attribute', got {target!r}")
        self._targets[name] = target

    def names(self) -> tuple[str, ...]:
        return tuple(self._targets)

    def __contains__(self, name: str) -> bool:
        return name in self._targets

    def target(self, name: str) -> tuple[str, str]:
        if name not in self._targets:
            raise ValueError(
                f"{self.kind}: unknown {self.kind.replace('_', ' ')} {name!r} "
                f"(known: {', '.join(sorted(self._targets))})"
            )
        module, attr = self._targets[name].split(":")
        return module, attr

    def load(self, name: str) -> Any:
        module, attr = self.target(name)
        return getattr(importlib.import_module(module), attr)


ATTENTION_BACKENDS = Registry("attention_backend", {
    "torch": "plait.kernels.torch_backend:TorchAttnBackend",
    "triton": "plait.kernels.triton_backend:TritonAttnBackend",
    "flashattn": "plait.kernels.flashattn_backend:FlashAttnBackend",
})
GRAMMAR_BACKENDS = Registry("grammar_backend", {
    "xgrammar": "plait.grammar.xgrammar_backend:XGrammarBackend",
    "outlines": "plait.grammar.outlines_backend:OutlinesBackend",
})
# a policy is a function (waiting requests, KVManager) -> waiting requests in admission order
SCHEDULE_POLICIES = Registry("schedule_policy", {
    "lpm": "plait.runtime.schedule_policy:order_lpm",
    "fcfs": "plait.runtime.schedule_policy:order_fcfs",
})
# weight-only quantized linears (--quantization): a module class built from (weight, bias)
QUANTIZATION_METHODS = Registry("quantization", {
    "int8": "plait.kernels.woq:Int8Linear",
    "int4": "plait.kernels.woq:Int4Linear",
})
