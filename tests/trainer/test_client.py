"""AuditorClient delivery semantics, and the report distributed_masked_whiten emits.

The service side is a real stdlib HTTP server on a free port that records every request and
answers from a script of status codes, so retries, 409 partial rejections and drops are
exercised over real sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import torch.distributed as dist

from auditor.trainer.client import AuditorClient, client_from_env
from auditor.contract.models import Report
from auditor.trainer.hooks import distributed_masked_whiten


BOOM = {"type": "urn:auditor:problem:internal", "status": 500, "detail": "boom"}


class RecordingServer:
    """Records (headers, raw body, parsed body) of every POST; answers from ``script``
    (a list of (status, headers, json body) used in order, then 200). ``GET /readyz``
    answers 200. ``sick_until``: a ``time.monotonic()`` before which every request (GETs
    too) is answered 500, as by a service that is down behind its own error handler."""

    def __init__(self):
        self.requests: list[tuple[dict, bytes, dict]] = []
        self.script: list[tuple[int, dict, dict]] = []
        self.statuses: list[int] = []  # status answered to each request
        self.fail_when = lambda body: False  # a body for which to answer 500 (a poison report)
        self.sick_until = 0.0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status, headers, body):
                payload = json.dumps(body).encode()
                self.send_response(status)
                for k, v in {"Content-Type": "application/json", **headers}.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):  # noqa: N802 - http.server API
                sick = time.monotonic() < outer.sick_until
                self._answer(500 if sick else 200, {}, BOOM if sick else {"status": "ok"})

            def do_POST(self):  # noqa: N802 - http.server API
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append((dict(self.headers), raw, json.loads(raw)))
                status, headers, body = outer.script.pop(0) if outer.script else (200, {}, None)
                if body is None:  # what the service answers: every report of the batch stored
                    body = {"accepted": len(outer.requests[-1][2]["reports"]), "duplicates": 0, "steps_audited": 0}
                if outer.fail_when(outer.requests[-1][2]) or time.monotonic() < outer.sick_until:
                    status, body = 500, BOOM
                outer.statuses.append(status)
                self._answer(status, headers, body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def reports(self) -> list[dict]:
        return [r for _, _, body in self.requests for r in body["reports"]]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(autouse=True)
def spool_dir(tmp_path, monkeypatch):
    """Every client of this module spools under the test's tmp dir."""
    d = tmp_path / "spool"
    monkeypatch.setenv("AUDITOR_SPOOL_DIR", str(d))
    return d


@pytest.fixture
def server():
    s = RecordingServer()
    yield s
    s.close()


def _reports(n: int, start: int = 0) -> list[dict]:
    return [{"run_id": "r", "step": i, "local": {"count": 1.0}} for i in range(start, start + n)]


def test_batches_flush_and_token(server):
    """2500 reports with batch_size 1000 arrive in order in requests of ≤ 1000, with the bearer
    token; flush returns True once all are sent; stats count them."""
    client = AuditorClient(server.url, batch_size=1000, token="s3cret")
    for r in _reports(2500):
        client.report(r)
    assert client.flush(timeout=10)
    assert [r["step"] for r in server.reports()] == list(range(2500))
    assert all(len(body["reports"]) <= 1000 for _, _, body in server.requests)
    assert all(h["Authorization"] == "Bearer s3cret" for h, _, _ in server.requests)
    assert client.stats == {"enqueued": 2500, "sent": 2500, "rejected": 0, "spooled": 0, "replayed": 0,
                            "dropped": 0, "retries": 0, "reports_dropped": 0}
    client.close()


def test_non_finite_values_use_json_nan_tokens(server):
    """NaN and ±Inf go on the wire as the JSON tokens NaN / Infinity / -Infinity."""
    client = AuditorClient(server.url)
    client.report({"local": {"sum": float("nan"), "sum_sq": float("inf"), "min": float("-inf")}})
    assert client.flush(timeout=10)
    raw = server.requests[0][1]
    assert b"NaN" in raw and b"Infinity" in raw and b"-Infinity" in raw
    client.close()


def test_transient_failures_are_retried(server):
    """503 (with Retry-After) and 429 are retried with the same batch until it is accepted."""
    server.script = [(503, {"Retry-After": "0"}, {}), (429, {}, {})]
    client = AuditorClient(server.url)
    for r in _reports(3):
        client.report(r)
    assert client.flush(timeout=10)
    bodies = [body for _, _, body in server.requests]
    assert len(bodies) == 3 and bodies[0] == bodies[1] == bodies[2]
    assert client.stats["retries"] == 2 and client.stats["sent"] == 3
    client.close()


def test_a_wrong_token_is_said_to_be_a_configuration_error_and_retried(server, caplog):
    """A 401 (wrong AUDITOR_TOKEN) is not called "service unavailable": the warning says to
    check AUDITOR_URL and AUDITOR_TOKEN; the reports are kept and retried (an operator may
    fix the token on the service side), and sent once it answers 200."""
    server.script = [(401, {}, {"type": "urn:auditor:problem:unauthorized", "status": 401, "detail": "bad token"})]
    client = AuditorClient(server.url, token="wrong")
    for r in _reports(2):
        client.report(r)
    assert client.flush(timeout=10)
    assert "the service refuses this client's configuration, check AUDITOR_URL and AUDITOR_TOKEN" in caplog.text
    assert "service unavailable" not in caplog.text
    assert client.stats["retries"] == 1 and client.stats["sent"] == 2
    client.close()


def test_409_drops_named_reports_and_resends_the_rest(server):
    """A 409 naming indices 1 and 3 rejects those two; the other three are resent and sent."""
    body = {"type": "urn:auditor:problem:conflicting_report", "title": "t", "status": 409, "detail": "differs",
            "conflicts": [{"index": 1, "fields": ["local.sum"]}, {"index": 3, "fields": ["local.sum"]}]}
    server.script = [(409, {}, body)]
    client = AuditorClient(server.url)
    for r in _reports(5):
        client.report(r)
    assert client.flush(timeout=10)
    assert [r["step"] for r in server.requests[1][2]["reports"]] == [0, 2, 4]
    assert client.stats["rejected"] == 2 and client.stats["sent"] == 3
    client.close()


def test_other_4xx_rejects_the_batch_and_continues(server, spool_dir):
    """A 4xx that is neither transient nor names reports (here 410) rejects the whole batch
    (no retry, to the dead-letter file); later reports are still delivered."""
    server.script = [(410, {}, {"type": "urn:auditor:problem:gone", "status": 410, "detail": "bad"})]
    client = AuditorClient(server.url)
    for r in _reports(4):
        client.report(r)
    assert client.flush(timeout=10)
    client.report(_reports(1, start=9)[0])
    assert client.flush(timeout=10)
    assert client.stats == {"enqueued": 5, "sent": 1, "rejected": 4, "spooled": 0, "replayed": 0,
                            "dropped": 0, "retries": 0, "reports_dropped": 0}
    (dead,) = spool_dir.glob("*.deadletter")
    assert len(dead.read_bytes().splitlines()) == 4
    client.close()


def test_a_422_naming_no_report_is_bisected(server):
    """A 422 for a batch of 4 that names no report (e.g. one line is not JSON) is resent in
    halves until the refused report is alone; the others are delivered."""
    server.fail_when = lambda body: False
    refusal = (422, {}, {"type": "urn:auditor:problem:validation", "status": 422, "detail": "invalid JSON",
                         "errors": [{"field": "body", "loc": [], "msg": "invalid JSON", "type": "json_invalid"}]})
    server.script = [refusal, (200, {}, None), refusal, (200, {}, None), refusal]  # 4 → 2 ok + 2 → 1 ok + 1 refused
    client = AuditorClient(server.url, batch_size=4)
    for r in _reports(4):
        client.report(r)
    assert client.flush(timeout=10)
    assert [len(body["reports"]) for _, _, body in server.requests] == [4, 2, 2, 1, 1]
    assert client.stats["sent"] == 3 and client.stats["rejected"] == 1
    client.close()


def test_unreachable_service_never_raises_and_close_spools(spool_dir):
    """With nothing listening, report() never raises, flush times out (False), retries are
    counted, and close() writes the undelivered reports to the spool (nothing dropped); a
    report after close is counted dropped, not raised."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = AuditorClient(url, timeout=0.2)
    for r in _reports(3):
        client.report(r)
    assert client.flush(timeout=0.5) is False
    client.close(timeout=0.1)
    assert client.stats["retries"] >= 1
    assert client.stats["spooled"] == 3 and client.stats["sent"] == client.stats["dropped"] == 0
    (spool,) = spool_dir.glob("*.jsonl")
    assert sorted(json.loads(line)["step"] for line in spool.read_text().splitlines()) == [0, 1, 2]
    client.report(_reports(1)[0])  # after close: counted, not raised
    assert client.stats["dropped"] == 1


def test_full_queue_without_spool_drops_and_counts(server):
    """With spooling disabled, report() beyond max_queue drops (and counts) instead of
    growing memory; what was held is still delivered, in order. How many the sender took
    off the queue before it filled depends on the thread schedule (a full queue wakes the
    sender: on a loaded CI machine it drained the first two, so 4 of 5 were enqueued), so
    20 reports go in one burst: every one is either enqueued or counted as dropped."""
    client = AuditorClient(server.url, max_queue=2, flush_interval=30.0, spool=False)
    for r in _reports(20):
        client.report(r)
    st = dict(client.stats)
    assert st["enqueued"] + st["dropped"] == 20 and st["dropped"] >= 1, st
    assert client.flush(timeout=10)
    delivered = [r["step"] for r in server.reports()]
    assert len(delivered) == st["enqueued"] and delivered == sorted(delivered), (delivered, st)
    client.close()


def test_client_from_env(monkeypatch):
    """AUDITOR_URL unset → None; set → a client for it with AUDITOR_TOKEN as bearer token."""
    monkeypatch.delenv("AUDITOR_URL", raising=False)
    assert client_from_env() is None
    monkeypatch.setenv("AUDITOR_URL", "http://127.0.0.1:1/")
    monkeypatch.setenv("AUDITOR_TOKEN", "t")
    client = client_from_env()
    assert client.url == "http://127.0.0.1:1"
    assert client._http.headers["Authorization"] == "Bearer t"
    client.close(timeout=0.1)


@pytest.fixture
def world1():
    """A real one-process gloo world (WORLD = [0])."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_whiten_report_matches_the_wire_contract(server, world1):
    """distributed_masked_whiten enqueues one report that validates as a wire Report: local
    float64 moments, applied = the all-reduced sums with the mean/var it whitened with,
    group ranks, and the coordinates of a one-rank world (every coordinate 0, every size 1)."""
    client = AuditorClient(server.url)
    values = torch.tensor([1.5, 1.5, -0.5, -1.0])
    distributed_masked_whiten(values, torch.tensor([1.0, 1.0, 1.0, 0.0]), client=client, run_id="run-1", step=3)
    assert client.flush(timeout=10)
    (sent,) = server.reports()
    report = Report.model_validate(sent)
    assert (report.run_id, report.statistic, report.step, report.rank, report.world_size) == ("run-1", "advantages", 3, 0, 1)
    assert sent["local"] == {"count": 3.0, "sum": 2.5, "sum_sq": 4.75, "min": -0.5, "max": 1.5}
    mean, var = 2.5 / 3, (4.75 / 3 - (2.5 / 3) ** 2) * 3 / 2
    assert sent["applied"]["count"] == 3.0 and sent["applied"]["sum"] == 2.5
    assert sent["applied"]["mean"] == pytest.approx(mean, rel=1e-6)
    assert sent["applied"]["var"] == pytest.approx(var, rel=1e-6)
    assert sent["group_ranks"] == [0] and sent["dtype"] == "float32"
    assert sent["coords"] == {"dp": 0, "cp": 0, "tp": 0, "pp": 0}
    assert sent["sizes"] == {"dp": 1, "cp": 1, "tp": 1, "pp": 1}
    client.close()


def test_whiten_reports_a_globally_empty_mask_then_raises(server, world1):
    """N == 0: the report is still sent (applied count 0, mean/var null), then ValueError."""
    client = AuditorClient(server.url)
    with pytest.raises(ValueError):
        distributed_masked_whiten(torch.zeros(0), torch.zeros(0), client=client, run_id="run-1")
    assert client.flush(timeout=10)
    (sent,) = server.reports()
    Report.model_validate(sent)
    assert sent["local"] == {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "min": None, "max": None}
    assert sent["applied"] == {"count": 0.0, "sum": 0.0, "sum_sq": 0.0, "mean": None, "var": None}
    client.close()


def test_a_poison_report_is_bisected_out_and_the_rest_delivered(server, spool_dir):
    """A batch answered 500 three times in a row is split in halves until the one report
    that makes the service fail is alone; it goes to the dead-letter file next to the spool,
    every other report is delivered, and delivery goes on (issue 9 §2: 180,000 of 200,000
    reports were stuck behind one such report)."""
    poison_step = 5
    server.fail_when = lambda body: any(r["step"] == poison_step for r in body["reports"])
    client = AuditorClient(server.url, batch_size=8)
    for r in _reports(8):
        client.report(r)
    assert client.flush(timeout=30)
    assert client.stats["sent"] == 7 and client.stats["rejected"] == 1
    delivered = sorted(r["step"] for status, (_, _, body) in zip(server.statuses, server.requests)
                       if status == 200 for r in body["reports"])
    assert delivered == [0, 1, 2, 3, 4, 6, 7]
    (dead,) = spool_dir.glob("*.deadletter")
    assert [json.loads(line)["step"] for line in dead.read_bytes().splitlines()] == [poison_step]
    client.report(_reports(1, start=20)[0])  # and later reports still go through
    assert client.flush(timeout=10) and client.stats["sent"] == 8
    client.close()


def test_502_503_504_are_waited_out_never_bisected(server):
    """A load balancer's 502/504 or the service's 503 say "away", not "this batch breaks
    me": the same batch is resent whole until it is accepted."""
    server.script = [(502, {}, {}), (503, {"Retry-After": "0"}, {}), (504, {}, {}), (502, {}, {})]
    client = AuditorClient(server.url, batch_size=4)
    for r in _reports(4):
        client.report(r)
    assert client.flush(timeout=30)
    assert [len(body["reports"]) for _, _, body in server.requests] == [4, 4, 4, 4, 4]
    assert client.stats["sent"] == 4 and client.stats["rejected"] == 0
    client.close()


def test_two_poison_reports_in_different_halves_are_both_isolated(server, spool_dir):
    """Both halves of the first bisection fail (each holds a poison report): that alone
    proves nothing, so the first half is cut further until a sub-batch passes; then each
    poison report is convicted and the six others are delivered."""
    server.fail_when = lambda body: any(r["step"] in (2, 6) for r in body["reports"])
    client = AuditorClient(server.url, batch_size=8)
    for r in _reports(8):
        client.report(r)
    assert client.flush(timeout=30)
    assert client.stats["sent"] == 6 and client.stats["rejected"] == 2
    (dead,) = spool_dir.glob("*.deadletter")
    assert sorted(json.loads(line)["step"] for line in dead.read_bytes().splitlines()) == [2, 6]
    client.close()


def test_a_service_failing_everything_is_an_outage_nothing_is_dead_lettered(server, spool_dir):
    """A service answering 500 to every request (POSTs and its readiness probe) for 3 s is
    an outage, not 200 poison reports: bisection finds no sub-batch that succeeds, so the
    batches are kept whole and retried with backoff; once it recovers, all 200 reports are
    delivered and nothing is dead-lettered (the new user's repro: 35 of 200 dead-lettered)."""
    server.sick_until = time.monotonic() + 3.0
    client = AuditorClient(server.url, batch_size=50, max_backoff=0.5)
    for r in _reports(200):
        client.report(r)
    assert client.flush(timeout=60)
    assert client.stats["sent"] == 200 and client.stats["rejected"] == 0
    assert sorted(r["step"] for status, (_, _, body) in zip(server.statuses, server.requests)
                  if status == 200 for r in body["reports"]) == list(range(200))
    assert not list(spool_dir.glob("*.deadletter"))
    assert server.statuses.count(500) >= 3  # it did see the outage
    client.close()


def test_batches_of_one_report_poison_or_outage(server, spool_dir):
    """Batches of one report (a trainer of few ranks sends them so): a report the service
    keeps failing on while it answers its readiness probe is poison, dead-lettered, the
    others delivered; the same batches while the service fails everything for 2 s are an
    outage, and nothing is dead-lettered."""
    server.fail_when = lambda body: any(r["step"] == 2 for r in body["reports"])
    client = AuditorClient(server.url, batch_size=1, flush_interval=0.01)
    for r in _reports(4):
        client.report(r)
    assert client.flush(timeout=30)
    assert client.stats["sent"] == 3 and client.stats["rejected"] == 1
    server.fail_when = lambda body: False
    server.sick_until = time.monotonic() + 2.0
    for r in _reports(4, start=10):
        client.report(r)
    assert client.flush(timeout=60)
    assert client.stats["sent"] == 7 and client.stats["rejected"] == 1
    (dead,) = spool_dir.glob("*.deadletter")
    assert [json.loads(line)["step"] for line in dead.read_bytes().splitlines()] == [2]
    client.close()


def test_a_stop_while_a_sick_service_is_being_isolated_ends_delivery_cleanly(server):
    """deliver() stopped (client.close()) just as a chunk answered 500 POISON_AFTER times
    goes to isolation: it returns False and keeps the chunk, instead of raising on the
    isolation's empty outcome (an AttributeError that gave the batch up as an error)."""
    import httpx

    from auditor.trainer import delivery

    server.sick_until = time.monotonic() + 60
    checks = []

    def stopped():
        checks.append(1)
        return len(checks) > delivery.POISON_AFTER  # true from the isolation's first check on

    finals, retries = [], []
    lines = [json.dumps(r).encode() for r in _reports(4)]
    with httpx.Client(timeout=5) as http:
        done = delivery.deliver(http, server.url, lines, on_final=lambda *a: finals.append(a),
                                on_retry=lambda out, n: retries.append(n), stopped=stopped, wait=lambda s: None)
    assert done is False and finals == []
    assert len(server.requests) == delivery.POISON_AFTER and server.statuses == [500] * delivery.POISON_AFTER


GARBAGE_INDEX = [float("inf"), 1.5, True, "1"]


@pytest.mark.parametrize("value", GARBAGE_INDEX)
def test_an_answer_with_garbage_numbers_is_classified_never_raised(value):
    """What a proxy or another program on the service's port may answer: numbers that are
    not the JSON integers the service writes (``1e999``, read as an infinite float, whose
    ``int()`` raised OverflowError out of post_lines) and a body nested past the JSON
    parser's recursion limit (RecursionError). Never raised: a 2xx that is not an ingest
    answer adding up to the batch is a retry (``foreign``, never ``sent``: it counted 24,000
    reports sent and dropped them), a 409 naming no report rejects, a 422 of several reports
    splits; a well-formed answer is sent with its duplicates."""
    import httpx

    from auditor.trainer import delivery

    answers = {
        "dup": (200, json.dumps({"accepted": 3, "duplicates": value})),
        "deep": (200, "[" * 100_000 + "]" * 100_000),
        "short": (200, json.dumps({"accepted": 2, "duplicates": 0})),
        "good": (200, json.dumps({"accepted": 1, "duplicates": 2, "steps_audited": 0})),
        "conflict": (409, json.dumps({"conflicts": [{"index": value, "fields": ["local.sum"]}]})),
        "loc": (422, json.dumps({"errors": [{"loc": ["reports", value, "local"], "msg": "x"}]})),
        "deep422": (422, '{"errors":' + "[" * 20_000 + "]" * 20_000 + "}"),  # under the bound, past recursion
    }
    got = {}
    lines = [json.dumps(r).encode() for r in _reports(3)]
    for name, (status, text) in answers.items():
        transport = httpx.MockTransport(lambda request, s=status, t=text: httpx.Response(
            s, content=t.encode(), headers={"Content-Type": "application/json"}))
        with httpx.Client(transport=transport) as http:
            out = delivery.post_lines(http, "http://svc", lines)
        got[name] = (out.kind, out.duplicates, sorted(out.rejected), out.foreign)
    assert got == {"dup": ("retry", 0, [], True), "deep": ("retry", 0, [], True), "short": ("retry", 0, [], True),
                   "good": ("sent", 2, [], False), "conflict": ("rejected", 0, [], False),
                   "loc": ("split", 0, [], False), "deep422": ("split", 0, [], False)}


def test_a_garbage_answer_is_retried_said_once_and_never_counted_sent(server, caplog):
    """The client's sender, answered 200 with ``"duplicates": Infinity`` twice, does not
    count the batch sent: it retries, says once that the URL does not answer as an auditor
    (naming it), and counts the batch sent when a real ingest answer comes; no "unexpected
    error in the sender"."""
    garbage = (200, {}, {"accepted": 3, "duplicates": float("inf")})
    server.script = [garbage, garbage]
    client = AuditorClient(server.url, max_backoff=0.05)
    for r in _reports(3):
        client.report(r)
    assert client.flush(timeout=10)
    assert client.stats["sent"] == 3 and client.stats["retries"] == 2 and client.stats["rejected"] == 0
    assert caplog.text.count(f"{server.url} does not answer as an auditor service") == 1
    assert "unexpected error" not in caplog.text
    client.close()
