"""Process launch: every process plait starts, and the entry point of its children.

- `launch_children(args)` starts the scheduler and detokenizer (and tensor-parallel ranks) as
  `ChildProcess`es and returns them as `ChildProcesses`, which supervise and stop them; the HTTP
  server (`plait serve`) and the offline `plait.Engine` both run on it.
- `python -m plait.launch ROLE FD` is a child's entry point (`child_main`). Children are
  started with subprocess rather than multiprocessing so that a user's script is never
  re-imported (no `if __name__ == "__main__"` requirement) and nothing is forked from a process
  whose threads are running. Readiness (or the start-up error) is written as one JSON document
  to the inherited pipe FD.
- `ServerProcess(model_path, **server_args)` runs a whole `plait serve` in a subprocess on a
  free port (the language's `pl.Runtime` backend and the tests use it; `plait serve --dp N`
  starts its replicas with the same `cli_flags` and `free_port`).

A child that dies is not restarted: its requests' state (KV cache, running requests) is gone
with it, and a clean restart of the whole server is both simpler and safer. `plait serve`
exits non-zero within CHILD_DEATH_EXIT_S of the death (so that a supervisor restarts it);
`plait.Engine` fails the requests in flight and every later call with the reason.
Children get their configuration on stdin, never in argv (`ps` shows argv to every user).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from plait.args import API_KEY_ENV, ServerArgs
from plait.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
# ServerProcess: how long a `plait serve` subprocess may take to stop before it is killed
STOP_TIMEOUT_S = 20.0
# how often the supervisor thread polls the children
CHILD_POLL_S = 0.2
# after a child died, the server is stopped gracefully; past this many seconds it is killed
CHILD_DEATH_EXIT_S = 4.0
CHILD_DIED_EXIT_CODE = 1


@dataclass
class IpcAddrs:
    scheduler_input: str
    detokenizer_input: str
    tokenizer_input: str

    @classmethod
    def in_dir(cls, path: str) -> IpcAddrs:
        return cls(f"ipc://{path}/scheduler", f"ipc://{path}/detokenizer", f"ipc://{path}/tokenizer")


@dataclass
class ChildProcesses:
    """The children one server (or Engine) started: supervised together, stopped together."""

    args: ServerArgs
    model_path: str
    addrs: IpcAddrs
    ipc_dir: str
    procs: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    owns_ipc_dir: bool = True
    failure: str | None = None  # why a child died, once one did
    _stopping: bool = False

    def supervise(self, on_death: Callable[[str], None], hard_exit_s: float | None = None) -> None:
        """Watch the children from a daemon thread: the first one that exits (outside
        shutdown) sets `failure` and calls on_death(reason) once. With hard_exit_s, the
        process exits with CHILD_DIED_EXIT_CODE if it is still running that long after."""

        def watch() -> None:
            while not self._stopping:
                dead = [(n, p) for n, p in self.procs.items() if not p.is_alive()]
                if dead and not self._stopping:
                    name, proc = dead[0]
                    self.failure = f"the {name} process died (exit code {proc.exitcode})"
                    # killed by SIGTERM/SIGINT: someone is stopping this process group (systemd,
                    # `timeout`, Ctrl-C in a shell), not a crash
                    stopped = proc.exitcode in (-signal.SIGTERM, -signal.SIGINT)
                    logger.log(logging.WARNING if stopped else logging.ERROR,
                               "%s; stopping the server", self.failure)
                    on_death(self.failure)
                    if hard_exit_s is not None:
                        time.sleep(hard_exit_s)
                        logger.error("server did not stop in %.0f s after %s; exiting",
                                     hard_exit_s, self.failure)
                        self.shutdown()
                        os._exit(CHILD_DIED_EXIT_CODE)
                    return
                time.sleep(CHILD_POLL_S)

        threading.Thread(target=watch, name="child-supervisor", daemon=True).start()

    def exit_if_failed(self) -> None:
        """If a child died: stop the other children and exit the process now with
        CHILD_DIED_EXIT_CODE (skipping interpreter finalization, which takes seconds with
        the tokenizer loaded), so that a supervisor restarts the server promptly."""
        if self.failure is None:
            return
        self.shutdown()
        print(f"plait serve: {self.failure}; exiting with status {CHILD_DIED_EXIT_CODE} so that "
              "a supervisor restarts the server", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(CHILD_DIED_EXIT_CODE)

    def shutdown(self) -> None:
        self._stopping = True
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        if self.owns_ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
        else:  # the user's directory stays; the sockets this server bound there go
            for addr in dataclasses.astuple(self.addrs):
                with contextlib.suppress(OSError):
                    os.unlink(addr.removeprefix("ipc://"))


class ChildProcess:
    """A child started with subprocess, with the few Process-like methods ChildProcesses uses."""

    def __init__(self, name: str, role: str, config: dict[str, Any]) -> None:
        self.name = name
        read_fd, write_fd = os.pipe()
        cmd = [sys.executable, "-m", "plait.launch", role, str(write_fd)]
        # bounded OpenMP spinning in the children: plait/runtime/child_env.py says why
        from plait.runtime.child_env import child_env

        self.popen = subprocess.Popen(
            cmd, pass_fds=(write_fd,), start_new_session=False, stdin=subprocess.PIPE,
            env=child_env(),
        )
        os.close(write_fd)
        self.ready_fd = read_fd
        # the configuration goes through stdin: argv is world-readable (/proc/PID/cmdline)
        try:
            self.popen.stdin.write(json.dumps(config).encode())
            self.popen.stdin.close()
        except BrokenPipeError:  # the child died at once; wait_ready reports it
            pass

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.is_alive():
            self.popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        """Block until the child reports; raises with the child's error otherwise."""
        chunks, deadline = [], time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"the {self.name} process did not start within {timeout:.0f} s")
                ready, _, _ = select.select([self.ready_fd], [], [], min(left, 1.0))
                if not ready:
                    if not self.is_alive():
                        raise RuntimeError(
                            f"the {self.name} process exited during start-up (code {self.exitcode})"
                        )
                    continue
                data = os.read(self.ready_fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(self.ready_fd)
        if not chunks:
            raise RuntimeError(f"the {self.name} process exited during start-up (code {self.exitcode})")
        info = json.loads(b"".join(chunks))
        if info.get("status") != "ready":
            # a ValueError is plait's own named error (a bad checkpoint, an option the model
            # does not fit): its message says it all; anything else is a bug, shown in full
            expected = info.get("error", "").startswith("ValueError: ")
            logger.log(logging.DEBUG if expected else logging.ERROR, "%s start-up failed:\n%s",
                       self.name, info.get("traceback", ""))
            raise ValueError(f"{self.name} failed to start: {info.get('error')}")
        return info


IPC_PREFIX = "plait-ipc-"  # + the launching process's pid + "-" + mkdtemp's random part


def remove_stale_ipc_dirs(root: str | None = None) -> list[str]:
    """Remove the ipc dirs (sockets only) that earlier launches of this user left in the temp
    dir when killed before their shutdown ran (SIGKILL): those whose launching process is gone
    and whose sockets no process listens on (a pid from another pid namespace sharing the temp
    dir would look gone). Returns the removed paths."""
    root = root or tempfile.gettempdir()
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            pid = entry.name[len(IPC_PREFIX):].split("-", 1)[0]
            if not (entry.name.startswith(IPC_PREFIX) and pid.isdigit()):
                continue
            try:
                if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                    continue
                os.kill(int(pid), 0)  # alive (or another user's): keep it
            except ProcessLookupError:
                if not _listened_on(entry.path):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
            except OSError:
                continue
    return removed


def _listened_on(directory: str) -> bool:
    """Some Unix socket in the directory accepts a connection."""
    for entry in os.scandir(directory):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.5)
            try:
                probe.connect(entry.path)
                return True
            except OSError:
                continue
    return False


def launch_children(args: ServerArgs) -> ChildProcesses:
    """Start detokenizer and scheduler; returns once both are ready (or raises)."""
    model_path = resolve_model_path(args.resolved_model_path)
    if args.ipc_dir:
        try:
            os.makedirs(args.ipc_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"ipc_dir: cannot use {args.ipc_dir!r} as a directory ({e})") from None
    if not args.ipc_dir:
        remove_stale_ipc_dirs()
    ipc_dir = args.ipc_dir or tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
    rt = ChildProcesses(args, model_path, IpcAddrs.in_dir(ipc_dir), ipc_dir,
                          owns_ipc_dir=args.ipc_dir is None)
    try:
        rt.procs["detokenizer"] = ChildProcess("detokenizer", "detokenizer", {
            "tokenizer_path": args.tokenizer_path or model_path,
            "input": rt.addrs.detokenizer_input, "output": rt.addrs.tokenizer_input,
        })
        tp_init = _tp_rendezvous(args, model_path, ipc_dir)
        rt.procs["scheduler"] = ChildProcess("scheduler", "scheduler", {
            # the scheduler never checks the API key: it does not get it at all
            "args": dataclasses.asdict(args.replace(api_key=None)), "model_path": model_path,
            "input": rt.addrs.scheduler_input, "output": rt.addrs.detokenizer_input,
            "tp_init": tp_init,
            # the engine's own processes: the tuner does not count their CPU as host load
            "engine_pids": [os.getpid(), rt.procs["detokenizer"].popen.pid],
        })
        for rank in range(1, args.tp_size):  # tensor-parallel ranks > 0: forwards only
            rt.procs[f"tp{rank}"] = ChildProcess(f"tp{rank}", "tp_worker", {
                "args": dataclasses.asdict(args.replace(api_key=None)), "model_path": model_path,
                "rank": rank,
                "tp_init": tp_init,
            })
        rt.procs["detokenizer"].wait_ready(STARTUP_TIMEOUT_S)
        ranks = [rt.procs["scheduler"]] + [rt.procs[f"tp{r}"] for r in range(1, args.tp_size)]
        rt.model_info = _wait_all_ready(ranks, STARTUP_TIMEOUT_S)[0]
    except BaseException:
        rt.shutdown()
        raise
    return rt


def _tp_rendezvous(args: ServerArgs, model_path: str, ipc_dir: str) -> str | None:
    """The tensor-parallel group's rendezvous (a file store in the private ipc dir), after
    checking the model splits over args.tp_size ranks (a ValueError naming what does not)."""
    if args.tp_size == 1:
        return None
    from plait.models.config import ModelConfig
    from plait.runtime.parallel import check_tp_divisible

    check_tp_divisible(ModelConfig.from_dir(model_path), args.tp_size)
    store = os.path.join(ipc_dir, "tp_store")
    if os.path.exists(store):  # left by an earlier run in a user-given ipc dir
        os.remove(store)
    return f"file://{store}"


def _wait_all_ready(children: list[ChildProcess], timeout: float) -> list[dict[str, Any]]:
    """Wait for processes that start together (the TP ranks meet in collectives): the first
    failure is raised at once instead of after the others' collectives time out."""
    if len(children) == 1:
        return [children[0].wait_ready(timeout)]
    from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

    pool = ThreadPoolExecutor(len(children))
    try:
        futures = [pool.submit(c.wait_ready, timeout) for c in children]
        wait(futures, return_when=FIRST_EXCEPTION)
        for f in futures:
            if f.done() and f.exception() is not None:
                raise f.exception()
        return [f.result() for f in futures]
    finally:
        # after a failure the caller's shutdown() ends the others, and with them their waits
        pool.shutdown(wait=False)


def launch_with_tokenizer(args: ServerArgs) -> tuple[ChildProcesses, Any]:
    """launch_children, with the frontend's tokenizer loading in a thread meanwhile: start-up
    takes the longer of the two instead of their sum."""
    from concurrent.futures import ThreadPoolExecutor

    from plait.models.tokenizer import load_tokenizer

    model_path = resolve_model_path(args.resolved_model_path)
    with ThreadPoolExecutor(1) as pool:
        tokenizer = pool.submit(load_tokenizer, args.tokenizer_path or model_path)
        children = launch_children(args.replace(model_path=model_path))
        try:
            return children, tokenizer.result()
        except BaseException:
            children.shutdown()
            raise


# --- the child side: `python -m plait.launch ROLE FD` ----------------------------------


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


def child_main() -> None:
    """`python -m plait.launch ROLE FD`: run one child process (its configuration on stdin)."""
    role, fd = sys.argv[1], int(sys.argv[2])
    config = json.loads(sys.stdin.buffer.read())
    sys.stdin.close()
    ready = ReadyPipe(fd)
    _exit_with_parent(os.getppid())
    if role == "scheduler":
        from plait.runtime import thread_tuner
        from plait.runtime.scheduler_process import run_scheduler_process

        thread_tuner.ENGINE_PIDS[:] = config.get("engine_pids", [])
        args = ServerArgs(**config["args"])
        run_scheduler_process(args, config["model_path"], config["input"], config["output"], ready,
                              config.get("tp_init"))
    elif role == "tp_worker":  # a tensor-parallel rank > 0
        from plait.runtime.tp_worker import run_tp_worker

        args = ServerArgs(**config["args"])
        run_tp_worker(args, config["model_path"], config["rank"], config["tp_init"], ready)
    elif role == "detokenizer":
        from plait.tokenizer.detokenizer import run_detokenizer_process

        run_detokenizer_process(config["tokenizer_path"], config["input"], config["output"], ready)
    else:
        raise SystemExit(f"unknown role {role!r}")


# --- a whole `plait serve` in a subprocess ---------------------------------------------


class ServerProcess:
    """A `plait serve` subprocess on a free port, for programs and tests.

        with ServerProcess(model_path, max_running_requests=8) as server:
            requests.post(server.url + "/generate", json={"text": "Hi", "sampling_params": {...}})

    Keyword arguments are ServerArgs fields (an unknown one is a TypeError before anything
    starts). The server runs in its own process group, so `shutdown()` reaches its children
    even when the server itself has to be killed."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        start_timeout: float = STARTUP_TIMEOUT_S,
        log_file: str | None = None,
        **server_args: Any,
    ) -> None:
        server_args.setdefault("log_level", "warning")  # a library should not chatter
        if "port" not in server_args:
            server_args["port"] = free_port(server_args.get("host", "127.0.0.1"))
        try:
            self.args = ServerArgs.from_kwargs(model_path=model_path, **server_args)
        except TypeError as e:
            raise TypeError(f"ServerProcess: {e}") from None
        self.url = self.args.url
        self.api_key = self.args.api_key
        self._log = open(log_file, "ab") if log_file else None  # noqa: SIM115 - closed in shutdown
        env = dict(os.environ)
        if self.api_key:  # through the environment: argv is visible to every user (`ps`)
            env[API_KEY_ENV] = self.api_key
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "plait", "serve", *cli_flags(self.args)],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
            start_new_session=True,
        )
        atexit.register(self.shutdown)  # never leave a server behind the interpreter
        try:
            self._wait_healthy(start_timeout)
        except BaseException:
            self.shutdown()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_healthy(self, timeout: float) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"plait serve exited during start-up (code {self.proc.returncode}); "
                    "see its log above" + (f" or in {self._log.name}" if self._log else "")
                )
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"plait serve did not become healthy within {timeout:.0f} s")

    def shutdown(self) -> None:
        """SIGTERM (the server stops its children), then SIGKILL to the whole group if needed."""
        atexit.unregister(self.shutdown)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any child left behind
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def cli_flags(args: ServerArgs) -> list[str]:
    """The `plait serve` flags that reproduce `args` (fields left at their default omitted).
    The API key is never a flag: pass it in the PLAIT_API_KEY environment variable."""
    flags: list[str] = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if value == f.default or f.name == "api_key":
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            else:
                raise ValueError(f"{f.name}: a default-True flag cannot be turned off from the CLI")
        else:
            flags += [flag, str(value)]
    return flags


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    child_main()
