"""Entry point of plait's child processes: `python -m plait.frontend.child ROLE FD`.

Children are started with subprocess rather than multiprocessing so that a user's script is
never re-imported (no `if __name__ == "__main__"` requirement) and nothing is forked from a
process whose threads are running. The configuration (JSON) arrives on stdin, not in argv,
which any user can read (/proc/PID/cmdline). Readiness (or the start-up error) is written as
one JSON document to the inherited pipe FD.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from plait.args import ServerArgs


def _exit_with_parent(parent: int) -> None:
    """A child never outlives the process that started it (a script that exits without
    shutting its Engine down, or is killed): it exits once it is re-parented."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class ReadyPipe:
    """The child's end of the readiness pipe (the `send`/`close` used by the process mains)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def send(self, info: dict) -> None:
        os.write(self.fd, json.dumps(info).encode())

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def main() -> None:
    role, fd = sys.argv[1], int(sys.argv[2])
    config = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    ready = ReadyPipe(fd)
    _exit_with_parent(os.getppid())
    if role == "scheduler":
        from plait.runtime.scheduler_process import run_scheduler_process

        args = ServerArgs(**config["args"])
        run_scheduler_process(args, config["model_path"], config["input"], config["output"], ready,
                              config.get("tp_init"))
    elif role == "tp_worker":  # a tensor-parallel rank > 0
        from plait.runtime.tp_worker import run_tp_worker

        args = ServerArgs(**config["args"])
        run_tp_worker(args, config["model_path"], config["rank"], config["tp_init"], ready)
    elif role == "detokenizer":
        from plait.frontend.detokenizer import run_detokenizer_process

        run_detokenizer_process(config["tokenizer_path"], config["input"], config["output"], ready)
    else:
        raise SystemExit(f"unknown role {role!r}")


if __name__ == "__main__":
    main()
