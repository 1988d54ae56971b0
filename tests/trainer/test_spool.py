"""Spool files: torn lines, resumable idempotent `auditor import`, file-only mode by environment."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from auditor.trainer.client import client_from_env
from auditor.offline import upload
from auditor.trainer.spool import Spool, read_lines, read_offset
from factory import reference_reports


def test_torn_last_line_is_never_read(tmp_path):
    """A line without its newline (a crash mid-write) is not returned, and the offset stops
    before it; blank lines are consumed."""
    path = tmp_path / "s.jsonl"
    path.write_bytes(b'{"a":1}\n\n{"a":2}\n{"a":3')
    lines, end = read_lines(path)
    assert lines == [b'{"a":1}', b'{"a":2}'] and end == len(b'{"a":1}\n\n{"a":2}\n')


def test_spool_commit_truncates_when_drained(tmp_path):
    """Committing everything empties the file (it never holds more than what is undelivered);
    close() then removes a delivered spool and its sidecar."""
    spool = Spool(tmp_path / "s.jsonl")
    spool.append([b'{"a":1}', b'{"a":2}'])
    lines, end = spool.read(10)
    assert lines == [b'{"a":1}', b'{"a":2}'] and spool.pending()
    spool.commit(end)
    assert not spool.pending() and (tmp_path / "s.jsonl").stat().st_size == 0
    assert spool.close() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_import_is_resumable_and_idempotent(live_server, tmp_path, run_id):
    """`auditor import` uploads a spool and records the offset; a second import sends nothing;
    with the sidecar rewound to the middle it resends only the rest, and the service stores
    each report once (the re-sent ones are duplicates); --restart re-sends everything and says
    that none of it was new."""
    reports = [r for s in range(5) for r in reference_reports(run_id, buggy=False, step=s)]
    path = tmp_path / "rank0.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reports))
    cmd = [sys.executable, "-m", "auditor", "import", str(tmp_path), "--url", live_server.url, "--batch-size", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "imported 10 new report(s) from 1 file(s); 0 rejected" in out.stdout
    assert read_offset(path) == path.stat().st_size
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert "imported 0 new report(s)" in out.stdout
    out = subprocess.run([*cmd, "--restart"], capture_output=True, text=True, timeout=120)
    assert "imported 0 new report(s) from 1 file(s) (10 already stored, not counted); 0 rejected" in out.stdout
    half = len("".join(json.dumps(r) + "\n" for r in reports[:4]))
    (tmp_path / "rank0.jsonl.offset").write_text(str(half))
    counts = upload([path], live_server.url, batch_size=4)
    assert counts == {"files": 1, "sent": 6, "duplicates": 6, "rejected": 0, "retries": 0}
    (stat,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert stat["steps_audited"] == stat["steps_consistent"] == 5


def test_file_only_mode_from_the_environment(tmp_path, monkeypatch):
    """AUDITOR_URL=file:///dir: the client opens no connection and writes each report to
    a JSONL spool in dir; flush means 'written'; the file is kept at close."""
    monkeypatch.setenv("AUDITOR_URL", f"file://{tmp_path}")
    client = client_from_env(rank=3)
    assert client.file_only and client._http is None
    for r in reference_reports("file-run", buggy=True):
        client.report(r)
    assert client.flush(timeout=10)
    client.close()
    (path,) = tmp_path.glob("rank3-*.jsonl")
    assert [json.loads(x)["rank"] for x in path.read_text().splitlines()] == [0, 1]
    assert client.stats["spooled"] == 2 and client.stats["dropped"] == 0
