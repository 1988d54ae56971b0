"""``auditor serve`` in a subprocess on a free port, reached over real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from auditor.server.run import free_port, wait_healthy


#: Run by ``python -c`` in the child: set RLIMIT_DATA / RLIMIT_AS (-1: leave it) and exec
#: Python with the rest of the arguments. The limits are set in a fresh single-threaded
#: interpreter, not by ``preexec_fn`` in the fork of this (threaded: torch, test pools)
#: process, where running Python code between fork and exec is unsafe (it crashed children
#: started from a thread pool with SIGSEGV).
_LIMITED = ("import os, resource, sys\n"
            "for lim, n in ((resource.RLIMIT_DATA, int(sys.argv[1])), (resource.RLIMIT_AS, int(sys.argv[2]))):\n"
            "    if n >= 0:\n"
            "        resource.setrlimit(lim, (n, n))\n"
            "os.execv(sys.executable, [sys.executable, *sys.argv[3:]])\n")


def limited_argv(args: list[str], *, data: int | None = None, address_space: int | None = None) -> list[str]:
    """The argv of ``python *args`` with RLIMIT_DATA ``data`` and RLIMIT_AS ``address_space``
    (bytes; None: no limit) set before it starts: one runaway child cannot take the machine
    down. Safe to start from any thread (no ``preexec_fn``)."""
    if data is None and address_space is None:
        return [sys.executable, *args]
    return [sys.executable, "-c", _LIMITED, str(-1 if data is None else data),
            str(-1 if address_space is None else address_space), *args]


class ServerProcess:
    """``python -m auditor serve`` in a subprocess; :meth:`start`/:meth:`stop` may be repeated.

    ``args`` are extra ``auditor serve`` options (e.g. ``("--workers", "2")``); ``env`` is
    added to this process's environment (e.g. ``AUDITOR_GRACE_SECONDS="2"``). Output goes
    to ``log_path``.
    """

    def __init__(self, database_url: str, log_path: Path, *, args: tuple[str, ...] = (),
                 memory_limit: int | None = None, address_space_limit: int | None = None, **env: str):
        self.database_url = database_url
        #: RLIMIT_DATA of the server process, in bytes: a server fed hostile input must not
        #: take the machine down (it fails with MemoryError instead).
        self.memory_limit = memory_limit
        #: RLIMIT_AS of the server process, in bytes: a container's hard cap, thread stacks
        #: and malloc arenas included (MemoryError, or "can't start new thread", past it).
        self.address_space_limit = address_space_limit
        self.log_path = log_path
        self.args = tuple(args)
        self.env = {**os.environ, "AUDITOR_DATABASE_URL": database_url, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        """Start and wait until ``/healthz`` answers; raises RuntimeError (with the log's tail) if not.
        A port taken between :func:`free_port` and the server's bind (another test process
        picked it too: ``auditor serve`` exits 2 naming the address) is replaced by a new
        free port, up to three times."""
        for attempt in range(3):
            log = open(self.log_path, "ab")
            start = log.tell()
            self.proc = subprocess.Popen(
                limited_argv(["-m", "auditor", "serve", "--port", str(self.port), "--log-level", "warning",
                              *self.args], data=self.memory_limit, address_space=self.address_space_limit),
                env=self.env, stdout=log, stderr=subprocess.STDOUT,
            )
            log.close()
            try:
                wait_healthy(self.url, timeout, alive=lambda: self.proc is not None and self.proc.poll() is None)
                return self
            except TimeoutError:
                code = self.proc.poll()
                self.stop()
                with open(self.log_path, "rb") as f:
                    f.seek(start)
                    said = f.read().decode(errors="replace")
                if code == 2 and "cannot listen on" in said and attempt < 2:
                    self.port = free_port()
                    self.url = f"http://127.0.0.1:{self.port}"
                    continue
                raise RuntimeError(f"server did not start; log:\n{self.log_path.read_text()[-4000:]}") from None
        raise AssertionError("unreachable")

    def peak_rss(self) -> int:
        """Peak resident set size of the server process so far (VmHWM), in bytes."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        """Send ``sig`` and wait (bounded); kill if it does not exit."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path: str, **kw) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kw)

    def put(self, path: str, **kw) -> httpx.Response:
        return httpx.put(self.url + path, timeout=30, **kw)


#: RLIMIT_DATA of the capped service (:func:`capped_server`): past it the service fails
#: instead of the machine.
CAPPED_MEMORY_LIMIT = 1536 * 2**20
#: What the tests assert the capped service's peak RSS stays under (docs/deploy.md "Limits
#: and security": the largest accepted body and a step at the expected-count limit).
CAPPED_RSS_BOUND = 1024 * 2**20
#: The capped service's header timeout, seconds.
CAPPED_HEADER_TIMEOUT = 5.0


def capped_server(database_url: str, log_path: Path) -> ServerProcess:
    """A memory-capped service (not started) for hostile input: grace 1 s, sweep every 0.2 s,
    header timeout :data:`CAPPED_HEADER_TIMEOUT` (1 s closed the connections of the very test
    process when a loaded machine did not schedule it for a second between connecting and
    sending: a flake), body chunk timeout 2 s, 100 connections, 50 statistics per run,
    delete chunks of 7 reports, database lock timeout 2 s."""
    return ServerProcess(
        database_url, log_path, memory_limit=CAPPED_MEMORY_LIMIT,
        AUDITOR_GRACE_SECONDS="1", AUDITOR_SWEEP_INTERVAL_SECONDS="0.2",
        AUDITOR_HEADER_TIMEOUT_SECONDS=str(CAPPED_HEADER_TIMEOUT), AUDITOR_BODY_TIMEOUT_SECONDS="2",
        AUDITOR_MAX_CONNECTIONS="100", AUDITOR_MAX_STATISTICS_PER_RUN="50", AUDITOR_DELETE_CHUNK_ROWS="7",
        AUDITOR_DB_LOCK_TIMEOUT_SECONDS="2",
    )


#: Requests in progress the strict service (:func:`strict_server`) allows.
STRICT_REQUEST_CAP = 20


def strict_server(database_url: str, log_path: Path) -> ServerProcess:
    """A memory-capped service (not started) at log level info with strict request limits:
    :data:`STRICT_REQUEST_CAP` requests in progress, body chunk timeout 2 s, whole-body
    deadline 4 s, world size limit 4,096."""
    return ServerProcess(
        database_url, log_path, args=("--log-level", "info"), memory_limit=CAPPED_MEMORY_LIMIT,
        AUDITOR_MAX_CONCURRENT_REQUESTS=str(STRICT_REQUEST_CAP), AUDITOR_BODY_TIMEOUT_SECONDS="2",
        AUDITOR_BODY_DEADLINE_SECONDS="4", AUDITOR_MAX_WORLD_SIZE="4096",
    )
