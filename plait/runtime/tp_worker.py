"""The tensor-parallel ranks other than 0, and what rank 0 sends them.

Rank 0 (the scheduler process) decides every batch; before each forward it broadcasts the
forward's inputs (ForwardInputs, the logit rows) over the group's gloo control channel, with
the req->token rows that changed since it last sent them (new KV slots, a cached prefix
matched at admission, rows the radix cache re-pointed to shared slots). Each other rank keeps
its own copy of the table, applies the changes and runs the same forward on its shard: same
KV slots, its own KV heads. Nothing else (radix tree, grammar, sampling) exists on them.

A message is one int64 tensor, sent as two broadcasts (a fixed header, then the body):
  header: [op, mode, B, T, N, body length]
  body:   input_ids[T] | req_pool_indices[B] | prefix_lens[B] | extend_lens[B] |
          logit_rows[N] | num_updates U | U x (req slot, first position, count) | slots...
"""

from __future__ import annotations

import logging
import signal
import traceback
from dataclasses import dataclass

import torch

from plait.args import ServerArgs
from plait.kernels.base import ForwardMode
from plait.radix_cache.kv_pool import ReqToTokenPool
from plait.runtime.model_runner import ForwardInputs, ModelRunner, _resolve_device
from plait.runtime.parallel import TPGroup, default_cpu_threads, init_tp

logger = logging.getLogger(__name__)

OP_FORWARD = 1
HEADER_LEN = 6
_MODES = [ForwardMode.EXTEND, ForwardMode.DECODE]


@dataclass
class RowUpdate:
    """req_to_token[req_slot, start : start + len(slots)] = slots"""

    req_slot: int
    start: int
    slots: list[int]


@dataclass
class ForwardMessage:
    inputs: ForwardInputs
    logit_rows: list[int]
    row_updates: list[RowUpdate]


def encode(msg: ForwardMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """(header [HEADER_LEN], body) int64 tensors."""
    inp = msg.inputs
    body: list[int] = [
        *inp.input_ids, *inp.req_pool_indices, *inp.prefix_lens, *inp.extend_lens,
        *msg.logit_rows, len(msg.row_updates),
    ]
    for u in msg.row_updates:
        body += [u.req_slot, u.start, len(u.slots)]
    for u in msg.row_updates:
        body += u.slots
    header = [OP_FORWARD, _MODES.index(inp.mode), len(inp.req_pool_indices), len(inp.input_ids),
              len(msg.logit_rows), len(body)]
    return torch.tensor(header, dtype=torch.int64), torch.tensor(body, dtype=torch.int64)


def decode(header: list[int], body: torch.Tensor) -> ForwardMessage:
    _, mode, b, t, n, _ = header
    vals = body.tolist()
    pos = 0

    def take(k: int) -> list[int]:
        nonlocal pos
        pos += k
        return vals[pos - k : pos]

    ids, slots, prefix, ext, rows = take(t), take(b), take(b), take(b), take(n)
    num_updates = take(1)[0]
    spans = [take(3) for _ in range(num_updates)]
    updates = [RowUpdate(slot, start, take(count)) for slot, start, count in spans]
    inputs = ForwardInputs(_MODES[mode], ids, slots, prefix, ext)
    return ForwardMessage(inputs, rows, updates)


class BatchSender:
    """Rank 0's side: broadcast each forward, with the req->token rows the others lack.

    `mirror` is what the other ranks' tables hold (all start zeroed and apply exactly the
    updates sent), so comparing it with rank 0's table finds what changed, wherever the
    scheduler wrote it."""

    def __init__(self, tp: TPGroup, req_to_token: ReqToTokenPool) -> None:
        self.tp = tp
        self.table = req_to_token.req_to_token  # [max_reqs, max_context] int32
        self.mirror = torch.zeros_like(self.table)

    def row_updates(self, inputs: ForwardInputs) -> list[RowUpdate]:
        idx = torch.tensor(inputs.req_pool_indices, dtype=torch.int64, device=self.table.device)
        seq = torch.tensor(inputs.seq_lens, device=self.table.device)
        width = int(max(inputs.seq_lens))
        cur, old = self.table[idx, :width], self.mirror[idx, :width]  # [B, width]
        pos = torch.arange(width, device=self.table.device)
        changed = (cur != old) & (pos[None, :] < seq[:, None])  # only positions in use matter
        rows = changed.any(dim=1).nonzero().flatten().tolist()
        firsts = changed.int().argmax(dim=1).tolist()  # first changed position of each row
        updates = []
        for b in rows:
            slot, start, end = inputs.req_pool_indices[b], firsts[b], inputs.seq_lens[b]
            new = self.table[slot, start:end]
            self.mirror[slot, start:end] = new
            updates.append(RowUpdate(slot, start, new.tolist()))
        return updates

    def send(self, inputs: ForwardInputs, logit_rows: list[int]) -> None:
        header, body = encode(ForwardMessage(inputs, logit_rows, self.row_updates(inputs)))
        self.tp.broadcast_ints(header, HEADER_LEN)
        self.tp.broadcast_ints(body, int(body.numel()))


class BatchReceiver:
    """A rank > 0's side: the next forward from rank 0, its rows applied."""

    def __init__(self, tp: TPGroup, req_to_token: ReqToTokenPool) -> None:
        self.tp = tp
        self.table = req_to_token.req_to_token

    def recv(self) -> ForwardMessage:
        header = self.tp.broadcast_ints(None, HEADER_LEN).tolist()
        if header[0] != OP_FORWARD:
            raise RuntimeError(f"tensor parallel: unknown op {header[0]} from rank 0")
        msg = decode(header, self.tp.broadcast_ints(None, header[-1]))
        for u in msg.row_updates:
            self.table[u.req_slot, u.start : u.start + len(u.slots)] = torch.tensor(
                u.slots, dtype=self.table.dtype
            )
        return msg


def attach_sender(runner: ModelRunner) -> BatchSender:
    """Make rank 0's runner broadcast each forward's inputs before running it."""
    sender = BatchSender(runner.tp, runner.req_to_token_pool)
    runner.forward_hook = sender.send
    return sender


def serve_forwards(runner: ModelRunner, receiver: BatchReceiver) -> None:
    """Run rank 0's forwards on this rank's shard, until the process is stopped or a
    collective fails (rank 0 gone)."""
    while True:
        msg = receiver.recv()
        runner.run(msg.inputs, msg.logit_rows)


def start_rank(args: ServerArgs, rank: int, init_method: str) -> TPGroup:
    """Thread count and process group of one rank (rank 0 too)."""
    device = _resolve_device(args.device)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    elif device.type == "cpu":
        torch.set_num_threads(default_cpu_threads(args.tp_size))  # the ranks share the cores
    return init_tp(rank, args.tp_size, init_method, device)


def run_tp_worker(args: ServerArgs, model_path: str, rank: int, init_method: str, ready_conn) -> None:
    """Process entry point of rank > 0: load this rank's shard, report ready, serve forwards."""
    logging.basicConfig(
        level=args.log_level.upper(), format=f"%(asctime)s tp{rank} %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        tp = start_rank(args, rank, init_method)
        runner = ModelRunner(args, model_path, tp)
        receiver = BatchReceiver(tp, runner.req_to_token_pool)
        ready_conn.send({"status": "ready", "rank": rank})
    except Exception as e:
        ready_conn.send({"status": "error", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()})
        return
    finally:
        ready_conn.close()
    try:
        with torch.inference_mode():
            serve_forwards(runner, receiver)
    except RuntimeError as e:  # a collective failed: rank 0 (or another rank) is gone
        logger.error("tensor parallel rank %d stops: %s", rank, e)
        raise SystemExit(1) from None
