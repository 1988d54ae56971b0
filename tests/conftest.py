"""Shared fixtures: a real `auditor serve` process on a real database, reached over real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from auditor.server import free_port, wait_healthy


class ServerProcess:
    """`python -m auditor serve` in a subprocess; `start()`/`stop()` may be repeated."""

    def __init__(self, database_url: str, log_path: Path, **env: str):
        self.database_url = database_url
        self.log_path = log_path
        self.env = {**os.environ, "AUDITOR_DATABASE_URL": database_url, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "auditor", "serve", "--port", str(self.port), "--log-level", "warning"],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(self.url, timeout)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"server did not start; log:\n{self.log_path.read_text()[-4000:]}") from None
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
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


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('db') / 'auditor.db'}"


@pytest.fixture(scope="session")
def live_server(sqlite_url, tmp_path_factory):
    """One service process for the session (grace 2 s, sweep every 0.2 s) on a SQLite file.
    Tests isolate themselves with unique run ids (:func:`run_id`)."""
    server = ServerProcess(
        sqlite_url, tmp_path_factory.mktemp("logs") / "server.log",
        AUDITOR_GRACE_SECONDS="2", AUDITOR_SWEEP_INTERVAL_SECONDS="0.2",
    ).start()
    yield server
    server.stop()


@pytest.fixture
def run_id(request) -> str:
    """A run id unique to this test."""
    name = request.node.name.replace("[", "-").replace("]", "").replace(",", "-")[:80]
    return f"{name}-{uuid.uuid4().hex[:8]}"
