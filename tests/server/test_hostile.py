"""Issue 9: hostile and real-world input against a real, memory-capped `auditor serve`
process over real HTTP, on SQLite and on PostgreSQL. Each test is one *kind* of fault with
the issue's reproducer among its inputs: poison reports, late reports, coordinate clashes,
body size, connections, database locks, cardinality, run lifecycle, auth.
"""

from __future__ import annotations

import json
import socket
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import sqlalchemy as sa
from conftest import ServerProcess
from factory import reference_reports

#: RLIMIT_DATA of the server under test: past it the server fails instead of the machine.
MEMORY_LIMIT = 1536 * 2**20
#: What the tests below assert the server's peak RSS stays under (docs/deploy.md "Limits
#: and security": the largest accepted body and a step at the expected-count limit).
RSS_BOUND = 1024 * 2**20
DELETE_CHUNK = 7


HEADER_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def server(database_url, tmp_path_factory):
    """One capped service per backend: grace 1 s, sweep every 0.2 s, header timeout 5 s
    (1 s closed the connections of this very test process when a loaded machine did not
    schedule it for a second between connecting and sending: a flake),
    body chunk timeout 2 s, 100 connections, 50 statistics per run, delete chunks of 7."""
    s = ServerProcess(
        database_url, tmp_path_factory.mktemp("hostile") / "server.log", memory_limit=MEMORY_LIMIT,
        AUDITOR_GRACE_SECONDS="1", AUDITOR_SWEEP_INTERVAL_SECONDS="0.2", AUDITOR_HEADER_TIMEOUT_SECONDS=str(HEADER_TIMEOUT),
        AUDITOR_BODY_TIMEOUT_SECONDS="2", AUDITOR_MAX_CONNECTIONS="100", AUDITOR_MAX_STATISTICS_PER_RUN="50",
        AUDITOR_DELETE_CHUNK_ROWS=str(DELETE_CHUNK), AUDITOR_DB_LOCK_TIMEOUT_SECONDS="2",
    ).start()
    yield s
    s.stop()


def post(server, reports: list[dict], **kw) -> httpx.Response:
    return server.post("/v1/reports", json={"reports": reports}, **kw)


def wait_until(fn, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = fn()
        if out:
            return out
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def series_of(server, run_id: str) -> dict:
    (s,) = server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    return s


def assert_problem(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json", r.headers
    body = r.json()
    assert body["type"] == f"urn:auditor:problem:{code}" and body["status"] == status and body["title"], body
    return body


# ------------------------------------------------------------------ 1. expected-count bomb
def bomb(run_id: str, world: int, nmb: int, rank: int = 0) -> dict:
    return {"run_id": run_id, "statistic": "advantages", "step": 0, "rank": rank, "world_size": world,
            "sizes": {"dp": world}, "coords": {"dp": rank}, "num_microbatches": nmb, "microbatch": 0,
            "local": {"count": 1.0, "sum": 1.0, "sum_sq": 1.0},
            "applied": {"count": 1.0, "sum": 1.0, "sum_sq": 1.0}}


def test_expected_count_bomb_is_a_422_naming_the_field(server, run_id):
    """The issue's reproducer (world 4,096 × 1,048,576 microbatches), a product past 2^31 (a
    500 on PostgreSQL before) and each limit alone are 422s naming the field; nothing is
    stored."""
    cases = [
        (bomb(run_id, 4096, 1_048_576), "reports[0].num_microbatches", "AUDITOR_MAX_NUM_MICROBATCHES"),
        (bomb(run_id, 65_536, 4096), "reports[0].num_microbatches", "AUDITOR_MAX_REPORTS_PER_STEP"),
        (bomb(run_id, 4096, 128), "reports[0].num_microbatches", "expects 524288 reports"),
        (bomb(run_id, 131_072, 1), "reports[0].world_size", "AUDITOR_MAX_WORLD_SIZE"),
    ]
    for report, field, words in cases:
        body = assert_problem(post(server, [report]), 422, "validation")
        assert [(e["field"], e["type"]) for e in body["errors"]] == [(field, "limit_exceeded")], body
        assert words in body["errors"][0]["msg"], body
    assert server.get(f"/v1/runs/{run_id}").status_code == 404


def test_a_step_at_the_expected_count_limit_is_swept_in_bounded_memory(server, run_id):
    """One report of a step expecting 4,096 × 64 = 262,144 (the default limit) is accepted;
    after the grace period the sweep audits it `incomplete` with the missing reports as
    ranges (never one per rank and microbatch: the old sweep grew ~230 MB/s and was
    OOM-killed in a loop), /healthz answers meanwhile, and the server's peak RSS stays
    under RSS_BOUND."""
    assert post(server, [bomb(run_id, 4096, 64, rank=7)]).status_code == 200
    s = wait_until(lambda: (x := series_of(server, run_id))["steps_audited"] and x, what="the sweep")
    assert (s["steps_incomplete"], s["faults"]) == (1, {"missing_report": 1})
    (f,) = s["bad_steps"][0]["faults"]
    assert f["evidence"] == {"missing": 262_143, "expected": 262_144, "microbatches": "0-63"}
    assert "ranks 0-4095, microbatches 0-63" in f["message"]
    t0 = time.perf_counter()
    assert server.get("/healthz").status_code == 200 and time.perf_counter() - t0 < 1.0
    assert server.peak_rss() < RSS_BOUND, server.peak_rss()


# ------------------------------------------------------------------ 2. poison values
def test_plus_and_minus_infinity_in_one_report_is_non_finite_not_a_500(server, run_id):
    """local.min = -Infinity and local.max = +Infinity (a 500 in the store before, which the
    client then retried for ever): stored, the step is audited, flagged non_finite, and
    the report and the step read back."""
    a, b = reference_reports(run_id, buggy=False)
    a["local"].update(min=float("-inf"), max=float("inf"))
    b["applied"].update(mean=float("inf"), var=float("-inf"))
    body = json.dumps({"reports": [a, b]}).encode()  # Infinity tokens, as the client sends them
    r = server.post("/v1/reports", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["steps_audited"] == 1, r.text
    s = series_of(server, run_id)
    assert s["steps_inconsistent"] == 1 and "non_finite" in s["faults"]
    step = server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0")
    assert step.status_code == 200 and step.json()["verdict"] == "inconsistent"


def test_every_non_finite_combination_is_stored_and_audited(server, run_id):
    """The kind, not the one input: NaN/±Inf in every float field of local and applied,
    alone and together, with extreme finite values: every batch is a 200 and every step
    gets a verdict (no 500, no step without one)."""
    fields = [("local", k) for k in ("count", "sum", "sum_sq", "min", "max")] + \
             [("applied", k) for k in ("count", "sum", "sum_sq", "mean", "var")]
    values = [float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 5e-324]
    batch = []
    step = 0
    for where, name in fields:
        for v in values:
            a, b = reference_reports(run_id, buggy=step % 2 == 0, step=step)
            a[where][name] = v
            b[where][name] = v if step % 3 else -v
            batch += [a, b]
            step += 1
    r = server.post("/v1/reports", content=json.dumps({"reports": batch}).encode(),
                    headers={"content-type": "application/json"})
    assert r.status_code in (200, 422), r.text  # 422 only where the schema's rules say so
    if r.status_code == 422:  # resend without the reports the schema refused
        bad = {e["loc"][1] for e in r.json()["errors"]}
        steps_bad = {batch[i]["step"] for i in bad}
        batch = [x for x in batch if x["step"] not in steps_bad]
        r = server.post("/v1/reports", content=json.dumps({"reports": batch}).encode(),
                        headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
    n_steps = len({x["step"] for x in batch})
    assert n_steps > 40
    s = series_of(server, run_id)
    assert s["steps_audited"] == n_steps and s["steps_audit_error"] == 0, s
    assert server.get(f"/v1/runs/{run_id}/report", params={"bad_steps": 1000}).status_code == 200


# ------------------------------------------------------------------ 4. late reports
def test_a_late_report_re_audits_the_step_once_and_fixes_every_figure(server, run_id):
    """The buggy reference step: rank 0 reports, the grace period ends (verdict incomplete),
    then rank 1's report arrives. The step is re-audited once: inconsistent with the
    reference faults and sigma; the series counts move from incomplete to inconsistent, the
    missing_report fault is gone, the step keeps previous_verdict and verdict_changed_at,
    the run is not consistent, and /metrics counts both recorded verdicts (its counters
    never go down)."""
    a, b = reference_reports(run_id, buggy=True)
    assert post(server, [a]).status_code == 200
    s = wait_until(lambda: (x := series_of(server, run_id))["steps_audited"] and x, what="the sweep")
    assert (s["steps_incomplete"], s["steps_inconsistent"], s["faults"]) == (1, 0, {"missing_report": 1})
    early = server.get(f"/v1/runs/{run_id}/report").json()  # rank 1 never checked: incomplete, not consistent
    assert (early["status"], early["consistent"]) == ("incomplete", False)

    t_late = time.time()
    r = post(server, [b])
    assert r.json() == {"accepted": 1, "duplicates": 0, "steps_audited": 1}
    assert post(server, [b]).json() == {"accepted": 0, "duplicates": 1, "steps_audited": 0}  # once
    rep = server.get(f"/v1/runs/{run_id}/report").json()
    assert rep["consistent"] is False
    (s,) = rep["statistics"]
    assert (s["steps_audited"], s["steps_incomplete"], s["steps_inconsistent"], s["steps_reaudited"]) == (1, 0, 1, 1)
    assert set(s["faults"]) == {"cp_disagreement", "group_mismatch", "wrong_group"}
    assert (s["first_bad_step"], s["last_bad_step"]) == (0, 0)
    assert s["cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
    (step,) = s["bad_steps"]
    assert (step["verdict"], step["previous_verdict"]) == ("inconsistent", "incomplete")
    assert step["verdict_changed_at"] >= t_late - 1 and step["reports"] == step["expected"] == 2
    m = server.get("/metrics").text
    for verdict, n in (("incomplete", 1), ("inconsistent", 1), ("consistent", 0)):
        assert f'auditor_steps_audited_total{{run="{run_id}",statistic="advantages",verdict="{verdict}"}} {n}.0' in m
    assert f'auditor_faults_total{{kind="missing_report",run="{run_id}",statistic="advantages"}} 1.0' in m
    assert f'auditor_faults_total{{kind="cp_disagreement",run="{run_id}",statistic="advantages"}} 1.0' in m


def test_late_reports_re_audit_exactly_once_across_two_replicas(database_url, tmp_path, run_id):
    """20 steps of a 4-rank world stay incomplete past the grace period; then their last two
    reports arrive at the same time at two replicas on one database. Each step is
    re-audited exactly once: the steps_audited answers sum to 20, every step ends
    consistent with previous_verdict incomplete, and the series counts 20 re-audits."""
    servers = [ServerProcess(database_url, tmp_path / f"r{i}.log", AUDITOR_GRACE_SECONDS="0.5",
                             AUDITOR_SWEEP_INTERVAL_SECONDS="0.2") for i in range(2)]
    for s in servers:
        s.start()
    try:
        world, steps = 4, 20

        def rep(step: int, rank: int) -> dict:
            return {"run_id": run_id, "statistic": "g", "kind": "sum", "step": step, "rank": rank,
                    "world_size": world, "sizes": {"dp": world}, "coords": {"dp": rank},
                    "local": {"sum": 1.0 + rank}, "applied": {"sum": 10.0}}

        assert post(servers[0], [rep(st, r) for st in range(steps) for r in (0, 1)]).status_code == 200
        wait_until(lambda: series_of(servers[0], run_id)["steps_incomplete"] == steps, what="the sweep")
        barrier = threading.Barrier(2)

        def send(i: int) -> int:
            barrier.wait()
            total = 0
            for st in range(steps):
                total += post(servers[i], [rep(st, 2 + i)]).json()["steps_audited"]
            return total

        with ThreadPoolExecutor(2) as pool:
            audited = sum(pool.map(send, range(2)))
        assert audited == steps
        s = series_of(servers[1], run_id)
        assert (s["steps_consistent"], s["steps_incomplete"], s["steps_reaudited"], s["faults"]) == (steps, 0, steps, {})
        for st in (0, steps - 1):
            step = servers[0].get(f"/v1/runs/{run_id}/statistics/g/steps/{st}").json()
            assert (step["verdict"], step["previous_verdict"]) == ("consistent", "incomplete")
    finally:
        for s in servers:
            s.stop()


# ------------------------------------------------------------------ 5. two ranks, one place
def test_two_ranks_claiming_the_same_coordinates_is_a_409_naming_both(server, run_id):
    """Rank 1 claims cp=0, which rank 0 holds: a 409 coordinate_conflict naming both ranks
    and the coordinates, whether rank 0's report is stored already or in the same batch;
    nothing of the batch is stored."""
    a, b = reference_reports(run_id, buggy=False)
    b["coords"]["cp"] = 0
    body = assert_problem(post(server, [a, b]), 409, "coordinate_conflict")
    (c,) = body["conflicts"]
    assert (c["index"], c["rank"], c["other_rank"], c["other_index"]) == (1, 1, 0, 0)
    assert c["coords"] == {"dp": 0, "cp": 0, "tp": 0, "pp": 0} and c["fields"] == ["rank", "coords"]
    assert "rank 1" in body["detail"] and "rank 0" in body["detail"] and "cp=0" in body["detail"]
    assert server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").status_code == 404
    assert post(server, [a]).status_code == 200
    body = assert_problem(post(server, [b]), 409, "coordinate_conflict")
    assert (body["conflicts"][0]["rank"], body["conflicts"][0]["other_rank"]) == (1, 0)
    assert "other_index" not in body["conflicts"][0]
    assert server.get(f"/v1/runs/{run_id}/statistics/advantages/steps/0").json()["reports"] == 1


# ------------------------------------------------------------------ 6. bodies
def _raw_request(server, head: bytes, body_chunks=(), read_timeout: float = 10.0) -> tuple[bytes, float]:
    """Send a raw HTTP request over a socket; return (answer, seconds until it came)."""
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


# ------------------------------------------------------------------ 7. connections
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


# ------------------------------------------------------------------ 8. database contention
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


# ------------------------------------------------------------------ 9. cardinality, lifecycle
def test_statistics_per_run_are_capped_at_registration(server, run_id):
    """A PUT with 100,000 statistics (it held SQLite's write lock for 118 s before) is a
    422 naming `statistics`, answered in under 10 s (well under a second on an idle machine;
    3.2 s seen at load 14); adding a statistic past the limit (50
    here) by a report is a 422 naming reports[i].statistic; nothing past it is stored."""
    stats = {f"s{i}": {"kind": "sum"} for i in range(100_000)}
    t0 = time.perf_counter()
    r = server.put(f"/v1/runs/{run_id}", json={"world_size": 2, "sizes": {"dp": 2}, "statistics": stats})
    body = assert_problem(r, 422, "validation")
    assert body["errors"][0]["field"] == "statistics" and time.perf_counter() - t0 < 10.0
    reg = {"world_size": 2, "sizes": {"dp": 1, "cp": 2},
           "statistics": {f"s{i}": {"kind": "sum"} for i in range(50)}}
    assert server.put(f"/v1/runs/{run_id}", json=reg).status_code == 200
    a, b = reference_reports(run_id, buggy=False, statistic="one-too-many")
    body = assert_problem(post(server, [a, b]), 422, "limit_exceeded")
    assert body["errors"][0]["field"] == "reports[0].statistic" and "AUDITOR_MAX_STATISTICS_PER_RUN" in body["detail"]
    assert len(server.get(f"/v1/runs/{run_id}").json()["statistics"]) == 50


def test_metrics_export_at_most_max_series_and_an_aggregate(fresh_database_url, tmp_path, run_id):
    """With AUDITOR_METRICS_MAX_SERIES=3 and 5 series, /metrics exports the 3 most recently
    active with their own labels and the other 2 summed into run="_other". A database of its
    own: on the shared one, the module's server sweeping an earlier test's open step made
    that series more recently active than run 2 (seen once under load)."""
    s = ServerProcess(fresh_database_url, tmp_path / "m.log", AUDITOR_METRICS_MAX_SERIES="3").start()
    try:
        for i in range(5):
            assert post(s, reference_reports(f"{run_id}-{i}", buggy=i % 2 == 0)).status_code == 200
        lines = [ln for ln in s.get("/metrics").text.splitlines() if ln.startswith("auditor_steps_audited_total{")]
        runs = {ln.split('run="')[1].split('"')[0] for ln in lines}
        mine = {r for r in runs if r.startswith(run_id)}
        assert mine == {f"{run_id}-{i}" for i in (2, 3, 4)}, runs
        other = {ln.split('verdict="')[1].split('"')[0]: float(ln.split()[-1]) for ln in lines if 'run="_other"' in ln}
        assert other == {"consistent": 1.0, "inconsistent": 1.0, "incomplete": 0.0, "audit_error": 0.0,
                         "unverified": 0.0}, other
    finally:
        s.stop()


def test_delete_a_run_in_bounded_chunks(server, run_id):
    """DELETE /v1/runs/{id} removes a run with all its reports, verdicts and faults, 7
    reports per transaction here; other runs stay; the run can then be created anew."""
    other = f"{run_id}-keep"
    batch = [r for st in range(10) for r in reference_reports(run_id, buggy=st % 2 == 0, step=st)]
    assert post(server, batch).json()["steps_audited"] == 10
    assert post(server, reference_reports(other, buggy=False)).status_code == 200
    r = server.get(f"/v1/runs/{run_id}")
    assert r.json()["steps_audited"] == 10
    d = httpx.delete(f"{server.url}/v1/runs/{run_id}", timeout=30)
    assert d.status_code == 200 and d.json() == {"run_id": run_id, "reports": 20, "steps": 10, "statistics": 1}
    assert_problem(server.get(f"/v1/runs/{run_id}"), 404, "not_found")
    assert_problem(httpx.delete(f"{server.url}/v1/runs/{run_id}"), 404, "not_found")
    assert server.get(f"/v1/runs/{other}").json()["steps_audited"] == 1
    assert post(server, reference_reports(run_id, buggy=False)).json()["steps_audited"] == 1  # created anew
    engine = sa.create_engine(server.database_url)
    with engine.connect() as conn:
        n = conn.execute(sa.text("SELECT count(*) FROM series WHERE run_id = :r"), {"r": run_id}).scalar_one()
    engine.dispose()
    assert n == 1


def test_retention_drops_idle_runs_with_their_reports(fresh_database_url, tmp_path, run_id):
    """AUDITOR_RUN_RETENTION_DAYS (here 5 s): the sweep deletes a run idle for longer, with
    its reports and verdicts; a run still reporting (every ~0.3 s, so even a loaded machine
    leaves it far from 5 s idle) stays."""
    s = ServerProcess(fresh_database_url, tmp_path / "r.log", AUDITOR_RUN_RETENTION_DAYS=str(5 / 86400),
                      AUDITOR_SWEEP_INTERVAL_SECONDS="0.3").start()
    try:
        assert post(s, reference_reports(run_id, buggy=True)).status_code == 200
        live = f"{run_id}-live"
        for step in range(60):
            assert post(s, reference_reports(live, buggy=False, step=step)).status_code == 200
            time.sleep(0.3)
            if s.get(f"/v1/runs/{run_id}").status_code == 404:
                break
        assert s.get(f"/v1/runs/{run_id}").status_code == 404
        assert s.get(f"/v1/runs/{live}").status_code == 200
        engine = sa.create_engine(fresh_database_url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT count(*) FROM faults")).scalar_one() == 0
        engine.dispose()
    finally:
        s.stop()


# ------------------------------------------------------------------ 10. auth
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
                     f"/v1/runs/{run_id}/statistics/advantages/steps/0"):
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


# ------------------------------------------------------------------ the command line
def _auditor(*args: str, env: dict | None = None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True, timeout=180,
                          env={**os.environ, **(env or {})})


def test_runs_delete_command(server, run_id):
    """`auditor runs delete RUN_ID` through the service and straight on the database;
    an unknown run exits 2. Without --yes and no terminal to ask on, nothing is deleted:
    exit 2 naming the run and --yes."""
    assert post(server, reference_reports(run_id, buggy=True)).status_code == 200
    out = _auditor("runs", "delete", run_id, "--url", server.url)
    assert out.returncode == 2 and f"not deleting run {run_id} (1 statistic(s), 1 audited step(s)" in out.stderr \
        and out.stderr.rstrip().endswith("pass --yes"), out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 200
    out = _auditor("runs", "delete", run_id, "--url", server.url, "--yes")
    assert out.returncode == 0 and "2 report(s), 1 step(s), 1 statistic(s)" in out.stdout, out.stderr
    assert _auditor("runs", "delete", run_id, "--url", server.url, "--yes").returncode == 2
    assert post(server, reference_reports(run_id, buggy=True)).status_code == 200
    out = _auditor("runs", "delete", run_id, "--database-url", server.database_url, "-y")
    assert out.returncode == 0, out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 404


def test_offline_audit_and_import_of_a_poisoned_spool(server, tmp_path, run_id):
    """A spool holding the issue's poison reports (±Inf, an expected-count bomb, a line
    that is not JSON, a report of another shape): `auditor audit` audits it and exits 0
    (never a traceback, never 1 without --check); `auditor import` delivers every report
    the service accepts, moves the refused ones to the dead-letter file next to the spool,
    and exits 1 (rejected reports), not 2 and not for ever."""
    a, b = reference_reports(run_id, buggy=False)
    a["local"].update(min=float("-inf"), max=float("inf"))
    lines = [json.dumps(a), json.dumps(b), "{not json", json.dumps({"hello": "world"}),
             json.dumps(bomb(f"{run_id}-bomb", 4096, 1_048_576))]
    spool = tmp_path / "rank0.jsonl"
    spool.write_text("\n".join(lines) + "\n")
    out = _auditor("audit", str(spool), "--format", "json")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    runs = {r["run_id"]: r for r in json.loads(out.stdout)}
    assert runs[run_id]["statistics"][0]["faults"].get("non_finite") == 1
    assert runs[f"{run_id}-bomb"]["statistics"][0]["steps_incomplete"] == 1  # no limits offline, no blow-up
    out = _auditor("import", str(spool), "--url", server.url, "--batch-size", "5")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "imported 2 new report(s)" in out.stdout and "3 rejected" in out.stdout, out.stdout
    dead = spool.with_name(spool.name + ".deadletter").read_text().splitlines()
    assert sorted(dead) == sorted(lines[2:])
    assert series_of(server, run_id)["steps_audited"] == 1


def test_import_exit_codes_for_a_wrong_url(server, tmp_path, run_id):
    """`auditor import` exits 2, not 1, when the service cannot be reached (after its
    retries) and at once when the URL answers 404 (a wrong path is a configuration error,
    not a transient one); the spool stays undelivered for a re-run."""
    spool = tmp_path / "rank0.jsonl"
    spool.write_text("\n".join(json.dumps(r) for r in reference_reports(run_id, buggy=False)) + "\n")
    t0 = time.perf_counter()
    out = _auditor("import", str(spool), "--url", f"{server.url}/not-here")
    assert out.returncode == 2 and "404" in out.stderr and time.perf_counter() - t0 < 30, out.stderr
    out = _auditor("import", str(spool), "--url", "http://127.0.0.1:1")
    assert out.returncode == 2 and "re-run to resume" in out.stderr, out.stderr
    assert server.get(f"/v1/runs/{run_id}").status_code == 404
    assert _auditor("import", str(spool), "--url", server.url).returncode == 0


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


def test_characters_a_database_rejects_in_paths_and_queries_are_422(server):
    """NUL (PostgreSQL refuses it in a string), lone surrogates, and over-long names in every
    path and query parameter: a 422 naming the parameter (a 500 on PostgreSQL before), never
    a query with them."""
    bad = ["a%00b", "%ED%A0%80", "x" * 129, "a b", "%F0%9F%92%A5"]
    for value in bad:
        for method, path, name in (
            ("GET", f"/v1/runs/{value}", "path.run_id"),
            ("GET", f"/v1/runs/{value}/report", "path.run_id"),
            ("GET", f"/v1/runs/r/report?statistic={value}", "query.statistic"),
            ("GET", f"/v1/runs/{value}/statistics/s/steps/1", "path.run_id"),
            ("GET", f"/v1/runs/r/statistics/{value}/steps/1", "path.statistic"),
            ("DELETE", f"/v1/runs/{value}", "path.run_id"),
            ("PUT", f"/v1/runs/{value}", "path.run_id"),
        ):
            r = httpx.request(method, f"{server.url}{path}", timeout=30,
                              json={"world_size": 1, "sizes": {}} if method == "PUT" else None)
            body = assert_problem(r, 422, "validation")
            assert body["errors"][0]["field"] == name, (method, path, body)
    r = server.put("/v1/runs/ok-run", json={"world_size": 1, "sizes": {}, "statistics": {"a\u0000": {}}})
    assert_problem(r, 422, "validation")
    r = post(server, [dict(reference_reports("r", buggy=False)[0], run_id="a\u0000")])
    assert assert_problem(r, 422, "validation")["errors"][0]["field"] == "reports[0].run_id"


def test_crafted_cursors_are_422_naming_the_cursor_and_real_ones_still_page(server, run_id):
    """A cursor is opaque base64 of JSON, so a caller can craft one holding values outside its
    column's range: a step beyond BIGINT or infinite (OverflowError on SQLite, DataError on
    PostgreSQL), a run id with NUL or a lone surrogate, a time beyond float range - each was a
    500 (and the connection dropped). Every one is now a 422 naming query.cursor, on the API
    listings and the runs page; the cursors the service hands out still page."""
    import base64

    def cursor(text: str) -> str:
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    reports = [r for step in range(3) for r in reference_reports(run_id, buggy=False, step=step)]
    assert post(server, reports + reference_reports(run_id + "-b", buggy=False)).status_code == 200
    steps = f"/v1/runs/{run_id}/statistics/advantages/steps"
    for text in ["1e400", "-1e400", "Infinity", "NaN", str(2**63), str(2**64), str(2**62 + 1), "-5", "1.5",
                 "true", '"3"', "[1]"]:
        r = server.get(steps, params={"cursor": cursor(text)})
        body = assert_problem(r, 422, "validation")
        assert body["errors"][0]["field"] == "query.cursor", (text, body)
    for text in ['[1e400,"a"]', '[Infinity,"a"]', '[NaN,"a"]', '[1,"a\\u0000"]', '[1,"\\ud800"]',
                 '[' + "9" * 400 + ',"a"]', '[1,"' + "x" * 129 + '"]', '[true,"a"]', '["1","a"]', '[1,5]',
                 '[1,"a",3]', '[1,"a b"]']:
        for path in ("/v1/runs", "/"):
            r = server.get(path, params={"cursor": cursor(text)})
            body = assert_problem(r, 422, "validation")
            assert body["errors"][0]["field"] == "query.cursor", (path, text, body)
    # the service's own cursors: three pages of one step each, then none
    seen, after = [], None
    for _ in range(3):
        page = server.get(steps, params={"limit": 1, **({"cursor": after} if after else {})}).json()
        seen += [s["step"] for s in page["steps"]]
        after = page["next_cursor"]
    assert seen == [0, 1, 2] and after is None
    first = server.get("/v1/runs", params={"limit": 1}).json()
    assert first["next_cursor"] is not None
    assert server.get("/v1/runs", params={"limit": 1, "cursor": first["next_cursor"]}).status_code == 200
    assert server.get("/", params={"cursor": first["next_cursor"]}).status_code == 200
    assert server.get("/healthz").status_code == 200


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


# ------------------------------------------------------------------ 12. bodies in flight
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
