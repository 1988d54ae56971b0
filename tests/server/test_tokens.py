"""Write and read tokens: checked before a body is read, reads need a token and a read token
only reads, the sign-in form's body is capped."""

from __future__ import annotations

import httpx
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import post_reports as post
from auditor.testing.http import raw_request as _raw_request
from auditor.testing.server import ServerProcess


def test_the_token_is_checked_before_the_body_is_read(tmp_path):
    """With AUDITOR_TOKEN set, a PUT or POST without it gets a 401 as soon as its headers
    arrive: the 100 MB it declares is never awaited."""
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "s.log", AUDITOR_TOKEN="s3cret").start()
    try:
        for method, path in ((b"PUT", b"/v1/runs/r1"), (b"POST", b"/v1/reports")):
            head = method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n"
            answer, took = _raw_request(s, head)
            assert answer.startswith(b"HTTP/1.1 401") and took < 2.0, answer[:300]
            assert b"application/problem+json" in answer
    finally:
        s.stop()


def test_reads_need_a_token_and_a_read_token_only_reads(tmp_path, run_id):
    """With AUDITOR_TOKEN and AUDITOR_READ_TOKEN set: every read (runs, report, /docs,
    /openapi.json) answers 401 without a token (they answered anyone before), 200 with
    either token; a write with the read token is a 403; /healthz and /metrics stay open
    (AUDITOR_PUBLIC_ENDPOINTS, default true) — and close when it is false."""
    db = f"sqlite:///{tmp_path / 'a.db'}"
    s = ServerProcess(db, tmp_path / "a.log", AUDITOR_TOKEN="write-tok", AUDITOR_READ_TOKEN="read-tok").start()
    w, rd = {"Authorization": "Bearer write-tok"}, {"Authorization": "Bearer read-tok"}
    try:
        assert post(s, reference_reports(run_id, buggy=False), headers=w).status_code == 200
        for path in ("/v1/runs", f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/report", "/docs", "/openapi.json",
                     f"/v1/runs/{run_id}/statistics/advantages/steps/0", f"/v1/compare?run={run_id}"):
            r = s.get(path)
            assert_problem(r, 401, "unauthorized")
            assert r.headers["www-authenticate"].startswith("Bearer")
            assert s.get(path, headers={"Authorization": "Bearer write-tok-x"}).status_code == 401
            assert s.get(path, headers=rd).status_code == 200 and s.get(path, headers=w).status_code == 200
        assert_problem(post(s, reference_reports(run_id, buggy=False), headers=rd), 403, "forbidden")
        assert_problem(httpx.delete(f"{s.url}/v1/runs/{run_id}", headers=rd), 403, "forbidden")
        # the scheme is case-insensitive (RFC 7235 §2.1); the token is not; another scheme is a 401
        for given, status in (("bearer write-tok", 200), ("BEARER write-tok", 200), ("bearer read-tok", 200),
                              ("Bearer WRITE-TOK", 401), ("Basic write-tok", 401), ("write-tok", 401)):
            assert s.get(f"/v1/runs/{run_id}", headers={"Authorization": given}).status_code == status, given
        assert post(s, reference_reports(run_id, buggy=False), headers={"Authorization": "bearer write-tok"}).json()[
            "duplicates"] == 2
        assert s.get("/healthz").status_code == 200 and s.get("/metrics").status_code == 200
    finally:
        s.stop()
    s = ServerProcess(db, tmp_path / "b.log", AUDITOR_TOKEN="write-tok", AUDITOR_PUBLIC_ENDPOINTS="false").start()
    try:
        assert_problem(s.get("/metrics"), 401, "unauthorized")
        assert s.get("/metrics", headers=w).status_code == 200
    finally:
        s.stop()


def test_the_sign_in_form_body_is_capped(tmp_path):
    """POST /login read its form body whole, however large. Now (token 'write-tok', 9 chars:
    cap 8,192 + 3·9 = 8,219 bytes) the right token signs in (303 with the cookie), a wrong
    one near the cap gets the form again (401), and a body over the cap — declared (1 MB) or
    chunked with no length (6.5 MB offered) — is a 413 problem naming the body, the rest unread."""
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "a.log", AUDITOR_TOKEN="write-tok").start()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    try:
        r = httpx.post(f"{s.url}/login", data={"token": "write-tok", "next": "/runs/x"}, timeout=30)
        assert r.status_code == 303 and r.headers["location"] == "/runs/x", r.text
        assert r.cookies.get("auditor_token") == "write-tok"
        body = b"next=%2F&token=" + b"a" * (8219 - 15)
        r = httpx.post(f"{s.url}/login", content=body, headers=form, timeout=30)
        assert r.status_code == 401 and "not this auditor" in r.text, r.text
        r = httpx.post(f"{s.url}/login", content=body + b"a", headers=form, timeout=30)
        problem = assert_problem(r, 413, "too_large")
        assert problem["detail"] == "sign-in form larger than 8219 bytes, got 8220 bytes", problem
        assert problem["errors"][0]["field"] == "body" and problem["errors"][0]["msg"] == "at most 8219 bytes"
        r = httpx.post(f"{s.url}/login", content=b"token=" + b"a" * 1_000_000, headers=form, timeout=30)
        assert assert_problem(r, 413, "too_large")["detail"].endswith("got 1000006 bytes")

        def chunks():
            piece = b"a" * 65536
            yield b"6\r\ntoken=\r\n"
            for _ in range(100):
                yield b"%x\r\n%s\r\n" % (len(piece), piece)

        head = (b"POST /login HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-www-form-urlencoded\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n")
        answer, _ = _raw_request(s, head, chunks())
        assert answer.startswith(b"HTTP/1.1 413") and b"sign-in form larger than 8219 bytes" in answer, answer[:300]
        assert s.get("/healthz").status_code == 200
    finally:
        s.stop()
