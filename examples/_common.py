"""The command line every example shares: --url, --model, --limit (and its own counts).

    python examples/judge.py [--url http://127.0.0.1:30000] [--model PATH] [--limit N]

No --url runs the program on an in-process engine (plait's default model unless --model
names another); with --url it runs on that `plait serve`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import plait as pl


def run_example(doc: str, main: Callable[..., Any], limit: int, limit_help: str,
                **counts: int) -> Any:
    """Parse the command line, then `main(limit, *counts, backend)`; every keyword of
    `counts` is an integer flag with that default (`branches=3` -> `--branches`). The backend
    is shut down afterwards."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--url", help="a running `plait serve` (default: an in-process engine)")
    parser.add_argument("--model", help="model path or name (default: plait's default model)")
    parser.add_argument("--limit", type=int, default=limit, help=limit_help)
    for name, default in counts.items():
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    backend = pl.RuntimeEndpoint(args.url) if args.url else pl.EngineBackend(args.model)
    try:
        return main(args.limit, *(getattr(args, name) for name in counts), backend)
    finally:
        backend.shutdown()
