"""Shared fixtures: a real `auditor serve` process on a real database, reached over real HTTP."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest

from auditor.testing.postgres import PG_ADMIN_URL, create_database
from auditor.testing.server import ServerProcess, capped_server, strict_server

# The `audited` fixture (multi-process tests). Also auto-loaded through its entry point;
# named here so the suite needs it even with PYTEST_DISABLE_PLUGIN_AUTOLOAD set.
pytest_plugins = ["auditor.pytest_plugin"]


def _pg_database(tmp_name: str):
    """Create a throw-away PostgreSQL database; return (url, drop)."""
    import psycopg

    try:
        return create_database(f"auditor_test_{tmp_name}")
    except psycopg.OperationalError as e:
        pytest.fail(f"PostgreSQL at {PG_ADMIN_URL} is required (.ci/run starts it): {e}")


@pytest.fixture
def pg_databases():
    """Factory of throw-away PostgreSQL databases (``pg_databases(tag)`` -> URL), all dropped
    at the end of the test."""
    drops = []

    def make(tag: str) -> str:
        url, drop = _pg_database(tag)
        drops.append(drop)
        return url

    yield make
    for drop in drops:
        drop()


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def backend(request) -> str:
    """Every storage and API test runs on both backends."""
    return request.param


def _session_database(backend, tmp_path_factory, tag: str):
    """A fresh, empty database of ``backend`` for the session (dropped after it)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp(tag) / 'auditor.db'}"
        return
    url, drop = _pg_database(tag)
    yield url
    drop()


@pytest.fixture(scope="session")
def database_url(backend, tmp_path_factory):
    """A fresh, empty database of the session's backend, for the in-process tests."""
    yield from _session_database(backend, tmp_path_factory, "session")


@pytest.fixture(scope="session")
def live_database_url(backend, tmp_path_factory):
    """The live server's own database: its sweep (grace 2 s) must never audit the open
    steps of in-process tests, which pass ``now`` far from the clock (a step left open
    between two ingests at ``now=1000`` was swept as incomplete on a loaded machine)."""
    yield from _session_database(backend, tmp_path_factory, "live")


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
def live_server(live_database_url, tmp_path_factory):
    """One service process per backend for the session (grace 2 s, sweep every 0.2 s).
    Tests isolate themselves with unique run ids (:func:`run_id`)."""
    server = ServerProcess(
        live_database_url, tmp_path_factory.mktemp("logs") / "server.log",
        AUDITOR_GRACE_SECONDS="2", AUDITOR_SWEEP_INTERVAL_SECONDS="0.2",
    ).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def server(database_url, tmp_path_factory):
    """One memory-capped service per backend for hostile input
    (:func:`auditor.testing.server.capped_server`), shared by the modules that send it; a
    module with a ``server`` fixture of its own uses that one."""
    s = capped_server(database_url, tmp_path_factory.mktemp("capped") / "server.log").start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def capped(database_url, tmp_path_factory):
    """One strict service per backend (:func:`auditor.testing.server.strict_server`: 20
    requests in progress, body deadlines, log level info), shared by the modules that test
    slow bodies and report validation over HTTP."""
    s = strict_server(database_url, tmp_path_factory.mktemp("strict") / "server.log").start()
    yield s
    s.stop()


@pytest.fixture
def run_id(request) -> str:
    """A run id unique to this test."""
    name = re.sub(r"[^A-Za-z0-9._:-]+", "-", request.node.name)[:80]
    return f"{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def service(database_url):
    """The service's flows in this process (no HTTP) on the session database of the backend.
    Tests isolate themselves with unique run ids (:func:`run_id`)."""
    from auditor.db.engine import ensure_schema, make_engine
    from auditor.service import Service

    engine = make_engine(database_url)
    ensure_schema(engine, database_url)
    svc = Service.from_engine(engine)
    yield svc
    svc.close()


CHROMIUM = os.environ.get("AUDITOR_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session: Debian's (`scripts/setup.sh --test` installs
    it), driven by Playwright through `executable_path` (Playwright's own browser download
    is never used)."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: run scripts/setup.sh --test (apt chromium) or set AUDITOR_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()
