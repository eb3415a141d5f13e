"""`plait serve --dp N`: N independent replicas on one machine, optionally behind SGLang's
router (`--router`).

    plait serve --dp 2 --port 30000             # replicas on 30001, 30002; prints the router command
    plait serve --dp 2 --port 30000 --router    # ... and runs sglang-router on 30000

Each replica is its own `plait serve` process (own scheduler, KV pool and radix cache) on its
own port: that is the worker model the router expects (one URL per worker, each health-checked
and routed to by its own cache tree), and a replica that dies takes nothing else with it.

The parent supervises: it starts the replicas, waits until each answers /health, then starts
the router (or prints its command). A replica that exits while serving is restarted on its
port (the router stops routing to it after its failed health checks and takes it back once it
is healthy again), at most MAX_RESTARTS times per replica; after that, or when the router
exits, everything stops and the parent exits non-zero. SIGINT/SIGTERM stop the router, then
the replicas; each replica stops its own children. Linux: every child also gets SIGTERM if
the parent dies without cleaning up (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx

from plait.args import API_KEY_ENV, ServerArgs
from plait.launch import cli_flags, free_port

logger = logging.getLogger("plait.replicas")

START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
POLL_S = 0.5
MAX_RESTARTS = 3
# The router's defaults (health check every 60 s, 3 failures to mark a worker unhealthy) leave
# a dead replica in rotation for minutes; the router we launch checks every few seconds.
ROUTER_HEALTH_INTERVAL_S = 5
# The router's circuit breaker (0.3.2) counts every non-2xx answer as a worker failure, 4xx
# included: 10 consecutive invalid requests take a healthy replica out for 60 s, and on every
# replica they refuse all traffic ("no_available_workers"). plait answers bad input with 400 by
# design, so the router we launch runs without it. The cost: a dead replica is dropped by the
# health checks above (3 failures, ~15 s) rather than by the breaker, and until then the
# requests the router sends there fail (cache_aware keeps choosing the replica that holds
# their prefix; round_robin's retry moves on to the next replica).
ROUTER_FLAGS = ("--disable-circuit-breaker",)
ROUTER_LOG_LEVELS = {"warning": "warn"}


@dataclasses.dataclass
class Replica:
    index: int
    args: ServerArgs
    proc: subprocess.Popen | None = None
    restarts: int = 0

    @property
    def url(self) -> str:
        return self.args.url


def replica_args(args: ServerArgs, index: int) -> ServerArgs:
    """Replica i (0-based) serves args' model on port + 1 + i, as a plain single server."""
    return args.replace(port=args.port + 1 + index, dp_size=1, router=False)


def router_command(args: ServerArgs, worker_urls: list[str], prometheus_port: int | None = None):
    """The sglang-router command line that fronts `worker_urls` on args.host:args.port."""
    cmd = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--policy",
        args.router_policy,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--health-check-interval-secs",
        str(ROUTER_HEALTH_INTERVAL_S),
        *ROUTER_FLAGS,
        "--log-level",
        ROUTER_LOG_LEVELS.get(args.log_level, args.log_level),
    ]
    if prometheus_port is not None:
        # the router's metrics listen on 0.0.0.0 by default: keep them on the router's host
        cmd += ["--prometheus-port", str(prometheus_port), "--prometheus-host", args.host]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


class ReplicaSet:
    """The replicas and the router, started and stopped together."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.replicas = [Replica(i, replica_args(args, i)) for i in range(args.dp_size)]
        self.router: subprocess.Popen | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ processes
    def _popen(self, cmd: list[str]) -> subprocess.Popen:
        env = dict(os.environ)
        if self.args.api_key:  # replicas read it from the environment, out of `ps` (the
            env[API_KEY_ENV] = self.args.api_key  # router only takes it as --api-key)
        # preexec_fn is safe here: the supervisor runs no threads
        return subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent)  # noqa: PLW1509

    def start_replica(self, r: Replica) -> None:
        logger.info("replica %d: starting on %s", r.index, r.url)
        r.proc = self._popen([sys.executable, "-m", "plait", "serve", *cli_flags(r.args)])

    def start_router(self) -> None:
        cmd = router_command(self.args, [r.url for r in self.replicas], free_port(self.args.host))
        logger.info("router: %s", _shown(cmd, self.args))
        self.router = self._popen(cmd)

    def wait_healthy(self, url: str, proc: subprocess.Popen, path: str, timeout: float) -> None:
        headers = {"Authorization": f"Bearer {self.args.api_key}"} if self.args.api_key else {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: exited during start-up (code {proc.returncode})")
            try:
                if httpx.get(url + path, headers=headers, timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(POLL_S)
        if not self._stop.is_set():
            raise TimeoutError(f"{url}: not healthy within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM to the router, then to every replica; SIGKILL whatever is left after
        STOP_TIMEOUT_S. Each replica stops its own scheduler and detokenizer."""
        self._stop.set()
        procs = [p for p in [self.router] + [r.proc for r in self.replicas] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in %.0f s: killed", p.pid, STOP_TIMEOUT_S)
                p.kill()
                p.wait()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for r in self.replicas:
            self.start_replica(r)
        for r in self.replicas:
            self.wait_healthy(r.url, r.proc, "/health", START_TIMEOUT_S)
        if self._stop.is_set():
            return
        urls = [r.url for r in self.replicas]
        if not self.args.router:
            cmd = router_command(self.args, urls)
            cmd[0] = "python"
            print(
                f"plait: {len(urls)} replicas ready at {', '.join(urls)}\n"
                "front them with SGLang's router (pip install sglang-router):\n  "
                + _shown(cmd, self.args),
                flush=True,
            )
            return
        self.start_router()
        self.wait_healthy(self.args.url, self.router, "/readiness", START_TIMEOUT_S)
        self.wait_registered(len(urls), START_TIMEOUT_S)
        if not self._stop.is_set():
            print(
                f"plait: {len(urls)} replicas ({', '.join(urls)}) behind sglang-router "
                f"({self.args.router_policy}) ready at {self.args.url}",
                flush=True,
            )

    def wait_registered(self, n: int, timeout: float) -> None:
        """Until the router reports all n workers healthy (its /readiness turns 200 with the
        first one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self._stop.is_set():
            try:
                body = httpx.get(self.args.url + "/readiness", timeout=5.0).json()
                if body.get("healthy_workers", n) >= n:
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(POLL_S)
        if not self._stop.is_set():
            raise TimeoutError(f"router: {n} workers not healthy within {timeout:.0f} s")

    def supervise(self) -> int:
        """Until stopped: restart replicas that exit; returns the exit code for the parent."""
        while not self._stop.wait(POLL_S):
            if self.router is not None and self.router.poll() is not None:
                logger.error("router exited (code %s): stopping", self.router.returncode)
                return 1
            for r in self.replicas:
                if r.proc is None or r.proc.poll() is None:
                    continue
                code = r.proc.returncode
                if r.restarts >= MAX_RESTARTS:
                    logger.error(
                        "replica %d exited (code %s) after %d restarts: stopping",
                        r.index,
                        code,
                        r.restarts,
                    )
                    return 1
                r.restarts += 1
                logger.warning(
                    "replica %d exited (code %s): restarting (%d/%d)",
                    r.index,
                    code,
                    r.restarts,
                    MAX_RESTARTS,
                )
                self.start_replica(r)
        return 0


def _shown(cmd: list[str], args: ServerArgs) -> str:
    """The command line for logs and the console: the API key replaced by a placeholder."""
    return " ".join("$PLAIT_API_KEY" if args.api_key and a == args.api_key else a for a in cmd)


def free_port_block(n: int, host: str = "127.0.0.1") -> int:
    """A port p with p..p+n-1 all free on host (for a router on p and n-1 replicas)."""
    for _ in range(100):
        base = free_port(host)
        if base + n > 65536:
            continue
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
                socks.append(s)
                s.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports on {host}")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux), so a killed parent
    leaves no replica or router behind. Best effort elsewhere."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def launch_replicas(args: ServerArgs, on_ready: Callable[[], None] | None = None) -> int:
    """Run `plait serve --dp N [--router]` until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s replicas %(levelname)s %(message)s"
    )
    if args.router:
        _check_router_installed()
    replicas = ReplicaSet(args)

    def on_signal(signum, frame) -> None:
        replicas._stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        replicas.start()
        if on_ready is not None:
            on_ready()
        return replicas.supervise()
    except (RuntimeError, TimeoutError) as e:
        if replicas._stop.is_set():  # interrupted during start-up
            return 0
        print(f"plait serve: {e}", file=sys.stderr)
        return 1
    finally:
        replicas.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _check_router_installed() -> None:
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        raise SystemExit(
            "plait serve --router: sglang-router is not installed "
            "(pip install 'plait[router]' or pip install sglang-router)"
        ) from None
