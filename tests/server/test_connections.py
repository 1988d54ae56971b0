"""Issue 25 §3: idle sockets against a real, memory-capped `auditor serve` (SQLite) over
loopback. 1,000 idle sockets (no token, no bytes) took `/healthz` down before: every new
connection got the 503 "too many open connections" while they stayed open. Now a new
connection past AUDITOR_MAX_CONNECTIONS closes an idle one of the client holding the most,
and when none is idle it may still ask for a probe path.
"""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from auditor.testing.server import ServerProcess

MEMORY_LIMIT = 1024 * 2**20
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
#: The flood's source address: loopback is 127.0.0.0/8, so the attacker is another client.
ATTACKER = "127.0.0.2"


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(4096, socket.MSG_DONTWAIT) == b""
    except BlockingIOError:  # nothing to read: still open
        return False
    except ConnectionResetError:
        return True


def _request(sock: socket.socket, path: str, headers: dict[str, str] | None = None) -> bytes:
    """One keep-alive GET on ``sock``; its complete answer (by Content-Length)."""
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n{extra}\r\n".encode())
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


@pytest.fixture
def server(tmp_path):
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "server.log", memory_limit=MEMORY_LIMIT,
                      AUDITOR_TOKEN=TOKEN, AUDITOR_HEADER_TIMEOUT_SECONDS="60", AUDITOR_KEEP_ALIVE_SECONDS="60",
                      AUDITOR_MAX_CONCURRENT_PROBES="4", AUDITOR_BODY_TIMEOUT_SECONDS="60")
    yield s
    s.stop()


def test_a_thousand_idle_sockets_leave_probes_and_other_clients_served(server):
    """A client on 127.0.0.1 holds a keep-alive connection; another (127.0.0.2) opens
    1,000 sockets and sends nothing, reaching the default AUDITOR_MAX_CONNECTIONS (1,000).
    Then: 20 × `/healthz` and 20 × `/readyz` on new connections all 200, an authenticated
    `GET /v1/runs` on a new connection 200, and on the kept-alive connection too (it was
    not closed: the flood's own idle sockets were, the longest idle first)."""
    server.start()
    kept = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    assert _request(kept, "/v1/runs", AUTH).startswith(b"HTTP/1.1 200")
    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(ATTACKER, 0))
             for _ in range(1000)]
    try:
        answers = [httpx.get(f"{server.url}{path}", timeout=10).status_code
                   for path in ("/healthz", "/readyz") for _ in range(20)]
        assert answers == [200] * 40
        assert httpx.get(f"{server.url}/v1/runs", headers=AUTH, timeout=10).status_code == 200
        assert _request(kept, "/v1/runs", AUTH).startswith(b"HTTP/1.1 200")
        time.sleep(0.2)  # the closes of the last evictions reach this side
        closed = [i for i, s in enumerate(flood) if _closed(s)]
        # one made room for the 1,000th flood socket, one or more for the probes (each
        # probe's connection is gone before the next unless the server saw its close late)
        assert 2 <= len(closed) <= 43, closed
        assert closed[0] == 0  # the longest idle first
    finally:
        for s in flood:
            s.close()
        kept.close()


def test_with_no_idle_connection_new_ones_may_still_probe(server):
    """AUDITOR_MAX_CONNECTIONS=20, all 20 with a request in progress (a POST whose body
    never comes): nothing is idle to close. A new connection may still ask for `/healthz`
    or `/readyz` (200, then closed), anything else is the 503 "too many open connections";
    4 (AUDITOR_MAX_CONCURRENT_PROBES) such probe connections held idle make the next
    connection a 503 at once; they are closed after 2 s without a request."""
    server.env["AUDITOR_MAX_CONNECTIONS"] = "20"
    server.start()
    busy = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(f"POST /v1/reports HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
        busy.append(s)
    try:
        time.sleep(0.5)  # every request has started: each waits for its body
        for path in ("/healthz", "/readyz"):
            r = httpx.get(f"{server.url}{path}", timeout=10)
            assert r.status_code == 200 and r.headers["connection"] == "close", (path, r.text)
        r = httpx.get(f"{server.url}/v1/runs", headers=AUTH, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["detail"] == "too many open connections"
        held = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(4)]
        extra = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        extra.settimeout(10)
        assert extra.recv(4096).startswith(b"HTTP/1.1 503")
        extra.close()
        time.sleep(2.5)
        assert all(_closed(s) for s in held)
        for s in held:
            s.close()
        assert not any(_closed(s) for s in busy)  # requests in progress are never closed for room
    finally:
        for s in busy:
            s.close()
