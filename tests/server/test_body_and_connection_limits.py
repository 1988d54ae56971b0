"""The limits on what one client may hold of the service: body size (413 before reading),
bodies parsed off the event loop and freed at once, bytes in flight under a memory cap,
idle connections closed and capped, header size. Real `auditor serve` processes over
real sockets."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import only_series as series_of
from auditor.testing.http import post_reports as post
from auditor.testing.http import raw_request as _raw_request
from auditor.testing.server import CAPPED_HEADER_TIMEOUT as HEADER_TIMEOUT
from auditor.testing.server import CAPPED_RSS_BOUND as RSS_BOUND
from auditor.testing.server import ServerProcess
from auditor.testing.wait import wait_until


def test_a_body_over_the_cap_is_a_413_before_it_is_read(server):
    """A declared 500 MB body gets a 413 at once (nothing of it is sent); a chunked body
    with no declared length gets a 413 as soon as the cap is passed, the rest unread; the
    server's RSS stays bounded."""
    head = (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 500000000\r\n\r\n")
    answer, took = _raw_request(server, head)
    assert answer.startswith(b"HTTP/1.1 413") and took < 2.0, answer[:300]
    assert b"AUDITOR_MAX_BODY_BYTES" in answer

    def chunks():
        piece = b"x" * 65536
        for _ in range(600):  # 39 MB offered, the cap is 16 MiB
            yield b"%x\r\n%s\r\n" % (len(piece), piece)

    head = (b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer, _ = _raw_request(server, head, chunks())
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert server.peak_rss() < RSS_BOUND


def test_the_largest_accepted_body_is_stored_in_bounded_memory(server, run_id):
    """A body near the 16 MiB cap (10,000 reports — the batch limit — each with 250 group
    ranks) is accepted and audited, and the server's peak RSS stays under RSS_BOUND."""
    world = 250
    reports = []
    for step in range(40):
        for rank in range(world):
            reports.append({"run_id": run_id, "statistic": "n", "kind": "sum", "step": step, "rank": rank,
                            "world_size": world, "sizes": {"dp": world}, "coords": {"dp": rank},
                            "local": {"sum": 1.0}, "applied": {"sum": float(world)},
                            "group_ranks": list(range(world))})
    body = json.dumps({"reports": reports}, separators=(",", ":")).encode()
    assert 10 * 2**20 < len(body) < 16 * 2**20, len(body)
    r = server.post("/v1/reports", content=body, headers={"content-type": "application/json"})
    assert r.json() == {"accepted": 10_000, "duplicates": 0, "steps_audited": 40}, r.text
    assert series_of(server, run_id)["steps_consistent"] == 40
    assert server.peak_rss() < RSS_BOUND, server.peak_rss()


def test_invalid_bodies_are_parsed_off_the_event_loop(server):
    """While 4 clients post 6 MB bodies that fail validation (re-parsed on the event loop
    before, /healthz then took 4 s each), /healthz answers in a median under 1 s and never
    over 3 s. The bounds sit well below the regression and well above what a loaded 2-core
    machine adds (the validating threads still share the GIL: a median of 0.14 s was seen
    at load 10)."""
    bad = json.dumps({"reports": [{"run_id": "x", "step": -1, "rank": 0}] * 150_000}).encode()
    assert len(bad) > 5 * 2**20
    stop = threading.Event()

    def flood():
        with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as c:
            while not stop.is_set():
                r = c.post(f"{server.url}/v1/reports", content=bad)
                assert r.status_code == 422
                assert r.json()["errors_truncated"] is True and len(r.json()["errors"]) == 1000

    workers = [threading.Thread(target=flood) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        time.sleep(1.0)
        took = []
        for _ in range(30):  # a new connection each time, as a load balancer's probe makes
            t0 = time.perf_counter()
            assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
            took.append(time.perf_counter() - t0)
            time.sleep(0.05)
    finally:
        stop.set()
        for w in workers:
            w.join(60)
    took.sort()
    assert took[15] < 1.0 and took[-1] < 3.0, took


def test_idle_connections_are_closed_and_capped(server):
    """300 connections that never send a request (1,100 exhausted the fd limit before):
    those past max_connections (100) are answered 503 and closed at once, the others are
    closed after the header timeout (5 s); a half-sent request line is closed too; the
    service keeps serving and logs the condition a few times, not once per socket."""
    log_before = server.log_path.read_text()
    socks = []
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        socks.append(s)
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    slow.sendall(b"GET /v1/runs HTTP/1.1\r\nHo")  # slowloris: never finishes its headers
    time.sleep(HEADER_TIMEOUT + 1.5)
    closed = 0
    for s in socks + [slow]:
        s.settimeout(2)
        try:
            data = s.recv(4096)
            closed += data == b"" or data.startswith(b"HTTP/1.1 503")
        except (ConnectionResetError, socket.timeout):
            closed += isinstance(s, socket.socket)
        finally:
            s.close()
    assert closed == 301
    assert server.get("/v1/runs").status_code == 200
    new_lines = server.log_path.read_text()[len(log_before):].splitlines()
    assert 1 <= len([ln for ln in new_lines if "AUDITOR_MAX_CONNECTIONS" in ln or "HEADER_TIMEOUT" in ln]) <= 4, \
        new_lines[:20]


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (or 5 s of silence)."""
    sock.settimeout(5)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return out


def _send(sock: socket.socket, data: bytes, chunk: int = 16384) -> None:
    """Send ``data`` in chunks; stop quietly once the server has closed the connection."""
    try:
        for i in range(0, len(data), chunk):
            sock.sendall(data[i:i + chunk])
    except (BrokenPipeError, ConnectionResetError):
        pass


def test_headers_past_the_limit_are_a_400_and_the_connection_closes(server):
    """AUDITOR_MAX_HEADER_BYTES (64 KiB default): a request whose one header is 100 KiB, and
    one whose header line never ends (300 KiB, sent in 16 KiB chunks), each get a 400 naming
    the limit and a closed connection; a 60 KiB header split over chunks and a 2 MiB body
    behind small headers are not refused; the service keeps serving."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"GET /v1/runs HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100 * 1024 + b"\r\n\r\n")
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 400") and b"AUDITOR_MAX_HEADER_BYTES" in got, got[:300]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        _send(s, b"GET /v1/runs HTTP/1.1\r\nHost: x\r\nX-Endless: " + b"a" * 300 * 1024)
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 400") and b"AUDITOR_MAX_HEADER_BYTES" in got, got[:300]
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        _send(s, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Ok: " + b"a" * 60 * 1024
              + b"\r\n\r\n", chunk=8192)
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 200"), got[:300]
    body = b'{"reports": [' + b" " * (2 * 2**20) + b"]}"
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        _send(s, b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
              + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = _answer(s)
    assert got.startswith(b"HTTP/1.1 422") and b"reports" in got, got[:300]  # too few reports, not the header limit
    assert server.get("/v1/runs").status_code == 200


def test_a_request_body_is_freed_by_reference_counting_not_the_cycle_collector():
    """Reading a body leaves no reference cycle holding its chunks: 20 bodies of 1 MiB in
    64 KiB chunks, read through a real Starlette request with the cycle collector off, leave
    less than 2 MiB allocated. ``asyncio.wait_for`` per chunk left one: the task it wrapped
    the read in kept the StopAsyncIteration whose traceback held the reader's frame and so
    every chunk, and a server that allocates few Python objects runs the full collection
    rarely (server RSS climbed 98 -> 890 MiB over 3 M reports, 220 flat after;
    benchmarks/memory.py)."""
    import asyncio
    import gc
    import tracemalloc

    from starlette.requests import Request

    from auditor.server.bodies import read_body

    async def bodies():
        for _ in range(20):
            chunks = iter([*(False,) * 15, True])

            async def receive():
                return {"type": "http.request", "body": bytes(65536), "more_body": not next(chunks)}

            scope = {"type": "http", "method": "POST", "path": "/v1/reports", "headers": []}
            assert len(await read_body(Request(scope, receive), 2**24, 5.0, 60.0)) == 2**20

    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:  # an event loop of its own, in a thread: another test may leave one running in this one
        done: list[bool] = []
        reader = threading.Thread(target=lambda: done.append(asyncio.run(bodies()) is None))
        reader.start()
        reader.join(60)
        assert done == [True]  # every body read whole (the asserts inside ran)
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        gc.enable()
    assert held < 2 * 2**20, held


#: RLIMIT_AS of the servers below: a 1 GiB container's hard cap (thread stacks and malloc
#: arenas count), under which concurrent 16 MB bodies were 500s (MemoryError, "can't start
#: new thread") before the budget of body bytes in flight.
ADDRESS_SPACE_LIMIT = 1 << 30


MiB = 2**20


def _in_flight(server) -> float:
    """The server's ``auditor_body_bytes_in_flight`` gauge, from /metrics."""
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("auditor_body_bytes_in_flight "):
            return float(line.split()[1])
    raise AssertionError("auditor_body_bytes_in_flight not exported")


def _big_body(run_id: str, dp: int = 128) -> bytes:
    """10,000 reports (the batch limit) of a correct dp×2 world, one with a NaN applied
    variance (the pydantic path, the costlier decode): 16 MB at dp=128."""
    from factory import world_reports

    reports, step = [], 0
    while len(reports) < 10_000:
        reports += world_reports(run_id, step=step, dp=dp, cp=2)
        step += 1
    reports = reports[:10_000]
    reports[0]["applied"]["var"] = float("nan")
    return json.dumps({"reports": reports}).encode()


def test_concurrent_large_bodies_under_a_1_gib_cap_are_200_or_503_never_500(tmp_path, run_id):
    """14 clients post a 16 MB body each at once (10 with Content-Length, 4 streamed without)
    to a server capped at RLIMIT_AS = 1 GiB: every answer is a 200 storing the whole batch
    or a 503 `overloaded` with Retry-After (500s before: MemoryError, "can't start new
    thread"; the server peaked at 988 MB RSS for 8 such bodies); the bytes in flight are
    back to 0, and a normal batch is then stored and audited with its exact verdict."""
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "s.log",
                      address_space_limit=ADDRESS_SPACE_LIMIT).start()
    try:
        body = _big_body(run_id)
        assert 15 * MiB < len(body) <= 16 * MiB, len(body)

        def send(i: int) -> httpx.Response:
            content = body if i < 10 else (body[j:j + MiB] for j in range(0, len(body), MiB))
            return httpx.post(f"{s.url}/v1/reports", content=content, timeout=60,
                              headers={"content-type": "application/json"})

        with ThreadPoolExecutor(14) as pool:
            answers = list(pool.map(send, range(14)))
        codes = sorted(r.status_code for r in answers)
        assert set(codes) <= {200, 503} and 200 in codes and 503 in codes, codes
        stored = [r.json() for r in answers if r.status_code == 200]
        # the first stores the 10,000 reports (39 complete steps of 256), the others re-send them
        assert sorted(x["accepted"] for x in stored) == [0] * (len(stored) - 1) + [10_000], stored
        assert all(x["accepted"] + x["duplicates"] == 10_000 for x in stored), stored
        for r in answers:
            if r.status_code == 503:
                body503 = assert_problem(r, 503, "overloaded")
                assert r.headers["retry-after"] == "1" and "AUDITOR_MAX_BODY_BYTES_IN_FLIGHT" in body503["detail"]
        assert wait_until(lambda: _in_flight(s) == 0.0, 10, "the bytes in flight back to 0")
        assert s.peak_rss() < 700 * MiB, s.peak_rss()
        assert "Traceback" not in (tmp_path / "s.log").read_text()

        other = run_id + "-after"
        r = post(s, reference_reports(other, buggy=True))
        assert r.json() == {"accepted": 2, "duplicates": 0, "steps_audited": 1}, r.text
        st = series_of(s, other)
        assert (st["steps_audited"], st["steps_inconsistent"]) == (1, 1)
        assert set(st["faults"]) == {"cp_disagreement", "group_mismatch", "wrong_group"}
        assert _in_flight(s) == 0.0
    finally:
        s.stop()


def test_the_bytes_in_flight_return_to_zero_after_every_outcome(tmp_path, run_id):
    """With room for one 1 MiB body (AUDITOR_MAX_BODY_BYTES = AUDITOR_MAX_BODY_BYTES_IN_FLIGHT
    = 1 MiB, a 0.5 s wait): a body declared and stalled holds exactly its length; a second
    body waits, then gets 503 with Retry-After, unread; a body without Content-Length that
    outgrows the room left is a 503 at once, and gives back what it took; the stalled
    client going away mid-body gives everything back; then a 200, a 422, a 413 and a 415
    each leave the gauge at 0, and a PUT /v1/runs as well."""
    s = ServerProcess(f"sqlite:///{tmp_path / 'a.db'}", tmp_path / "s.log", address_space_limit=ADDRESS_SPACE_LIMIT,
                      AUDITOR_MAX_BODY_BYTES=str(MiB), AUDITOR_MAX_BODY_BYTES_IN_FLIGHT=str(MiB),
                      AUDITOR_BODY_BUDGET_WAIT_SECONDS="0.5").start()

    def head(length: int | None) -> bytes:
        size = b"Content-Length: %d\r\n" % length if length is not None else b"Transfer-Encoding: chunked\r\n"
        return b"POST /v1/reports HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + size + b"\r\n"

    try:
        assert _in_flight(s) == 0.0
        stalled = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        try:
            stalled.sendall(head(700_000) + b'{"reports": [')  # and nothing more, for now
            assert wait_until(lambda: _in_flight(s) == 700_000.0, 10, "the stalled body's bytes taken")

            # a second declared body does not fit: it waits 0.5 s, then 503, its body unread
            answer, took = _raw_request(s, head(400_000) + b"x" * 1000)
            assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer[:400]
            assert b"AUDITOR_MAX_BODY_BYTES_IN_FLIGHT" in answer and 0.4 < took < 5.0, (answer[:400], took)
            assert _in_flight(s) == 700_000.0

            # a chunked body: 200,000 bytes fit, the next 200,000 do not -> 503 at once
            piece = b" " * 200_000
            chunk = b"%x\r\n%s\r\n" % (len(piece), piece)
            with socket.create_connection(("127.0.0.1", s.port), timeout=10) as sock:
                sock.sendall(head(None) + chunk)
                assert wait_until(lambda: _in_flight(s) == 900_000.0, 10, "the chunked body's first bytes")
                answer = b""
                try:
                    sock.sendall(chunk)
                    while not answer.endswith(b"}") and (part := sock.recv(65536)):
                        answer += part
                except (BrokenPipeError, ConnectionResetError):
                    pass
            assert answer.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in answer.lower(), answer[:400]
            assert wait_until(lambda: _in_flight(s) == 700_000.0, 10, "the chunked body's bytes given back")
        finally:
            stalled.close()  # the client goes away mid-body
        assert wait_until(lambda: _in_flight(s) == 0.0, 10, "the disconnected body's bytes given back")

        assert post(s, reference_reports(run_id, buggy=False)).json() == \
            {"accepted": 2, "duplicates": 0, "steps_audited": 1}
        assert _in_flight(s) == 0.0
        bad = reference_reports(run_id, buggy=False, step=1)
        bad[0]["rank"] = -1
        assert_problem(post(s, bad), 422, "validation")
        assert _in_flight(s) == 0.0
        answer, _ = _raw_request(s, head(2 * MiB))
        assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
        assert _in_flight(s) == 0.0
        r = s.post("/v1/reports", content=b"{}", headers={"content-type": "text/plain"})
        assert_problem(r, 415, "unsupported_media_type")
        assert _in_flight(s) == 0.0
        r = s.put(f"/v1/runs/{run_id}-reg", json={"world_size": 2, "sizes": {"dp": 1, "cp": 2}})
        assert r.status_code == 200, r.text
        assert _in_flight(s) == 0.0
        st = series_of(s, run_id)
        assert (st["steps_audited"], st["steps_consistent"]) == (1, 1)
    finally:
        s.stop()
