"""The programs on the client side of the wire against a server that is not an auditor
(auditor.testing.garbage: an endless body, three kinds of junk 200, trickled headers and
body, a redirect loop, a cursor loop, connection resets, a gzip bomb), each run in a child
process with its address space capped (RLIMIT_AS 2 GiB): bounded memory, bounded time, no
traceback, nothing counted delivered."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from factory import reference_reports

from auditor.testing.garbage import MODES, GarbageServer, run_capped
from auditor.trainer.spool import read_offsets

HERE = Path(__file__).resolve().parents[1]
#: Peak resident memory a child may reach (an unbounded read of the endless body reached the cap).
MAX_RSS = 300 << 20


@pytest.fixture(scope="module")
def servers():
    made = {mode: GarbageServer(mode) for mode in MODES}
    yield made
    for s in made.values():
        s.close()


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("AUDITOR_")}


def _auditor(*args: str, cwd=None):
    return run_capped([sys.executable, "-m", "auditor", *args], timeout=90, env=_env(), cwd=cwd)


def _timeout(mode: str) -> str:
    """``--timeout`` against ``mode``: 0.5 s for the trickles, which it ends (still over the
    0.2 s between their bytes, so only the whole-answer bound can end them); 1 s for the
    others, which answer at once."""
    return "0.5" if mode.startswith("trickle") else "1"


def test_the_trainer_client_counts_nothing_sent_and_keeps_every_report(servers, tmp_path):
    """One client per kind of garbage in one training process: no report counted sent (a
    junk 200 counted 24,000 reports sent and dropped them), every one in the spool, the
    process's memory flat (the endless body took it to the 4 GiB cap), it ends by itself;
    each client says once, naming the URL, what is wrong."""
    urls = {mode: s.url for mode, s in servers.items()}
    out = run_capped([sys.executable, str(HERE / "scripts" / "garbage_client.py"), str(tmp_path), *urls.values()],
                     timeout=60, env=_env())
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    stats = json.loads(out.stdout)
    got = {mode: (stats[u]["sent"], stats[u]["spooled"], stats[u]["dropped"]) for mode, u in urls.items()}
    assert got == dict.fromkeys(MODES, (0, 50, 0))
    assert out.maxrss < MAX_RSS, out.maxrss
    for mode in ("html", "wrong_types", "nested", "redirect", "endless", "gzip_bomb"):
        assert out.stderr.count(f"{urls[mode]} does not answer as an auditor service") == 1, (mode, out.stderr)
    for i, _ in enumerate(urls):  # the hint names the directory and --url, not one rank's file
        assert f"`auditor import {tmp_path / str(i)} --url " in out.stderr


COMMANDS = [("runs",), ("report", "r"), ("check", "r"), ("runs", "--format", "json")]


@pytest.mark.parametrize("mode", MODES)
def test_the_cli_ends_in_one_line_exit_2(servers, mode):
    """`runs`, `report`, `check` against each garbage: exit 2, one line on stderr naming the
    URL, no traceback, within seconds (trickled answers hung them for over 100 s; a
    repeating cursor looped `runs` for ever), memory flat."""
    url = servers[mode].url
    for cmd in COMMANDS if mode in ("html", "wrong_types", "cursor_loop", "trickle_body") else COMMANDS[:1]:
        out = _auditor(*cmd, "--url", url, "--timeout", _timeout(mode))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (cmd, out.stderr)
        assert url in lines[0] and "Traceback" not in out.stderr and out.stdout == ""
        assert out.maxrss < MAX_RSS, out.maxrss
        assert out.seconds < 30, out.seconds
    said = _auditor("runs", "--url", url, "--timeout", _timeout(mode)).stderr
    expect = {"endless": "an answer longer than 33,554,432 bytes", "gzip_bomb": "an answer longer than 33,554,432",
              "html": "HTTP 200 but not JSON: '<html>", "nested": "HTTP 200 but not JSON",
              "wrong_types": "not a listing of runs", "cursor_loop": "next_cursor 'again' was given before",
              "redirect": "HTTP 302, a redirect to /v1/runs", "reset": "Connection reset by peer",
              "trickle_headers": "within 0.5 s", "trickle_body": "within 0.5 s"}[mode]
    assert expect in said, said


READER = """
import json, sys
from auditor import Reader, ReaderError
out = {}
for mode, url in json.loads(sys.argv[1]).items():
    with Reader(url, timeout=0.5 if mode.startswith("trickle") else 1.0, deadline=3.0) as r:
        got = []
        for call in (lambda: list(r.runs()), lambda: r.report("r"), lambda: r.step("r", "a", 0),
                     lambda: list(r.steps("r", "a"))):
            try:
                call()
                got.append("returned")
            except ReaderError as e:
                got.append("ReaderError: " + str(e))
        out[mode] = got
print(json.dumps(out))
"""


def test_the_reader_raises_reader_error_naming_the_url(servers):
    """Every Reader call against each garbage raises ReaderError naming the URL (it raised
    raw JSONDecodeError, KeyError, RecursionError, and hung on a trickle), in bounded
    memory and time (a trickle within the 0.5 s timeout, as the CLI's :func:`_timeout`)."""
    urls = {mode: s.url for mode, s in servers.items()}
    out = run_capped([sys.executable, "-c", READER, json.dumps(urls)], timeout=90, env=_env())
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    got = json.loads(out.stdout)
    for mode, url in urls.items():
        assert len(got[mode]) == 4 and all(g.startswith(f"ReaderError: {url}/") for g in got[mode]), (mode, got[mode])
    assert "within 0.5 s" in got["trickle_headers"][0] and "within 0.5 s" in got["trickle_body"][0]
    assert "next_cursor 'again' was given before" in got["cursor_loop"][0]
    assert "not a Report document" in got["wrong_types"][1] and "not a Report document" in got["cursor_loop"][1]
    assert out.maxrss < MAX_RSS, out.maxrss


@pytest.mark.parametrize("mode", MODES)
def test_import_delivers_only_to_an_auditor(servers, tmp_path, mode):
    """`auditor import` into each garbage: exit 2 naming the URL, never "imported N new
    report(s)", and no offset sidecar advanced (the next import into the right URL sends
    everything: it wrote the sidecar after a junk 200, silent loss)."""
    d = tmp_path / "spool"
    d.mkdir()
    path = d / "rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for s in range(3) for r in reference_reports("g", buggy=False,
                                                                                               step=s)))
    url = servers[mode].url
    out = _auditor("import", str(d), "--url", url, "--timeout", _timeout(mode))
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and url in lines[0], out.stderr
    assert "imported" not in out.stdout and "Traceback" not in out.stderr
    assert read_offsets(path) == {} and out.maxrss < MAX_RSS and out.seconds < 30
