"""A database that cannot take a write now (a lock held, a pool exhausted) is a 503 with
Retry-After, never a 500, and liveness stays fast meanwhile."""

from __future__ import annotations

import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import sqlalchemy as sa
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import post_reports as post
from auditor.testing.server import ServerProcess


def test_a_locked_database_is_a_503_with_retry_after_and_liveness_stays_fast(server, run_id):
    """Another process holds the write lock (SQLite: BEGIN EXCLUSIVE; PostgreSQL: LOCK
    TABLE reports): ingest gets 503 + Retry-After after the 2 s lock timeout (a 500 or a
    30 s wait before), /healthz answers meanwhile (well under the 2 s it would take if it
    waited on the lock), and ingest works again
    once the lock is gone."""
    url = server.database_url
    if url.startswith("sqlite"):
        holder = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None, timeout=10)
        holder.execute("BEGIN EXCLUSIVE")
        release = holder.rollback
    else:
        engine = sa.create_engine(url)
        conn = engine.connect()
        tx = conn.begin()
        conn.execute(sa.text("LOCK TABLE reports IN EXCLUSIVE MODE"))

        def release():
            tx.rollback()
            conn.close()
            engine.dispose()
    try:
        results = []

        def ingest():
            results.append(post(server, reference_reports(run_id, buggy=False)))

        t = threading.Thread(target=ingest)
        t.start()
        worst = 0.0
        while t.is_alive():
            t0 = time.perf_counter()
            assert server.get("/healthz").status_code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(0.05)
        t.join()
        body = assert_problem(results[0], 503, "unavailable")
        assert results[0].headers["retry-after"] == "1" and "retry later" in body["detail"]
        assert worst < 1.0, worst  # blocked on the lock it would take >= 2 s; a loaded machine adds ~0.3 s
    finally:
        release()
    assert post(server, reference_reports(run_id, buggy=False)).status_code == 200


def test_pool_exhaustion_is_a_503_not_a_500(tmp_path, run_id):
    """More concurrent ingests than database connections while the database is locked:
    those that get no pooled connection within AUDITOR_DB_POOL_TIMEOUT_SECONDS answer 503 +
    Retry-After (sqlalchemy.exc.TimeoutError gave a 500 before), the others 503 after the
    lock timeout; none is a 500, and ingest works once the lock is released."""
    db = tmp_path / "p.db"
    s = ServerProcess(f"sqlite:///{db}", tmp_path / "p.log", AUDITOR_INGEST_CONCURRENCY="40",
                      AUDITOR_DB_POOL_TIMEOUT_SECONDS="0.5", AUDITOR_DB_LOCK_TIMEOUT_SECONDS="3").start()
    try:
        holder = sqlite3.connect(db, isolation_level=None, timeout=10)
        holder.execute("BEGIN EXCLUSIVE")
        with ThreadPoolExecutor(30) as pool:
            answers = list(pool.map(lambda i: post(s, reference_reports(f"{run_id}-{i}", buggy=False)), range(30)))
        holder.rollback()
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {503}, codes
        assert all(r.headers["retry-after"] == "1" for r in answers)
        kinds = {r.json()["detail"].split("(")[1].split(")")[0] for r in answers}
        assert "TimeoutError" in kinds, kinds  # the pool ran out for some of them
        assert post(s, reference_reports(run_id, buggy=False)).status_code == 200
        assert "Traceback" not in s.log_path.read_text()
    finally:
        s.stop()
