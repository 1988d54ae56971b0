"""`auditor serve` as a process: a taken port (the test harness moves on, the command exits 2
at once naming it) and SIGTERM ending it in bounded time while a request waits on a lock."""

from __future__ import annotations

import functools
import signal
import socket
import sqlite3
import threading
import time

import httpx
from factory import reference_reports

from auditor.testing.cli import run_auditor
from auditor.testing.server import ServerProcess


auditor = functools.partial(run_auditor, timeout=60)


def test_the_test_harness_moves_to_another_port_when_its_port_was_taken(tmp_path):
    """ServerProcess (tests, benchmarks): a port that another process took between
    free_port() and the bind (parallel test workers) is replaced, not a failed start."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "s.log")
        s.port = taken.getsockname()[1]
        s.url = f"http://127.0.0.1:{s.port}"
        try:
            s.start()
            assert s.port != taken.getsockname()[1] and s.get("/healthz").status_code == 200
            assert "cannot listen on" in (tmp_path / "s.log").read_text()
        finally:
            s.stop()


def test_serve_on_a_taken_port_exits_2_at_once_naming_the_port(fresh_database_url):
    """The reproducer: an existing, migrated database and a port another process listens on.
    Before: the lifespan's probe task swallowed its cancellation (asyncio.wait_for on Python
    3.11) and the shutdown waited for it forever, deaf to SIGTERM; now the port is bound
    before anything starts: exit 2, one line naming the port."""
    assert auditor("db", "upgrade", "--database-url", fresh_database_url).returncode == 0
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = auditor("serve", "--port", str(port), "--database-url", fresh_database_url, timeout=60)
        elapsed = time.monotonic() - t0
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert elapsed < 25, elapsed  # before: never (deaf to SIGTERM); ~2 s quiet, more under load
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], out.stderr


def test_sigterm_ends_the_server_in_bounded_time_while_a_request_waits_on_a_lock(tmp_path):
    """SIGTERM while a request (and the database probe) wait on a SQLite lock held by
    another process: the graceful shutdown gives requests AUDITOR_SHUTDOWN_TIMEOUT_SECONDS,
    then the process ends, well before the 60 s lock timeout."""
    db = tmp_path / "auditor.db"
    server = ServerProcess(f"sqlite:///{db}", tmp_path / "server.log", AUDITOR_DB_LOCK_TIMEOUT_SECONDS="60",
                           AUDITOR_SHUTDOWN_TIMEOUT_SECONDS="2").start()
    lock = sqlite3.connect(db, timeout=1, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    try:
        waiting = threading.Thread(target=lambda: _swallow(server.post, "/v1/reports",
                                                           json={"reports": reference_reports("locked", buggy=False)}),
                                   daemon=True)
        waiting.start()
        time.sleep(1.0)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(20)
        assert time.monotonic() - t0 < 2 + 5 + 2, time.monotonic() - t0
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        server.stop()


def _swallow(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except httpx.HTTPError:
        pass
