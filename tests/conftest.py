"""Shared fixtures: a real `auditor serve` process on a real database, reached over real HTTP."""

from __future__ import annotations

import os
import re
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

    def __init__(self, database_url: str, log_path: Path, *, args: tuple[str, ...] = (), **env: str):
        self.database_url = database_url
        self.log_path = log_path
        self.args = tuple(args)  # extra `auditor serve` options, e.g. ("--workers", "2")
        self.env = {**os.environ, "AUDITOR_DATABASE_URL": database_url, **env}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "auditor", "serve", "--port", str(self.port), "--log-level", "warning",
             *self.args],
            env=self.env, stdout=log, stderr=subprocess.STDOUT,
        )
        try:
            wait_healthy(self.url, timeout, alive=lambda: self.proc is not None and self.proc.poll() is None)
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


PG_ADMIN_URL = os.environ.get("AUDITOR_TEST_PG", "postgresql://127.0.0.1:5432/postgres")


def _pg_database(tmp_name: str):
    """Create a throw-away PostgreSQL database; return (url, drop)."""
    import psycopg

    name = f"auditor_test_{tmp_name}_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
    except psycopg.OperationalError as e:
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is required (.ci/run starts it): {e}")
    base = PG_ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://")

    def drop() -> None:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{base}/{name}", drop


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def backend(request) -> str:
    """Every storage and API test runs on both backends."""
    return request.param


@pytest.fixture(scope="session")
def database_url(backend, tmp_path_factory):
    """A fresh, empty database of the session's backend."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'auditor.db'}"
        return
    url, drop = _pg_database("session")
    yield url
    drop()


@pytest.fixture
def fresh_database_url(backend, tmp_path):
    """An empty database for one test (migrations, restarts)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'auditor.db'}"
        return
    url, drop = _pg_database("t")
    yield url
    drop()


@pytest.fixture(scope="session")
def live_server(database_url, tmp_path_factory):
    """One service process per backend for the session (grace 2 s, sweep every 0.2 s).
    Tests isolate themselves with unique run ids (:func:`run_id`)."""
    server = ServerProcess(
        database_url, tmp_path_factory.mktemp("logs") / "server.log",
        AUDITOR_GRACE_SECONDS="2", AUDITOR_SWEEP_INTERVAL_SECONDS="0.2",
    ).start()
    yield server
    server.stop()


@pytest.fixture
def run_id(request) -> str:
    """A run id unique to this test."""
    name = re.sub(r"[^A-Za-z0-9._:-]+", "-", request.node.name)[:80]
    return f"{name}-{uuid.uuid4().hex[:8]}"
