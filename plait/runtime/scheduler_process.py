"""The scheduler as a process: ZMQ I/O around Scheduler, plus an in-memory I/O for tests."""

from __future__ import annotations

import logging
import queue
import signal
import traceback
from typing import Any

import torch
import zmq

from plait.args import ServerArgs
from plait.messages import MessageReceiver, MessageSender
from plait.models.tokenizer import load_scheduler_tokenizer
from plait.runtime.scheduler import Scheduler
from plait.runtime.tp_worker import attach_sender, start_rank

logger = logging.getLogger(__name__)


class ZmqSchedulerIO:
    def __init__(self, ctx: zmq.Context, input_addr: str, output_addr: str) -> None:
        self.receiver = MessageReceiver(ctx, input_addr, bind=True)
        self.sender = MessageSender(ctx, output_addr, bind=False)

    def recv(self, timeout_s: float) -> list[Any]:
        msgs = self.receiver.recv_all()
        if not msgs and timeout_s > 0:
            msgs = self.receiver.recv(timeout_ms=int(timeout_s * 1000))
            if msgs:
                msgs += self.receiver.recv_all()
        return msgs

    def send(self, msg: Any) -> None:
        self.sender.send(msg)


class InProcessIO:
    """Queues instead of sockets: drives a Scheduler inside a test process."""

    def __init__(self) -> None:
        self.inbox: queue.Queue = queue.Queue()
        self.outbox: list[Any] = []

    def recv(self, timeout_s: float) -> list[Any]:
        msgs = []
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                return msgs

    def send(self, msg: Any) -> None:
        self.outbox.append(msg)


def model_info(scheduler: Scheduler, model_path: str) -> dict[str, Any]:
    cfg = scheduler.runner.config
    graphs = scheduler.runner.decode_graphs
    return {
        "model_path": model_path,
        "architecture": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "context_length": scheduler.runner.context_length,
        "max_total_tokens": scheduler.runner.kv_pool.size,
        "eos_token_ids": list(cfg.eos_token_ids),
        "dtype": str(scheduler.runner.dtype).removeprefix("torch."),
        "device": str(scheduler.runner.device),
        "attention_backend": scheduler.runner.attn_backend_name,
        "tp_size": scheduler.runner.tp.size,
        "cuda_graphs": graphs.stats() if graphs is not None else None,
    }


def run_scheduler_process(
    args: ServerArgs, model_path: str, input_addr: str, output_addr: str, ready_conn,
    tp_init: str | None = None,
) -> None:
    """Process entry point: build the scheduler, report readiness (or the error), loop.
    With args.tp_size > 1 this is tensor-parallel rank 0 (tp_init: the group's rendezvous)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s scheduler %(levelname)s %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        tp = None
        if args.tp_size > 1:
            tp = start_rank(args, 0, tp_init)
        elif args.num_threads:
            torch.set_num_threads(args.num_threads)
        ctx = zmq.Context()
        io = ZmqSchedulerIO(ctx, input_addr, output_addr)
        tokenizer = load_scheduler_tokenizer(args.tokenizer_path or model_path)
        scheduler = Scheduler(args, model_path, io, tokenizer, tp)
        if tp is not None:  # each forward's inputs go to the other ranks first
            attach_sender(scheduler.runner)
        ready_conn.send({"status": "ready", **model_info(scheduler, model_path)})
    except Exception as e:
        ready_conn.send({"status": "error", "error": f"{type(e).__name__}: {e}",
                         "traceback": traceback.format_exc()})
        return
    finally:
        ready_conn.close()
    try:
        scheduler.run_forever()
    except Exception:
        logger.exception("scheduler crashed")
        raise
