"""Issue 25 §3-4, the service's own edges against a real server over real HTTP: sign-in
brute force is throttled per client address; readiness follows the ability to write (a
server whose files cannot grow); security headers on every answer and no token in the
access log; a browser's errors of pages as pages, HEAD on every GET; placeholder tokens
refused; `/docs` grouped by tag with written summaries."""

from __future__ import annotations

import resource
import time

import httpx
import pytest
from pydantic import ValidationError
from factory import reference_reports

from auditor.config import Settings
from auditor.server import BackgroundServer
from auditor.testing.server import ServerProcess
from auditor.testing.wait import wait_until

TOKEN = "s3cret-token"
FORM = {"Content-Type": "application/x-www-form-urlencoded"}


def _client(url: str, source: str) -> httpx.Client:
    """A client whose connections come from ``source`` (an address of 127.0.0.0/8)."""
    return httpx.Client(base_url=url, timeout=10, transport=httpx.HTTPTransport(local_address=source))


def test_placeholder_tokens_are_refused():
    """An example env file's placeholder is not a token: the settings name the field."""
    for field in ("token", "read_token"):
        with pytest.raises(ValidationError, match=f"{field}\n.*'change-me-too' is a placeholder"):
            Settings(**{field: "change-me-too"})
    assert Settings(token="7f3c9e").token == "7f3c9e"


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
    wait_until(lambda: server.get("/readyz").status_code == 200, 30, "ready service once writes succeed")
    r = server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, step=1)})
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
    steps = server.get(f"/v1/runs/{run_id}/statistics/advantages/steps").json()["steps"]
    assert [s["step"] for s in steps] == [0, 1]


HTML = {"Accept": "text/html,application/xhtml+xml,*/*;q=0.8"}  # what a browser sends for a page


def test_pages_and_problems_carry_security_headers_and_the_access_log_no_token(tmp_path, run_id):
    """Every answer — a page, `/docs`, JSON, a problem of the app, a 401 of the token check —
    has `X-Content-Type-Options: nosniff` and `X-Frame-Options: DENY`; pages get a CSP that
    allows scripts of this origin only (`/docs` also Swagger UI's inline start), JSON and
    problems one that allows nothing. A token sent as `?token=` (and `?api_key=`) is not in
    the access log; the request is (its other parameters too)."""
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "server.log", memory_limit=1024 * 2**20,
                      args=("--log-level", "info"), AUDITOR_TOKEN=TOKEN).start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        answers = {"page": s.get("/", headers=auth), "docs": s.get("/docs", headers=auth),
                   "json": s.get("/v1/runs", headers=auth), "problem": s.get(f"/v1/runs/{run_id}", headers=auth),
                   "unauthorized": s.get("/v1/runs"), "healthz": s.get("/healthz")}
        assert {k: r.status_code for k, r in answers.items()} == {"page": 200, "docs": 200, "json": 200,
                                                                  "problem": 404, "unauthorized": 401,
                                                                  "healthz": 200}
        for k, r in answers.items():
            assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY", k
            assert "frame-ancestors 'none'" in r.headers["content-security-policy"], k
        page_csp = answers["page"].headers["content-security-policy"]
        assert "script-src 'self';" in page_csp and "object-src 'none'" in page_csp
        assert "script-src 'self' 'unsafe-inline'" in answers["docs"].headers["content-security-policy"]
        for k in ("json", "problem", "unauthorized", "healthz"):
            assert answers[k].headers["content-security-policy"].startswith("default-src 'none'"), k
        assert s.get(f"/v1/runs?token={TOKEN}&limit=7", headers=auth).status_code == 200
        assert s.get("/v1/runs?api_key=k3y-value&limit=8", headers=auth).status_code == 200
    finally:
        s.stop()
    log = s.log_path.read_text()
    assert "GET /v1/runs?token=REDACTED&limit=7 HTTP/1.1" in log and "GET /v1/runs?api_key=REDACTED&limit=8" in log
    assert TOKEN not in log and "k3y-value" not in log


def test_a_browser_gets_errors_of_pages_as_pages_and_head_answers_every_get(tmp_path, run_id):
    """A browser (Accept: text/html) opening an unknown run, an unknown path or a bad
    query gets an HTML page with the status, the detail and a link to all runs; the same
    URLs without HTML in Accept, and the API in any case, keep problem JSON. HEAD answers
    every page and read with the GET's status and headers and no body (pages were 405)."""
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}")
    with BackgroundServer(settings) as url, httpx.Client(base_url=url, timeout=10) as http:
        for path, status, said in ((f"/runs/{run_id}", 404, f"not found: {run_id}"), ("/no/such/page", 404, "Not Found"),
                                   ("/?cursor=bogus", 422, "cursor: not a cursor of this listing")):
            r = http.get(path, headers=HTML)
            assert r.status_code == status and r.headers["content-type"].startswith("text/html"), (path, r.text)
            assert said in r.text and 'id="all-runs"' in r.text and 'class="brand"' in r.text, r.text
            assert "script-src 'self';" in r.headers["content-security-policy"]
            r = http.get(path)
            assert r.status_code == status and r.headers["content-type"] == "application/problem+json"
        r = http.get(f"/v1/runs/{run_id}", headers=HTML)
        assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
        for path in ("/", "/runbook", "/login", "/v1/runs", "/healthz", "/readyz", "/metrics", "/docs",
                     "/openapi.json", "/static/auditor.css", f"/runs/{run_id}"):
            get, head = http.get(path), http.head(path)
            assert (head.status_code, head.content) == (get.status_code, b""), path
            assert head.headers["content-type"] == get.headers["content-type"], path


def test_docs_group_every_operation_under_a_tag_with_a_written_summary(tmp_path):
    """`/docs` had every route under "default" with summaries made from function names
    ("Post Reports"): each operation now has one of the declared tags and its own summary."""
    from auditor.server.app import create_app
    from auditor.server.openapi import OPENAPI_TAGS

    doc = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}")).openapi()
    names = [t["name"] for t in doc["tags"]]
    assert names == [t["name"] for t in OPENAPI_TAGS]
    ops = [(m, p, op) for p, item in doc["paths"].items() for m, op in item.items()]
    assert len(ops) == 13  # 11, and the workload comparisons (/v1/workloads/{workload}, /v1/compare)
    for method, path, op in ops:
        assert len(op["tags"]) == 1 and op["tags"][0] in names, (method, path)
        # FastAPI's own would be the function's name in title case: "Post Reports", "Healthz"
        function = op["operationId"].split(f"_{path.strip('/').split('/')[0]}")[0]
        assert op["summary"].lower() != function.replace("_", " ").lower(), (method, path, op["summary"])
        assert len(op["summary"].split()) >= 2, (method, path, op["summary"])
    assert {p for m, p, op in ops if op["tags"] == ["operations"]} == {"/healthz", "/readyz", "/metrics"}


def test_openapi_declares_each_read_document_beside_the_wire_report(tmp_path):
    """Every read answers its document (auditor.contract.reads) as its 200 schema, under
    the Read prefix; the wire Report that POST /v1/reports takes stays the wire one (the read
    document once replaced it: the body documented as a run report, and schemathesis's
    fuzzing of that operation past 540 s)."""
    from auditor.contract.models import Report as WireReport
    from auditor.server.app import create_app

    doc = create_app(Settings(database_url=f"sqlite:///{tmp_path / 'a.db'}")).openapi()
    comps = doc["components"]["schemas"]
    ok = {(m, p): op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
          for p, item in doc["paths"].items() for m, op in item.items() if m == "get" and p.startswith("/v1/runs")}
    assert ok == {("get", "/v1/runs"): "ReadRunsPage", ("get", "/v1/runs/{run_id}"): "ReadRun",
                  ("get", "/v1/runs/{run_id}/report"): "ReadReport",
                  ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps"): "ReadStepsPage",
                  ("get", "/v1/runs/{run_id}/statistics/{statistic}/steps/{step}"): "ReadStepPage"}
    assert comps["ReportBatch"]["properties"]["reports"]["items"] == {"$ref": "#/components/schemas/Report"}
    assert set(comps["Report"]["properties"]) == set(WireReport.model_json_schema()["properties"])
    assert "extra" not in comps["ReadReport"]["properties"] and "statistics" in comps["ReadReport"]["properties"]


def test_readiness_on_postgresql_follows_a_read_only_database(tmp_path, run_id):
    """PostgreSQL turned read-only under the service (`default_transaction_read_only` on,
    its sessions ended so they reconnect): writes are 503 and `/readyz` 503 naming it
    (SQLSTATE 25006); turned back, `/readyz` is 200 again without a request and the batch
    is stored."""
    import sqlalchemy as sa

    from auditor.testing.postgres import PG_ADMIN_URL, create_database

    url, drop = create_database("auditor_test_readonly")
    name = sa.make_url(url).database
    admin = sa.create_engine(PG_ADMIN_URL.replace("postgresql://", "postgresql+psycopg://", 1),
                             isolation_level="AUTOCOMMIT")
    s = ServerProcess(url, tmp_path / "server.log", memory_limit=1024 * 2**20,
                      AUDITOR_PROBE_INTERVAL_SECONDS="0.2").start()

    def flip(on: bool) -> None:
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" SET default_transaction_read_only = {"on" if on else "off"}'))
            c.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"), {"d": name})

    try:
        assert s.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, step=0)}).status_code == 200
        flip(True)
        batch = {"reports": reference_reports(run_id, buggy=False, step=1)}
        # the first write may meet a session ended under it (a 503 too); then read-only ones
        wait_until(lambda: s.post("/v1/reports", json=batch).status_code == 503 and s.get("/readyz").status_code == 503,
                   30, "write refusal and readiness 503")
        detail = s.get("/readyz").json()["detail"]
        assert detail.startswith("database: writes fail (for ") and "read-only" in detail, detail
        assert s.get("/healthz").status_code == 200
        flip(False)
        wait_until(lambda: s.get("/readyz").status_code == 200, 30, "ready service once writes succeed")
        wait_until(lambda: s.post("/v1/reports", json=batch).status_code == 200, 30, "batch stored")
        assert [x["step"] for x in s.get(f"/v1/runs/{run_id}/statistics/advantages/steps").json()["steps"]] == [0, 1]
    finally:
        s.stop()
        admin.dispose()
        drop()
