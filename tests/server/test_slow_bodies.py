"""Bodies as clients really send them, to the strict service (tests/conftest.py `capped`):
stalled and trickling bodies cut by their deadlines while the probes keep answering, a
client leaving mid-body logged in one line, non-JSON content types and compressed bodies
refused naming what was sent."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from factory import reference_reports

from auditor.testing.server import STRICT_REQUEST_CAP as REQUEST_CAP


def stalled_post(port: int, body_start: bytes = b"{", length: int = 100_000) -> socket.socket:
    """The reproducer's slow client: headers and the first byte of a body, then nothing."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % length + body_start)
    return s


def status_of(s: socket.socket, timeout: float) -> int | None:
    """Status code of the response on ``s`` (None if the server closed it without one)."""
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n" not in data:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        return None
    return int(data.split()[1]) if data.startswith(b"HTTP/1.1") else None


def test_probes_answer_while_stalled_bodies_fill_the_request_cap_and_those_get_408(capped):
    """More stalled bodies than the request cap (the reproducer: 210 > 200): /readyz,
    /healthz, /metrics, API reads and pages keep answering 200 (budgets of their own); the
    stalled ones get 408 after the body timeout (or 503 at once when the cap was full),
    never hold on."""
    socks = [stalled_post(capped.port) for _ in range(REQUEST_CAP + 10)]
    try:
        time.sleep(0.5)
        for path in ("/readyz", "/healthz", "/metrics", "/v1/runs?limit=1", "/"):
            r = httpx.get(capped.url + path, timeout=5)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
        statuses = [status_of(s, 10) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert statuses.count(408) >= REQUEST_CAP - 2 and set(statuses) <= {408, 503}, statuses


def test_a_body_trickling_in_is_cut_by_the_body_deadline(capped):
    """A byte every 0.5 s never trips the 2 s chunk timeout; the 4 s whole-body deadline
    answers 408 naming AUDITOR_BODY_DEADLINE_SECONDS."""
    s = stalled_post(capped.port)
    t0 = time.monotonic()
    try:
        s.settimeout(0.5)
        data = b""
        while time.monotonic() - t0 < 15 and not data:
            try:
                s.sendall(b" ")
                data = s.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
        s.settimeout(5)
        while data and (chunk := s.recv(4096)):  # the rest of the response, up to the close
            data += chunk
    finally:
        s.close()
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert b"AUDITOR_BODY_DEADLINE_SECONDS" in data
    assert 3.5 < time.monotonic() - t0 < 8


def test_a_client_leaving_mid_body_logs_one_line_and_no_traceback(capped, run_id):
    """Before: "Exception in ASGI application" and a ~130-line ClientDisconnect traceback per
    such client. Now one INFO line, and nothing stored."""
    before = capped.log_path.read_text()
    body = f'{{"reports": [{{"run_id": "{run_id}", "statistic": "advantages", '.encode()
    for _ in range(3):
        stalled_post(capped.port, body, length=10_000).close()
    time.sleep(1.5)
    new = capped.log_path.read_text()[len(before):]
    assert "Traceback" not in new and "Exception in ASGI" not in new, new[-3000:]
    assert new.count("disconnected before sending the whole body of POST /v1/reports") == 3, new[-3000:]
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_bodies_need_a_json_content_type(capped, run_id, content_type):
    """The reproducer: POST /v1/reports with text/plain was stored (200). Every body-carrying
    endpoint takes only JSON (what a cross-site form or a simple fetch cannot send): 415
    naming the content type, nothing stored; application/json and +json types pass."""
    import json

    reports = reference_reports(run_id, buggy=False)
    bodies = {"/v1/reports": ("POST", json.dumps({"reports": reports})),
              f"/v1/runs/{run_id}": ("PUT", json.dumps({"world_size": 2, "sizes": {"cp": 2}}))}
    headers = {"content-type": content_type} if content_type else {}
    for path, (method, body) in bodies.items():
        r = httpx.request(method, capped.url + path, content=body.encode(), headers=headers, timeout=30)
        assert r.status_code == 415, (path, r.status_code, r.text)
        p = r.json()
        assert r.headers["content-type"] == "application/problem+json"
        assert p["type"] == "urn:auditor:problem:unsupported_media_type" and p["errors"][0]["field"] == "content-type"
        assert (repr(content_type) if content_type else "got none") in p["detail"], p
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    r = httpx.post(capped.url + "/v1/reports", content=bodies["/v1/reports"][1].encode(), timeout=30,
                   headers={"content-type": "application/vnd.auditor+json; charset=utf-8"})
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
def test_compressed_bodies_are_a_415_naming_the_encoding(capped, run_id, encoding):
    """A new-user trial: a gzip body got 422 "invalid JSON at line 1 column 1". A body with
    a Content-Encoding other than identity is a 415 naming it; nothing is stored; identity
    passes."""
    import gzip
    import json

    body = json.dumps({"reports": reference_reports(run_id, buggy=False)}).encode()
    r = httpx.post(capped.url + "/v1/reports", content=gzip.compress(body), timeout=30,
                   headers={"content-type": "application/json", "content-encoding": encoding})
    assert r.status_code == 415, r.text
    p = r.json()
    assert p["errors"][0]["field"] == "content-encoding" and f"{encoding!r} is not supported" in p["detail"], p
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    r = httpx.post(capped.url + "/v1/reports", content=body, timeout=30,
                   headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200 and r.json()["accepted"] == 2, r.text
