"""``auditor serve`` in a subprocess on a free port, reached over real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from auditor.server.run import free_port, wait_healthy


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
                [sys.executable, "-m", "auditor", "serve", "--port", str(self.port), "--log-level", "warning",
                 *self.args],
                env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=self._limit_memory,
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

    def _limit_memory(self) -> None:
        import resource

        if self.memory_limit is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (self.memory_limit, self.memory_limit))
        if self.address_space_limit is not None:
            resource.setrlimit(resource.RLIMIT_AS, (self.address_space_limit, self.address_space_limit))

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
