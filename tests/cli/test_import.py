"""`auditor import` against a second service, a sick one and one that refuses a poison
report: real services and real HTTP servers, the command as a user runs it."""

from __future__ import annotations

import functools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from auditor.testing.cli import run_auditor
from auditor.testing.server import ServerProcess
from auditor.trainer.spool import destination, read_offset, read_offsets
from factory import reference_reports


auditor = functools.partial(run_auditor, clean=True)


def _spool(tmp_path, run_id: str, steps: int = 5):
    reports = [r for s in range(steps) for r in reference_reports(run_id, buggy=False, step=s)]
    d = tmp_path / "spool"
    d.mkdir()
    path = d / "rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reports))
    return d, path, reports


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_second_service_gets_the_whole_spool(live_server, tmp_path, run_id):
    """Offsets are per destination: importing into A then into B sends everything to B too
    (the repro: "imported 0 new report(s)", exit 0, nothing on B). A sidecar of the older
    format (one number) names no destination: everything is sent again (A counts the
    duplicates), nothing is skipped. A second import into B says it was delivered."""
    d, path, reports = _spool(tmp_path, run_id)
    other = ServerProcess(f"sqlite:///{tmp_path}/b.db", tmp_path / "b.log").start()
    try:
        out = auditor("import", str(d), "--url", live_server.url)
        assert out.returncode == 0 and "imported 10 new report(s) from 1 file(s); 0 rejected" in out.stdout, out
        out = auditor("import", str(d), "--url", other.url + "/")
        assert out.returncode == 0 and "imported 10 new report(s) from 1 file(s); 0 rejected" in out.stdout, out
        (stat,) = other.get(f"/v1/runs/{run_id}/report").json()["statistics"]
        assert stat["steps_audited"] == stat["steps_consistent"] == 5
        size = path.stat().st_size
        assert read_offsets(path) == {destination(live_server.url): size, destination(other.url): size}
        assert read_offset(path, other.url.upper().replace("HTTP://", "http://")) == size  # normalised host
        out = auditor("import", str(d), "--url", other.url)
        assert "imported 0 new report(s)" in out.stdout and \
            f"1 file(s) were already delivered to {other.url} (their .offset sidecars say so" in out.stdout, out
        (d / "rank0.jsonl.offset").write_text(f"{size}\n")  # the older format
        out = auditor("import", str(d), "--url", live_server.url)
        assert out.returncode == 0 and "imported 0 new report(s) from 1 file(s) (10 already stored" in out.stdout
    finally:
        other.stop()


class FlakyIngest:
    """A stdlib HTTP server standing in for the service: stores POSTed reports, answers
    500 to every request (GET /readyz too) until ``sick_until``, and 500 to any POST
    holding a report for which ``poison(report)`` is true."""

    def __init__(self):
        self.stored: list[dict] = []
        self.sick_until = 0.0
        self.poison = lambda report: False
        outer = self

        class H(BaseHTTPRequestHandler):
            def _answer(self, status, body):
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):  # noqa: N802
                self._answer(500 if time.monotonic() < outer.sick_until else 200, {"status": "?"})

            def do_POST(self):  # noqa: N802
                reports = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["reports"]
                if time.monotonic() < outer.sick_until or any(map(outer.poison, reports)):
                    return self._answer(500, {"type": "about:blank", "status": 500, "detail": "boom"})
                outer.stored += reports
                self._answer(200, {"accepted": len(reports), "duplicates": 0, "steps_audited": 0})

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def flaky():
    server = FlakyIngest()
    yield server
    server.close()


def test_import_waits_out_a_sick_service_and_dead_letters_nothing(flaky, tmp_path):
    """500 to everything for 3 s, then healthy: the import keeps its batches whole, backs
    off, delivers all 200 reports and dead-letters none (exit 0)."""
    d = tmp_path / "spool"
    d.mkdir()
    lines = [json.dumps(r) for i in range(100) for r in reference_reports("r", buggy=False, step=i)]
    (d / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    flaky.sick_until = time.monotonic() + 3.0
    out = auditor("import", str(d), "--url", flaky.url, "--batch-size", "50")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "imported 200 new report(s) from 1 file(s); 0 rejected" in out.stdout
    assert sorted(r["step"] for r in flaky.stored) == sorted(list(range(100)) * 2)
    assert not list(d.glob("*.deadletter"))


def test_a_poison_report_is_dead_lettered_named_and_retried_on_request(flaky, tmp_path):
    """One report the service fails on (500) while it takes the others: only it goes to
    `<spool>.deadletter`, and the exit message names that file. A later import names the
    dead-letter file it does not retry (path and count); with --include-deadletter it is
    retried, and once delivered it leaves the file (removed)."""
    d = tmp_path / "spool"
    d.mkdir()
    lines = [json.dumps(r) for i in range(20) for r in reference_reports("r", buggy=False, step=i)]
    (d / "rank0.jsonl").write_text("\n".join(lines) + "\n")
    flaky.poison = lambda report: (report["step"], report["rank"]) == (8, 1)
    out = auditor("import", str(d), "--url", flaky.url, "--batch-size", "16")
    dead = d / "rank0.jsonl.deadletter"
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"imported 39 new report(s) from 1 file(s); 1 rejected (appended to {dead} (+1))" in out.stdout
    assert [json.loads(ln)["step"] for ln in dead.read_text().splitlines()] == [8]
    out = auditor("import", str(d), "--url", flaky.url)
    assert out.returncode == 0
    assert f"not retried: 1 dead-lettered report(s) in {dead} (1) — retry them with --include-deadletter" \
        in out.stdout, out.stdout
    out = auditor("import", str(d), "--url", flaky.url, "--include-deadletter")  # still poison: kept
    assert out.returncode == 1 and f"1 still refused, kept in {dead}" in out.stdout, out.stdout
    assert [json.loads(ln)["step"] for ln in dead.read_text().splitlines()] == [8]
    flaky.poison = lambda report: False  # the service was fixed
    out = auditor("import", str(d), "--url", flaky.url, "--include-deadletter")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "retried 1 dead-lettered report(s) from 1 file(s): all delivered" in out.stdout
    assert not dead.exists() and sorted(r["step"] for r in flaky.stored) == sorted(list(range(20)) * 2)


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_lines_it_cannot_send_are_named_and_a_torn_line_waits(live_server, tmp_path, run_id):
    """A line longer than the 16 MiB body the service takes is never read whole nor sent:
    named by file and line, counted rejected (exit 1), left in the spool; a torn last line is
    named and not sent, and the sidecar stops before it, so the next import sends it once
    the trainer has finished writing it."""
    from auditor.trainer.spool import MAX_LINE_BYTES

    d, path, reports = _spool(tmp_path, run_id, steps=2)
    last = json.dumps(dict(reference_reports(run_id, buggy=False, step=2)[0])) + "\n"
    with open(path, "a") as f:
        f.write('{"run_id":"x","pad":"' + "x" * MAX_LINE_BYTES + '"}\n')
        f.write(last[:30])
    out = auditor("import", str(d), "--url", live_server.url)
    assert out.returncode == 1 and "imported 4 new report(s) from 1 file(s); 1 rejected" in out.stdout, out
    assert f"{path}:5: invalid report not sent, left in the spool: a line of {MAX_LINE_BYTES + 24:,} bytes" in out.stderr
    assert f"{path}:6: last line not read: it has no newline (30 bytes)" in out.stderr
    assert read_offset(path, live_server.url) == path.stat().st_size - 30
    with open(path, "a") as f:
        f.write(last[30:])
    out = auditor("import", str(d), "--url", live_server.url)
    assert out.returncode == 0 and "imported 1 new report(s) from 1 file(s); 0 rejected" in out.stdout, out
