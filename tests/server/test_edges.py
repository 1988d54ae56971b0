"""Issue 25 §3, the service's own edges against a real server over real HTTP: sign-in
brute force is throttled per client address, and readiness follows the ability to write
(the write-failing state of a server whose files cannot grow)."""

from __future__ import annotations

import resource
import time

import httpx
import pytest
from conftest import ServerProcess
from factory import reference_reports

from auditor.config import Settings
from auditor.server import BackgroundServer

TOKEN = "s3cret-token"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _client(url: str, source: str) -> httpx.Client:
    """A client whose connections come from ``source`` (an address of 127.0.0.0/8)."""
    return httpx.Client(base_url=url, timeout=10, transport=httpx.HTTPTransport(local_address=source))


def test_login_failures_are_throttled_per_client_address(tmp_path):
    """5 wrong tokens (AUDITOR_LOGIN_MAX_FAILURES=5) from 127.0.0.1 are each the form with
    401; the 6th attempt, and then even the right token, is the form with 429 and a
    Retry-After within the 3 s window, the token not compared. Another address
    (127.0.0.2) signs in meanwhile. Once the window has passed the right token signs in
    (303) and clears the count. (Before, 300 wrong tokens in 12.6 s were all 401.)"""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}", token=TOKEN, login_max_failures=5,
                        login_failure_window_seconds=3.0)
    with BackgroundServer(settings) as url, _client(url, "127.0.0.1") as a, _client(url, "127.0.0.2") as b:
        started = time.monotonic()
        wrong = [a.post("/login", data={"token": f"guess-{i}", "next": "/"}) for i in range(5)]
        assert [r.status_code for r in wrong] == [401] * 5
        assert all("That is not this auditor" in r.text for r in wrong)
        for token in ("guess-5", TOKEN):
            r = a.post("/login", data={"token": token, "next": "/"})
            assert r.status_code == 429, r.text
            assert 1 <= int(r.headers["retry-after"]) <= 3
            assert "Too many wrong tokens from this address" in r.text and "auditor_token" not in r.headers.get(
                "set-cookie", "")
        r = b.post("/login", data={"token": TOKEN, "next": "/runs/x"})
        assert r.status_code == 303 and r.headers["location"] == "/runs/x"
        time.sleep(max(0.0, started + 3.2 - time.monotonic()))
        r = a.post("/login", data={"token": TOKEN, "next": "/"})
        assert r.status_code == 303 and "auditor_token=" in r.headers["set-cookie"]
        assert a.post("/login", data={"token": "guess", "next": "/"}).status_code == 401  # counting anew


@pytest.fixture
def server(tmp_path):
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "server.log", memory_limit=1024 * 2**20,
                      AUDITOR_PROBE_INTERVAL_SECONDS="0.2").start()
    yield s
    s.stop()


def _wait(fn, what: str, bound: float = 30.0):
    deadline = time.monotonic() + bound
    while not (out := fn()):
        assert time.monotonic() < deadline, f"no {what} within {bound:g} s"
        time.sleep(0.1)
    return out


def test_readiness_is_503_while_writes_fail_and_200_once_they_succeed(server, run_id):
    """The server process may no longer grow a file (RLIMIT_FSIZE of 1 byte: every write of
    SQLite's log fails, as on a full disk). A batch is a 503 with Retry-After (nothing
    stored), and `/readyz`, 200 before, is 503 naming the failing writes while `/healthz`
    stays 200. Its limit lifted, the probe's own write succeeds within a few periods:
    `/readyz` 200 again (no request needed), and the batch is stored. (Before, `/readyz`
    stayed 200 while every write answered 503.)"""
    assert server.get("/readyz").status_code == 200
    assert server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, step=0)}).status_code == 200
    pid = server.proc.pid
    hard = resource.prlimit(pid, resource.RLIMIT_FSIZE)[1]
    resource.prlimit(pid, resource.RLIMIT_FSIZE, (1, hard))
    try:
        r = server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, step=1)})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        r = server.get("/readyz")
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        detail = r.json()["detail"]
        assert detail.startswith("database: writes fail (for ") and "I/O error" in detail, detail
        assert server.get("/healthz").status_code == 200
        time.sleep(1.0)  # several probe periods: the probe's write fails too, still not ready
        assert server.get("/readyz").status_code == 503
    finally:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (hard, hard))
    _wait(lambda: server.get("/readyz").status_code == 200, "ready service once writes succeed")
    r = server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, step=1)})
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    steps = server.get(f"/v1/runs/{run_id}/statistics/advantages/steps").json()["steps"]
    assert [s["step"] for s in steps] == [0, 1]
