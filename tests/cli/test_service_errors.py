"""The commands that read from a service over HTTP (`runs`, `report`, `check`, `import`)
meet a wrong token, a wrong URL, a failing service and a host that never answers: one
line naming the URL and the status (or what failed), exit 2, no traceback, and — against a
host that accepts connections and never answers — within a few seconds of --timeout."""

from __future__ import annotations

import functools
import json
import socket
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from factory import reference_reports

from auditor.testing.cli import run_auditor
from auditor.testing.server import ServerProcess

COMMANDS = [("runs",), ("report", "r"), ("check", "r")]


auditor = functools.partial(run_auditor, clean=True)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), \
        out.stderr
    return out.stderr


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    """A service that requires a token (write 'w', read 'r') on its own SQLite file."""
    d = tmp_path_factory.mktemp("token")
    server = ServerProcess(f"sqlite:///{d}/a.db", d / "server.log", AUDITOR_TOKEN="w",
                           AUDITOR_READ_TOKEN="r").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def failing_server():
    """A stdlib HTTP server answering 500 (problem details) to every request, /healthz too."""
    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server API
            body = b'{"type":"about:blank","title":"err","status":500,"detail":"database on fire"}'
            self.send_response(500)
            self.send_header("content-type", "application/problem+json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def silent_host():
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(("cmd", "token"), [(c, None) for c in COMMANDS] + [(("runs",), "wrong")],
                         ids=["runs", "report", "check", "runs-wrong-token"])
def test_missing_or_wrong_token(token_server, cmd, token):
    """401: the URL, the status and 'check --token' (the repro: `auditor runs` printed a
    traceback and 'unexpected ReaderError')."""
    err = one_line_error(auditor(*cmd, "--url", token_server.url, *(["--token", token] if token else [])))
    assert f"{token_server.url}/v1/runs" in err and "answered HTTP 401" in err and "check --token" in err, err


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_wrong_path_is_named_and_the_v1_prefix_is_understood(token_server, cmd):
    """A URL with a path that is no service base is named (its /healthz is a 404); the API
    prefix /v1 given with the base URL is the base URL (the repro: 404 traceback)."""
    err = one_line_error(auditor(*cmd, "--url", token_server.url + "/api", "--token", "r"))
    assert f"{token_server.url}/api/" in err and "404" in err and "base URL" in err, err
    out = auditor(*cmd, "--url", token_server.url + "/v1/", "--token", "r")
    if cmd[0] == "runs":
        assert out.returncode == 0 and "run" in out.stdout, out.stderr
    else:
        assert one_line_error(out).strip() == f"error: run 'r' not found at {token_server.url}"


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: c[0])
def test_a_failing_service(failing_server, cmd):
    """500 to everything: the URL, the status and the problem's detail, in one line."""
    err = one_line_error(auditor(*cmd, "--url", failing_server))
    assert f"{failing_server}/v1/runs" in err and "answered HTTP 500: database on fire — the service failed" in err


@pytest.mark.parametrize("cmd", [*COMMANDS, ("import", "SPOOL")], ids=lambda c: c[0])
def test_a_host_that_never_answers_fails_within_the_timeout(silent_host, cmd, tmp_path):
    """A host that accepts TCP and never answers: `report` took 69 s and `import` 258 s.
    With --timeout 0.5 the reads fail after half a second, the import after 1.5 s (three
    timeouts) with no answer ('unreachable'), exit 2, one line."""
    if cmd[0] == "import":
        spool = tmp_path / "rank0.jsonl"
        spool.write_text("".join(json.dumps(r) + "\n" for r in reference_reports("r", buggy=False)))
        cmd = ("import", str(spool))
    t = time.monotonic()
    err = one_line_error(auditor(*cmd, "--url", silent_host, "--timeout", "0.5"))
    elapsed = time.monotonic() - t
    if cmd[0] == "import":
        assert f"{silent_host} is unreachable" in err and "no HTTP answer within 1.5 s" in err, err
    else:
        assert f"no answer from {silent_host}/healthz within 0.5 s (ReadTimeout" in err, err
    assert elapsed < 15, elapsed  # (the interpreter's start-up included)


def test_a_run_id_no_run_can_have_is_exit_2_never_another_run_s_status(live_server, run_id):
    """A new-user probe: `auditor check 'RUN/report?' --url` requested /v1/runs/RUN/report?/report
    and printed RUN's status as its own (exit 0 for a run that does not exist: a CI gate passed
    by another run), `check 'RUN?x=1'` and `check 'RUN#frag'` ended in a traceback
    (AttributeError on the run summary /v1/runs/RUN answered). Every RUN_ID outside the wire
    pattern is now one line naming it, exit 2, before any request, over HTTP and on the
    database alike; the run itself still passes."""

    assert live_server.post("/v1/reports", json={"reports": reference_reports(run_id, buggy=False)}).status_code == 200
    out = auditor("check", run_id, "--url", live_server.url)
    assert out.returncode == 0 and "consistent" in out.stdout, out.stdout + out.stderr
    cases = [("check", bad, "--url", live_server.url)
             for bad in (f"{run_id}/report?", f"{run_id}?x=1", f"{run_id}#frag", "..", "a b")]
    cases += [("report", f"{run_id}/report?", "--url", live_server.url),
              ("check", f"{run_id}/report?", "--database-url", live_server.database_url)]
    for cmd, bad, *source in cases:
        err = one_line_error(auditor(cmd, bad, *source))
        assert f"{bad!r} is not a run id" in err, (cmd, bad, source, err)
