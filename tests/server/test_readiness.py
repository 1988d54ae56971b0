"""The background database probe behind /readyz and /healthz against a database that hangs:
one probe thread at a time however long it hangs, 503 meanwhile, 200 once it answers.

PostgreSQL only: a session holding ACCESS EXCLUSIVE on the table the probe reads makes the
probe wait (for the 1 h lock timeout set here). SQLite in WAL mode, as the service runs it,
never makes a reader wait on another connection's lock, so the hang cannot be produced there.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import sqlalchemy as sa

from auditor.config import Settings
from auditor.server import BackgroundServer
from auditor.server.background import probe_thread_name
from auditor.testing.postgres import create_database
from auditor.testing.wait import wait_until

INTERVAL, TIMEOUT = 0.1, 0.3  # s: a probe every 0.1 s, abandoned after 0.3 s


def _probe_threads(url: str) -> int:
    """Live probe threads of the service on database ``url`` in this process (the probes
    of other in-process services of this worker have other names: counted with them, one
    was seen as a second thread on a loaded machine)."""
    name = probe_thread_name(sa.engine.make_url(url).database)
    return sum(t.name == name for t in threading.enumerate())


@pytest.fixture
def pg_url():
    url, drop = create_database("auditor_test_probe")
    yield url
    drop()


def test_a_hung_database_holds_one_probe_thread_not_one_per_period(pg_url):
    """While another session holds ACCESS EXCLUSIVE on alembic_version for ~15 probe
    timeouts, the service (in this process, probing every 0.1 s, abandoning a probe after
    0.3 s) has exactly one live probe thread — the abandoned one, still waiting — at every
    sample; /readyz is 503 saying how long the probe has waited, /healthz 200 with the same
    message. Once the lock is released that probe returns, /readyz is 200 again and at most
    one probe thread is alive. (Before, a new probe started every period: ~15 threads, each
    holding a pooled connection.)"""
    settings = Settings(database_url=pg_url, probe_interval_seconds=INTERVAL, probe_timeout_seconds=TIMEOUT,
                        db_lock_timeout_seconds=3600, sweep_interval_seconds=3600)
    holder = sa.create_engine(pg_url)
    with BackgroundServer(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        wait_until(lambda: http.get("/readyz").status_code == 200, 60, "ready service")
        conn = holder.connect()
        tx = conn.begin()
        conn.execute(sa.text("LOCK TABLE alembic_version IN ACCESS EXCLUSIVE MODE"))
        try:
            wait_until(lambda: http.get("/readyz").status_code == 503, 60, "503 from the first abandoned probe")
            samples = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 15 * TIMEOUT:
                samples.append(_probe_threads(pg_url))
                time.sleep(INTERVAL / 2)
            assert len(samples) >= 20 and set(samples) == {1}, samples
            r = http.get("/readyz")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["detail"].startswith("database: TimeoutError: the database probe has been waiting "), r.text
            health = http.get("/healthz")
            assert health.status_code == 200
            assert health.json()["database"].startswith("TimeoutError: the database probe has been waiting ")
        finally:
            tx.rollback()
            conn.close()
            holder.dispose()
        wait_until(lambda: http.get("/readyz").status_code == 200, 60, "ready service after the lock")
        assert http.get("/healthz").json()["database"] == "ok"
        assert _probe_threads(pg_url) <= 1
