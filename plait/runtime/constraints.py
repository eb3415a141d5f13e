"""Per-request grammar state for the scheduler: compile off the loop, masks, jump-forward."""

from __future__ import annotations

from typing import Any

import torch

from plait.args import ServerArgs
from plait.grammar.base import GrammarError, allocate_token_bitmask
from plait.runtime.core import Req


class ConstraintTracker:
    def __init__(self, args: ServerArgs, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = list(eos_ids)
        self._manager = None
        self._pending: list[tuple[Req, Any]] = []

    @property
    def manager(self):
        if self._manager is None:  # created on first use: unconstrained servers never pay for it
            from plait.grammar.manager import GrammarManager

            self._manager = GrammarManager(
                self.args.grammar_backend,
                self.tokenizer,
                self.vocab_size,
                self.eos_ids,
                compile_timeout=self.args.grammar_compile_timeout,
                cache_dir=self.args.grammar_cache_dir,
            )
        return self._manager

    @property
    def pending(self) -> int:
        return len(self._pending)

    def submit(self, req: Req) -> None:
        kind, spec = req.sampling.constraint
        self._pending.append((req, self.manager.submit(kind, spec)))

    def cancel(self, req: Req) -> None:
        self._pending = [(r, f) for r, f in self._pending if r is not req]

    def poll(self) -> list[tuple[Req, Exception | None]]:
        """Requests whose compile finished: (req, None) with req.grammar set, or (req, error)."""
        done, still = [], []
        for req, fut in self._pending:
            if not fut.done():
                still.append((req, fut))
                continue
            try:
                req.grammar = fut.result().matcher()
                done.append((req, None))
            except GrammarError as e:
                done.append((req, e))
        self._pending = still
        return done

    def stats(self) -> dict[str, Any]:
        return self._manager.stats() if self._manager is not None else {}

    def shutdown(self) -> None:
        if self._manager is not None:
            self._manager.shutdown()

    # ------------------------------------------------------------------ decoding
    def bitmask(self, reqs: list[Req], vocab: int) -> torch.Tensor | None:
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return None
        mask = allocate_token_bitmask(len(reqs), vocab)
        for i in rows:
            reqs[i].grammar.fill_bitmask(mask, i)
        return mask

    def accept(self, req: Req, token: int) -> None:
        m = req.grammar
        if m is None:
            return
        if not m.accept_token(token):
            # cannot happen for masked sampling; a forced token mismatch is a bug worth surfacing
            req.finish("error", message=f"constraint rejected token {token}")
            return
        if m.is_terminated():
            req.finish("stop", matched=token)

    def jump_forward(self, req: Req, limit: int) -> list[int]:
        """Tokens of the text the grammar forces next (canonically tokenized), already
        checked against the matcher (which is left unchanged)."""
        m = req.grammar
        if m is None or m.is_terminated() or limit <= 0:
            return []
        text = m.find_jump_forward_string()
        if not text:
            return []
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:limit]
        accepted = 0
        for tok in ids:
            if not m.accept_token(tok):
                break
            accepted += 1
        if accepted:
            m.rollback(accepted)
        return ids[:accepted]
