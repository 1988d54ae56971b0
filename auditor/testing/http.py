"""HTTP helpers for tests against an ``auditor serve`` process
(:class:`auditor.testing.server.ServerProcess`, or anything with its ``post(path, **kw)``)."""

from __future__ import annotations

import json
import socket
import time

import httpx


def post_reports(server, reports: list[dict], **kw) -> httpx.Response:
    """``POST /v1/reports`` of ``{"reports": reports}`` (``kw``: httpx's, e.g. ``headers``)."""
    return server.post("/v1/reports", json={"reports": reports}, **kw)


def post_reports_ok(server, reports: list[dict]) -> dict:
    """:func:`post_reports`, asserted to answer 200; its JSON (accepted, duplicates, steps_audited)."""
    r = post_reports(server, reports)
    assert r.status_code == 200, r.text
    return r.json()


def post_reports_non_finite(server, reports: list[dict]) -> httpx.Response:
    """POST with ``Infinity`` tokens, as the client encodes them (``json.dumps``; httpx's
    ``json=`` refuses non-finite floats)."""
    return server.post("/v1/reports", content=json.dumps({"reports": reports}).encode(),
                       headers={"content-type": "application/json"})


def assert_problem(r: httpx.Response, status: int, code: str) -> dict:
    """``r`` is an RFC 9457 problem of ``status`` whose ``code`` is ``code``; its JSON."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body = r.json()
    assert body["type"] == f"urn:auditor:problem:{code}" and body["status"] == status and body["title"], body
    return body


def only_series(server, run_id: str) -> dict:
    """The one statistic of ``run_id``'s report (asserted to be the only one)."""
    (s,) = server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    return s


def raw_request(server, head: bytes, body_chunks=(), read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send a raw HTTP request (``head``, then each of ``body_chunks``) over a socket to
    ``server.port``; return (answer, seconds until it came). A peer closing mid-body ends
    the sending; the answer is read until the peer closes or a JSON body ends."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=read_timeout) as sock:
        t0 = time.perf_counter()
        sock.sendall(head)
        for chunk in body_chunks:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        data = b""
        try:
            while True:
                part = sock.recv(65536)
                if not part:
                    break
                data += part
                if b"\r\n\r\n" in data and data.split(b"\r\n\r\n", 1)[1].endswith(b"}"):
                    break
        except (ConnectionResetError, socket.timeout):
            pass
        return data, time.perf_counter() - t0
