"""A fresh user's findings against `auditor serve` (issue 9, reliability), each kept as a
test of its kind over real HTTP on real SQLite and PostgreSQL: start-up and shutdown,
probes under load and slow bodies, impossible moments, statistic names with "/", log noise,
limits named once, content types, and the pages' wording.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import ServerProcess
from factory import reference_reports


def auditor(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True, timeout=timeout)


# ------------------------------------------------------------------ 1. start-up and shutdown
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


# ------------------------------------------------------------------ a capped server for the hostile cases
#: RLIMIT_DATA of the server under test (hostile input must fail the server, not the machine).
MEMORY_LIMIT = 1536 * 2**20
REQUEST_CAP = 20


@pytest.fixture(scope="module")
def capped(database_url, tmp_path_factory):
    """One memory-capped service per backend at log level info: 20 requests in progress,
    body chunk timeout 2 s, whole-body deadline 4 s, world size limit 4,096."""
    s = ServerProcess(
        database_url, tmp_path_factory.mktemp("newuser") / "server.log", args=("--log-level", "info"),
        memory_limit=MEMORY_LIMIT, AUDITOR_MAX_CONCURRENT_REQUESTS=str(REQUEST_CAP),
        AUDITOR_BODY_TIMEOUT_SECONDS="2", AUDITOR_BODY_DEADLINE_SECONDS="4", AUDITOR_MAX_WORLD_SIZE="4096",
    ).start()
    yield s
    s.stop()


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


# ------------------------------------------------------------------ 2. probes under load, slow bodies
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


# ------------------------------------------------------------------ 5. log noise
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


# ------------------------------------------------------------------ 7. content types
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


# ------------------------------------------------------------------ 3. impossible moments
@pytest.mark.parametrize("change, field, words", [
    ({"min": -1e308, "max": 1e308}, "reports[0].local.min", "larger than √sum_sq allows for a 0/1 mask"),  # the reproducer
    ({"max": 1e3}, "reports[0].local.max", "larger than √sum_sq allows for a 0/1 mask"),
    ({"min": -1.0, "max": -2.0}, "reports[0].local.max", "must be <= max"),
    ({"sum": 1e4, "sum_sq": 1e7}, "reports[0].local.max", "lies above max"),
    ({"sum": -1e4, "sum_sq": 1e7}, "reports[0].local.min", "lies below min"),
])
def test_local_moments_inconsistent_with_each_other_are_a_422_naming_the_field(capped, run_id, change, field, words):
    """min/max = ∓1e308 with sum_sq ≈ 170 was stored and judged consistent with an applied
    error of 7.8e299 σ. A range no masked-in element can have, or a mean outside the range,
    is now refused naming the wire field; nothing is stored. NaN/Inf still pass (non_finite)."""
    reports = reference_reports(run_id, buggy=False)
    reports[0]["local"].update(change)
    r = capped.post("/v1/reports", json={"reports": reports})
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert any(e["field"] == field and words in e["msg"] for e in errors), errors
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    reports[0]["local"].update(min=float("-inf"), max=float("inf"))
    r = httpx.post(capped.url + "/v1/reports", content=__import__("json").dumps({"reports": reports}).encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_weighted_mask_report_is_accepted_when_it_says_so(capped, run_id):
    """Values (3, 0) with weights (0.5, 0.5): count 1, sum 1.5, sum_sq 4.5, max 3 — a correct
    weighted report whose max² is above sum_sq. Without ``local.weighted`` the √sum_sq rule
    (0/1 masks only) refuses it with a 422 that says how to fix it, nothing stored; with
    ``weighted: true`` it is stored and audited consistent. The other range rules still hold
    for a weighted report (a mean above max is refused)."""
    local = {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "min": 0.0, "max": 3.0}
    report = {"run_id": run_id, "statistic": "advantages", "step": 0, "rank": 0, "world_size": 1, "local": local,
              "applied": {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "mean": 1.5, "var": 2.25}, "group_ranks": [0]}
    r = capped.post("/v1/reports", json={"reports": [report]})
    assert r.status_code == 422, r.text
    (err,) = r.json()["errors"]
    assert err["field"] == "reports[0].local.max", err
    assert ("|max| (3) is larger than √sum_sq allows for a 0/1 mask (√sum_sq = 2.12132" in err["msg"]
            and err["msg"].endswith("if the mask weights elements, set local.weighted=true")), err
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
    local["weighted"] = True
    r = capped.post("/v1/reports", json={"reports": [report]})
    assert r.status_code == 200 and r.json()["accepted"] == 1, r.text
    (stat,) = capped.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert (stat["steps_consistent"], stat["steps_inconsistent"]) == (1, 0), stat
    bad = dict(report, step=1, local=dict(local, max=1.0))  # mean 1.5 > max 1: refused, weighted or not
    r = capped.post("/v1/reports", json={"reports": [bad]})
    assert r.status_code == 422 and r.json()["errors"][0]["field"] == "reports[0].local.max", r.text
    assert "lies above max" in r.json()["errors"][0]["msg"]


def test_correct_float32_and_bfloat16_moments_never_trip_the_range_rules():
    """Moments of real data accumulated in float32 (and values rounded to bfloat16), with
    wide, shifted, tiny and one-element sets, 0/1 masks: every one is accepted by both
    decoders (the rules' slack is the rounding they can show)."""
    import numpy as np
    import torch

    from auditor.schemas import LocalStats, decode_report_batch, validate_report_batch

    def fast(loc: dict):
        """The fast decoder's local block of a one-report body (None: refused), checked to
        agree with the pydantic models on the whole report (which adds Cauchy-Schwarz)."""
        body = json.dumps({"reports": [{"run_id": "r", "statistic": "s", "step": 0, "rank": 0, "world_size": 1,
                                        "local": loc}]}).encode()
        got = decode_report_batch(body)
        if all(math.isfinite(v) for v in loc.values()):  # msgspec reads no Infinity token: pydantic's alone
            assert (got is None) == (validate_report_batch(body, 10)[0] is None), loc
        return None if got is None else got[0].local

    rng = np.random.default_rng(7)
    for trial in range(400):
        n = int(rng.choice([1, 2, 3, 17, 1000, 100_000]))
        scale = float(10.0 ** rng.uniform(-30, 30))
        v = (rng.standard_normal(n) * scale + rng.choice([0.0, 1e3 * scale])).astype(np.float32)
        if trial % 4 == 0:
            v = torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy()
        if not np.isfinite(v).all() or not np.isfinite(np.square(v, dtype=np.float32)).all():
            continue
        loc = {"count": float(n), "sum": float(np.sum(v, dtype=np.float32)),
               "sum_sq": float(np.sum(np.square(v), dtype=np.float32)), "min": float(v.min()), "max": float(v.max())}
        LocalStats.model_validate(loc, strict=True)
        fast(loc)
    # a weighted mask (values 1 and 10, weights 1 and 0.5): Σm·v² = 51 < 10², still accepted
    weighted = {"count": 1.5, "sum": 6.0, "sum_sq": 51.0, "min": 1.0, "max": 10.0}
    LocalStats.model_validate(weighted, strict=True)
    assert fast(weighted) is not None
    # weighted with a whole count (the wire example) is accepted only with the flag, by both
    example = {"count": 1.0, "sum": 1.5, "sum_sq": 4.5, "min": 0.0, "max": 3.0}
    with pytest.raises(ValueError, match="set local.weighted=true"):
        LocalStats.model_validate(example, strict=True)
    assert fast(example) is None
    assert LocalStats.model_validate(dict(example, weighted=True), strict=True).weighted is True
    assert fast(dict(example, weighted=True)).weighted is True


# ------------------------------------------------------------------ 4. "/" in statistic names
def test_statistics_with_slashes_are_read_back_and_unaddressable_names_refused(capped, run_id):
    """The reproducer: "a/b" and "policy/grad_norm" were stored but every route with
    {statistic} answered 404. Now both step routes take "/" (escaped or not), and so does
    auditor.Reader; names with an empty, "." or ".." part (which clients and proxies
    resolve away) are a 422 naming reports[i].statistic."""
    from auditor import Reader

    for bad in ("..", ".", "a//b", "a/", "/a", "a/../b", "a/./b"):
        r = capped.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False, statistic=bad)})
        assert r.status_code == 422, (bad, r.text)
        assert {e["field"] for e in r.json()["errors"]} == {"reports[0].statistic", "reports[1].statistic"}, r.text
    names = ("a/b", "policy/grad_norm", "x/steps", "steps")
    for name in names:
        for step, buggy in ((0, True), (1, False)):
            r = capped.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=buggy, statistic=name,
                                                                             step=step)})
            assert r.status_code == 200, r.text
    for name in names:
        for spelled in (name, name.replace("/", "%2F")):
            r = capped.get(f"/v1/runs/{run_id}/statistics/{spelled}/steps")
            assert r.status_code == 200, (spelled, r.text)
            assert r.json()["statistic"] == name and [s["verdict"] for s in r.json()["steps"]] == \
                ["inconsistent", "consistent"], r.json()
            r = capped.get(f"/v1/runs/{run_id}/statistics/{spelled}/steps/0")
            assert r.status_code == 200 and r.json()["verdict"] == "inconsistent", (spelled, r.text)
    with Reader(capped.url) as reader:
        for name in names:
            assert [s.step for s in reader.steps(run_id, name)] == [0, 1]
            assert reader.step(run_id, name, 0).verdict == "inconsistent"
            assert reader.report(run_id).statistic(name).steps_inconsistent == 1


# ------------------------------------------------------------------ 6. one limit, one number
def test_every_limit_message_names_the_configured_limit(capped, run_id):
    """The reproducer: world_size 10^9 got "less than or equal to 1048576" (the schema's
    ceiling) and 100,000 got "65536 (AUDITOR_MAX_WORLD_SIZE)". Every such 422, in reports
    and run registrations, below or above the ceiling, now names the configured limit
    (4,096 here) and its setting; the ceiling's number is never shown."""
    def report(**change):
        (r, _) = reference_reports(run_id, buggy=False)
        for k, v in change.items():
            r[k] = v
        return r

    cases = [
        (report(world_size=10**9, group_ranks=[0]), "reports[0].world_size", "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(world_size=5000, sizes={"dp": 2500, "cp": 2}), "reports[0].world_size",
         "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(sizes={"dp": 2**21, "cp": 2}), "reports[0].sizes.dp", "4096 (AUDITOR_MAX_WORLD_SIZE)"),
        (report(num_microbatches=2**21), "reports[0].num_microbatches", "4096 (AUDITOR_MAX_NUM_MICROBATCHES)"),
        (report(num_microbatches=5000), "reports[0].num_microbatches", "4096 (AUDITOR_MAX_NUM_MICROBATCHES)"),
    ]
    for body, field, words in cases:
        r = capped.post("/v1/reports", json={"reports": [body]})
        assert r.status_code == 422 and "1048576" not in r.text, r.text
        assert any(e["field"] == field and words in e["msg"] for e in r.json()["errors"]), (field, r.text)
    for world in (10**9, 5000):
        r = capped.put(f"/v1/runs/{run_id}", json={"world_size": world, "sizes": {"dp": world}})
        assert r.status_code == 422 and "1048576" not in r.text, r.text
        assert "4096 (AUDITOR_MAX_WORLD_SIZE)" in r.json()["errors"][0]["msg"], r.text
    assert capped.get(f"/v1/runs/{run_id}").status_code == 404
