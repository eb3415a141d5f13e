"""Logprob bookkeeping: which logit rows a batch needs, and recording the input- and
output-token logprobs (with top-k) that requests asked for.

A forward computes logits only for the rows listed by `plan_logit_rows`: first the last row of
each request that samples (in batch order), then prompt rows whose logprobs were requested, then
the rows that verify speculative drafts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from plait.runtime.core import Batch, Req
from plait.runtime.sampler import argmax_suffices


class LogitRows(NamedTuple):
    rows: list[int]  # flattened token rows of the batch whose logits the forward computes
    # batch index -> [(token row, prompt position whose token that row predicts)]
    input_rows: dict[int, list[tuple[int, int]]]
    # batch index -> the token rows before its last one, for a speculative request (its
    # pending token and all but the last draft token: with the last row, they verify the draft)
    draft_rows: dict[int, list[int]] = {}
    # every row only needs its greedy pick (sampler.argmax_suffices): the forward may return
    # the picks instead of the logits
    argmax_only: bool = False
    # batch index -> [(token row, output index of the token that row predicts)], for output
    # tokens emitted before their rows were computed (Req.missing_output_logprobs)
    output_rows: dict[int, list[tuple[int, int]]] = {}


def plan_logit_rows(batch: Batch) -> LogitRows:
    rows: list[int] = []
    input_rows: dict[int, list[tuple[int, int]]] = {}
    draft_rows: dict[int, list[int]] = {}
    output_rows: dict[int, list[tuple[int, int]]] = {}
    offset = 0
    for i, (req, ext) in enumerate(zip(batch.reqs, batch.extend_lens)):
        if req.wants_input_logprobs and req.kv_len < len(req.input_ids):
            first = max(req.logprob_start_len, 1)
            if req.kv_len == 0 == req.logprob_start_len:
                # the first token's None entry is recorded even without a row to compute
                # (a one-token prompt)
                input_rows.setdefault(i, [])
            for pos in range(req.kv_len, req.kv_len + ext):
                if first <= pos + 1 < len(req.input_ids):
                    input_rows.setdefault(i, []).append((offset + pos - req.kv_len, pos + 1))
        if missing := req.missing_output_logprobs:
            # output token j is predicted by the row at position len(input_ids) + j - 1
            n_out = len(req.output_ids)
            for j in range(n_out - missing, n_out):
                pos = len(req.input_ids) + j - 1
                if req.kv_len <= pos < req.kv_len + ext:
                    output_rows.setdefault(i, []).append((offset + pos - req.kv_len, j))
        if batch.samples_token[i]:
            rows.append(offset + ext - 1)
        if batch.draft_ids is not None and ext > 1:
            draft_rows[i] = list(range(offset, offset + ext - 1))
        offset += ext
    extra = sorted({r for pairs in (*input_rows.values(), *output_rows.values())
                    for r, _ in pairs} - set(rows))
    drafts = [r for rs in draft_rows.values() for r in rs]
    argmax_only = not input_rows and not output_rows and all(
        argmax_suffices(req)
        for req, samples in zip(batch.reqs, batch.samples_token) if samples
    )
    return LogitRows(rows + extra + drafts, input_rows, draft_rows, argmax_only, output_rows)


def record_input_logprobs(
    req: Req, logits: torch.Tensor, row_index: dict[int, int], pairs: list[tuple[int, int]]
) -> None:
    """Append req's prompt-token logprobs for the rows of this forward. Called before the
    forward's tokens are committed (req.kv_len is still the position of the first row)."""
    if req.kv_len <= req.logprob_start_len == 0 and not req.input_token_logprobs:
        # the first prompt token has no logprob: SGLang reports it as None
        req.input_token_logprobs.append([None, req.input_ids[0]])
        if req.top_logprobs_num:
            req.input_top_logprobs.append(None)
    if not pairs:
        return
    idx = torch.tensor([row_index[r] for r, _ in pairs])
    rows = torch.log_softmax(logits[idx], dim=-1)  # [len(pairs), V]
    for (_, pos), lp in zip(pairs, rows):
        tok = req.input_ids[pos]
        req.input_token_logprobs.append([float(lp[tok]), tok])
        if req.top_logprobs_num:
            req.input_top_logprobs.append(top_logprobs(lp, req.top_logprobs_num))


def record_missing_output_logprobs(
    req: Req, logits: torch.Tensor, row_index: dict[int, int], pairs: list[tuple[int, int]]
) -> None:
    """Append the logprobs of req's output tokens emitted before this forward computed the
    rows that predict them (pairs: (token row, output index), in output order)."""
    first = len(req.output_ids) - req.missing_output_logprobs
    assert [j for _, j in pairs] == list(range(first, first + len(pairs))), "logprob order"
    idx = torch.tensor([row_index[r] for r, _ in pairs])
    rows = torch.log_softmax(logits[idx].float(), dim=-1)
    for (_, j), lp in zip(pairs, rows):
        record_output_logprob(req, lp, req.output_ids[j])


def record_output_logprob(req: Req, logprobs_row: torch.Tensor, token: int) -> None:
    req.output_token_logprobs.append([float(logprobs_row[token]), token])
    if req.top_logprobs_num:
        req.output_top_logprobs.append(top_logprobs(logprobs_row, req.top_logprobs_num))


def drop_last_output_logprob(req: Req) -> None:
    """Forget the newest output logprob (its token was not emitted after all)."""
    req.output_token_logprobs.pop()
    if req.top_logprobs_num:
        req.output_top_logprobs.pop()


def top_logprobs(logprobs_row: torch.Tensor, k: int) -> list[list]:
    """[[logprob, token_id], ...] of the k most likely tokens."""
    vals, ids = logprobs_row.topk(min(k, logprobs_row.shape[-1]))
    return [[float(v), int(i)] for v, i in zip(vals.tolist(), ids.tolist())]
