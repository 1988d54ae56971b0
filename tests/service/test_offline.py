"""`auditor audit` and `auditor import` of per-rank spools: streamed in batches of whole
steps with bounded memory, the same verdicts and numbers as ingest over HTTP, a progress bar
only on a terminal."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from factory import applied, local_moments, reference_reports, total

from auditor.offline import audit_offline, read_ahead
from auditor.trainer.spool import read_offset
from auditor.service import Service
from auditor.trainer.spool import SpoolReader


def _auditor(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True, timeout=180, **kw)


def _r6(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _write_rank_files(directory, reports: list[dict]) -> list:
    """One spool file per rank (``rank<r>.jsonl``), each in the order of ``reports``."""
    directory.mkdir(parents=True, exist_ok=True)
    by_rank: dict[int, list[str]] = {}
    for r in reports:
        by_rank.setdefault(r["rank"], []).append(json.dumps(r, separators=(",", ":")))
    paths = []
    for rank, lines in sorted(by_rank.items()):
        p = directory / f"rank{rank}.jsonl"
        p.write_text("\n".join(lines) + "\n")
        paths.append(p)
    return paths


def _wide_reference_step(run_id: str, step: int, dp: int, buggy: bool) -> list[dict]:
    """The reference case (DESIGN.md §4) on ``dp`` data replicas × cp 2: every replica holds
    the reference sequences, so the correct statistic is the reference's global one (mean
    +0.100000); ``buggy`` reduces each rank over itself (the DP group without CP)."""
    loc = [local_moments(0), local_moments(1)]
    glob = total(*loc * dp)
    out = []
    for rank in range(2 * dp):
        cp = rank % 2
        out.append({
            "run_id": run_id, "statistic": "advantages", "step": step, "rank": rank, "world_size": 2 * dp,
            "coords": {"dp": rank // 2, "cp": cp, "tp": 0, "pp": 0}, "sizes": {"dp": dp, "cp": 2, "tp": 1, "pp": 1},
            "local": loc[cp], "applied": applied(loc[cp] if buggy else glob), "dtype": "float32",
        })
    return out


def test_audit_streams_a_large_spool_holding_one_batch(tmp_path, run_id, monkeypatch):
    """50,048 reports in 64 per-rank files (782 steps of 64 ranks; step 7 reduced over the
    DP group without CP), audited with batches of 1,000: the reader never holds more than one
    batch (plus the one line per file the merge looks at) — counted by instrumenting the file
    readers and the service's ingest, not timed — every step is audited, and only step 7 is
    inconsistent, with the reference case's correct mean +0.100000."""
    steps, dp, size = 782, 32, 1000
    reports = [r for s in range(steps) for r in _wide_reference_step(run_id, s, dp, buggy=s == 7)]
    paths = _write_rank_files(tmp_path / "spool", reports)
    assert len(reports) == 50_048 and len(paths) == 64

    held = {"read": 0, "ingested": 0, "most": 0, "batches": 0, "largest": 0}
    read_file = SpoolReader._file

    def counting_file(self, i):
        for item in read_file(self, i):
            held["read"] += 1
            held["most"] = max(held["most"], held["read"] - held["ingested"])
            yield item

    ingest = Service.ingest

    def counting_ingest(self, batch, now=None, **kw):
        out = ingest(self, batch, now, **kw)
        held["ingested"] += len(batch)
        held["batches"] += 1
        held["largest"] = max(held["largest"], len(batch))
        return out

    monkeypatch.setattr(SpoolReader, "_file", counting_file)
    monkeypatch.setattr(Service, "ingest", counting_ingest)
    (report,), counts = audit_offline([tmp_path / "spool"], batch_size=size, reader_process=False)

    assert counts == {"files": 64, "reports": 50_048, "stored": 50_048, "duplicates": 0, "invalid": 0,
                      "conflicting": 0}
    assert held["ingested"] == 50_048 and held["largest"] <= size
    assert held["batches"] == -(-steps // (size // 64))  # whole steps: 15 steps of 64 ranks per batch
    assert held["most"] <= size + len(paths)
    (s,) = report["statistics"]
    assert (s["steps_audited"], s["steps_consistent"], s["steps_inconsistent"], s["steps_incomplete"]) == \
        (782, 781, 1, 0)
    (bad,) = s["bad_steps"]
    assert bad["step"] == 7 and {f["kind"] for f in bad["faults"]} == {"cp_disagreement", "group_mismatch",
                                                                       "wrong_group"}
    assert {round(r["correct_mean"], 6) for r in bad["ranks"]} == {0.1}
    assert sorted({round(r["applied_mean"], 6) for r in bad["ranks"]}) == [-0.076923, 0.235294]


@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_audit_of_rank_files_equals_import_into_the_live_service(live_server, tmp_path, run_id):
    """The reference run in one spool file per CP rank — steps 0–2 reduced over the DP group
    without CP (slime's bug), 3–4 fixed, step 5 reported by rank 0 only, and a line in rank 1's
    file that is not JSON: `auditor audit` (no service) and `auditor import` into a live
    service give the same verdicts, faults, ranks and numbers (cp_disagreement 0.433155 σ,
    applied error 0.267869 σ, CP-rank means −0.076923 / +0.235294, correct mean +0.100000);
    the import advances each file's offset sidecar to its end, dead-letters the bad line next
    to rank 1's file and exits 1; the audit names the line and exits 0."""
    reports = [r for s in range(5) for r in reference_reports(run_id, buggy=s < 3, step=s)]
    reports.append(reference_reports(run_id, buggy=False, step=5)[0])
    rank0, rank1 = _write_rank_files(tmp_path / "spool", reports)
    lines = rank1.read_text().splitlines()
    rank1.write_text("\n".join([*lines[:2], "{not json", *lines[2:]]) + "\n")

    out = _auditor("audit", str(tmp_path / "spool"), "--format", "json", "--batch-size", "3")
    assert out.returncode == 0, out.stderr
    assert f"{rank1}:3: invalid report skipped: not JSON" in out.stderr
    (offline,) = json.loads(out.stdout)
    out = _auditor("import", str(tmp_path / "spool"), "--url", live_server.url, "--batch-size", "3")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "imported 11 new report(s) from 2 file(s); 1 rejected" in out.stdout
    assert (tmp_path / "spool" / "rank1.jsonl.deadletter").read_text() == "{not json\n"
    assert not (tmp_path / "spool" / "rank0.jsonl.deadletter").exists()
    assert [read_offset(p, live_server.url) for p in (rank0, rank1)] == \
        [rank0.stat().st_size, rank1.stat().st_size]

    deadline = time.monotonic() + 30
    while (live := live_server.get(f"/v1/runs/{run_id}/report").json())["statistics"][0]["steps_pending"]:
        assert time.monotonic() < deadline, "the grace period sweep did not audit step 5"
        time.sleep(0.2)

    def verdicts(report):
        (s,) = report["statistics"]
        steps = {b["step"]: (b["verdict"], sorted((f["kind"], tuple(f["ranks"])) for f in b["faults"]),
                             [(r["rank"], _r6(r["applied_mean"]), _r6(r["correct_mean"])) for r in b["ranks"]],
                             _r6(b["cp_disagreement_sigma"]), _r6(b["applied_error_sigma"]))
                 for b in s["bad_steps"]}
        counts = {k: s[k] for k in ("steps_audited", "steps_consistent", "steps_inconsistent", "steps_incomplete")}
        return counts, s["faults"], steps, round(s["worst_cp_disagreement_sigma"], 6), report["consistent"]

    assert verdicts(offline) == verdicts(live)
    counts, faults, steps, worst, consistent = verdicts(offline)
    assert counts == {"steps_audited": 6, "steps_consistent": 2, "steps_inconsistent": 3, "steps_incomplete": 1}
    assert faults == {"cp_disagreement": 3, "group_mismatch": 3, "wrong_group": 3, "missing_report": 1}
    assert worst == 0.433155 and not consistent
    verdict, kinds, ranks, cp_sigma, applied_sigma = steps[0]
    assert verdict == "inconsistent" and (cp_sigma, applied_sigma) == (0.433155, 0.267869)
    assert ranks == [(0, -0.076923, 0.1), (1, 0.235294, 0.1)]
    assert steps[5][0] == "incomplete" and ("missing_report", (1,)) in steps[5][1]


def test_progress_bar_only_on_a_terminal(tmp_path):
    """The progress bar goes to stderr when it is a terminal (a pty here), and is off when
    stderr is a pipe (CI logs) or with --quiet; stdout stays the report alone."""
    _write_rank_files(tmp_path / "spool", [r for s in range(3) for r in reference_reports("prog", buggy=False, step=s)])

    def run(*extra: str, tty: bool) -> tuple[str, str]:
        argv = [sys.executable, "-m", "auditor", "audit", str(tmp_path / "spool"), "--format", "json", *extra]
        if not tty:
            out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            return out.stdout, out.stderr
        leader, follower = pty.openpty()
        try:
            p = subprocess.run(argv, stdout=subprocess.PIPE, stderr=follower, timeout=120,
                               env={**os.environ, "COLUMNS": "200", "TERM": "xterm"})
            os.close(follower)
            err = b""
            while True:
                try:
                    chunk = os.read(leader, 65536)
                except OSError:  # EIO: the follower side is closed and drained
                    break
                if not chunk:
                    break
                err += chunk
        finally:
            os.close(leader)
        assert p.returncode == 0, err
        return p.stdout.decode(), err.decode(errors="replace")

    out, err = run(tty=True)
    assert "audit" in err and "6 reports" in err and "━" in err
    assert json.loads(out)[0]["run_id"] == "prog"
    for extra, tty in (((), False), (("--quiet",), True)):
        out, err = run(*extra, tty=tty)
        assert "━" not in err and "reports (" not in err
        assert err.strip().startswith("read 6 report(s) from 2 file(s)")
        assert json.loads(out)[0]["run_id"] == "prog"


def test_a_reader_process_gives_the_same_audit(tmp_path, caplog):
    """Spools read and merged by a second process (what large spools get): the same counts,
    verdicts and numbers as reading in process, and an invalid line is still named by file
    and line."""
    reports = [r for s in range(4) for r in reference_reports("piped", buggy=s == 2, step=s)]
    _, rank1 = _write_rank_files(tmp_path / "spool", reports)
    rank1.write_text(rank1.read_text() + "{not json\n")
    results = []
    for reader_process in (False, True):
        caplog.clear()
        (report,), counts = audit_offline([tmp_path / "spool"], batch_size=3, reader_process=reader_process)
        (s,) = report["statistics"]
        (bad,) = s["bad_steps"]
        results.append((counts, s["steps_consistent"], s["faults"], bad["step"], _r6(bad["cp_disagreement_sigma"]),
                        [_r6(r["applied_mean"]) for r in bad["ranks"]]))
        assert f"{rank1}:5: invalid report skipped: not JSON" in caplog.text
    assert results[0] == results[1]
    assert results[1] == ({"files": 2, "reports": 9, "stored": 8, "duplicates": 0, "invalid": 1, "conflicting": 0},
                          3, {"cp_disagreement": 1, "group_mismatch": 1, "wrong_group": 1}, 2, 0.433155,
                          [-0.076923, 0.235294])



def _write_steps(directory, run_id: str, steps: int) -> list:
    """Per-rank spool files of ``steps`` correct reference steps (2 ranks, ~350 bytes a line)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rep in reference_reports(run_id, buggy=False, step=0):
        head, tail = json.dumps(rep, separators=(",", ":")).split('"step":0,')
        p = directory / f"rank{rep['rank']}.jsonl"
        p.write_text("".join(f'{head}"step":{s},{tail}\n' for s in range(steps)))
        paths.append(p)
    return paths


def _reader_children(pid: int) -> list[int]:
    """Live children of ``pid`` that are spool reader processes (auditor.offline_reader)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                if b"reader_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.append(int(child))
    return found


def test_a_reader_process_killed_mid_spool_is_an_error(tmp_path):
    """The reader process killed after the first batch (each batch ~350 KB: more than the
    connection holds, so it is blocked mid-spool, far from the end): the audit raises
    SpoolReaderError naming the signal after having handed over the batches before it,
    and the process is reaped. A reader that fails (a spool gone) says why."""
    from auditor.offline_reader import SpoolReaderError, piped_batches

    _write_steps(tmp_path / "spool", "killed", 4_000)  # 8,000 reports, 8 batches of 1,000
    seen, killed = [], []

    def on_progress(done: int, total: int, reports: int) -> None:
        seen.append(reports)
        if reports == 1_000:
            (reader,) = _reader_children(os.getpid())
            os.kill(reader, signal.SIGKILL)
            killed.append(reader)

    with pytest.raises(SpoolReaderError, match="was killed by SIGKILL before the end of the spools"):
        audit_offline([tmp_path / "spool"], batch_size=1_000, reader_process=True, on_progress=on_progress)
    assert seen[:2] == [0, 1_000] and max(seen) < 8_000
    assert not Path(f"/proc/{killed[0]}").exists()  # reaped, not a zombie
    with pytest.raises(SpoolReaderError, match=r"failed: FileNotFoundError: .*No such file or directory: .*gone"):
        with piped_batches([tmp_path / "gone.jsonl"], 10) as batches:
            next(batches)
    assert _reader_children(os.getpid()) == []


def test_audit_command_exits_2_when_its_reader_process_dies(tmp_path):
    """``auditor audit`` of a spool large enough for a reader process (>= 32 MiB), whose
    reader is killed while the audit runs: the command exits 2 with one line saying the
    reader was killed — no traceback, no hang (bounded by the subprocess timeout), no report."""
    from auditor.offline import READER_PROCESS_BYTES

    paths = _write_steps(tmp_path / "spool", "big", 50_000)
    assert sum(p.stat().st_size for p in paths) >= READER_PROCESS_BYTES
    proc = subprocess.Popen([sys.executable, "-m", "auditor", "audit", str(tmp_path / "spool"), "--format", "json",
                             "--batch-size", "1000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        killed = []
        while not killed and proc.poll() is None:
            for child in _reader_children(proc.pid):
                os.kill(child, signal.SIGKILL)
                killed.append(child)
            time.sleep(0.01)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert killed, err
    assert proc.returncode == 2, err
    assert out == ""
    assert err.strip().splitlines()[-1] == (
        "error: the spool reader process was killed by SIGKILL before the end of the spools; "
        "the reports after the last batch were not read")
    assert "Traceback" not in err


def test_read_ahead_hands_over_errors_and_stops_with_its_consumer():
    """The import's reader thread: batches arrive in order, an error of the reader (a spool
    that cannot be read) is raised in the consumer after the batches before it, and a
    consumer that stops early (the service went away) stops the thread instead of leaving
    it blocked on a full queue."""
    def failing():
        yield [1]
        yield [2]
        raise OSError("spool unreadable")

    it = read_ahead(failing())
    assert [next(it), next(it)] == [[1], [2]]
    with pytest.raises(OSError, match="spool unreadable"):
        next(it)
    it = read_ahead(iter([[i] for i in range(100)]))
    assert next(it) == [0]
    assert [t.name for t in threading.enumerate()].count("spool-reader") == 1
    it.close()
    assert "spool-reader" not in [t.name for t in threading.enumerate()]


def test_lines_it_cannot_store_are_named_by_file_and_line(tmp_path, caplog):
    """``auditor audit`` names every line it skips, in both ways of reading: a report that
    contradicts one stored first (another applied sum; another topology) with what differs
    (the stored one stays), a line longer than the 16 MiB the service would take (skipped
    without being held in memory), and a torn last line (no newline). The rest is audited:
    the reference step 0 consistent, step 1 the CP bug (0.433155 σ)."""
    from auditor.trainer.spool import MAX_LINE_BYTES

    reports = [r for s in range(2) for r in reference_reports("skips", buggy=s == 1, step=s)]
    rank0, rank1 = _write_rank_files(tmp_path / "spool", reports)
    changed = dict(reports[1], applied=dict(reports[1]["applied"], sum=99.0))
    resized = dict(reports[3], world_size=4, sizes=dict(reports[3]["sizes"], dp=2))
    with open(rank1, "a") as f:
        f.write(json.dumps(changed) + "\n" + json.dumps(resized) + "\n")
        f.write('{"run_id":"skips","pad":"' + "x" * MAX_LINE_BYTES + '"}\n')
        f.write(json.dumps(reports[1])[:40])  # torn by a crash
    results = []
    for reader_process in (False, True):
        caplog.clear()
        (report,), counts = audit_offline([tmp_path / "spool"], reader_process=reader_process)
        (s,) = report["statistics"]
        results.append((counts, s["steps_consistent"], s["steps_inconsistent"], _r6(s["cp_disagreement_sigma"])))
        text = caplog.text
        line = {int(m[0]): m[1] for m in re.findall(rf"{re.escape(str(rank1))}:(\d+): (.*)", text)}
        assert line[3].startswith("conflicting report skipped: ") and "applied.sum; the stored report stays" in line[3]
        assert line[4].startswith("conflicting report skipped: ") and "{'world_size': 4, 'sizes'" in line[4]
        assert line[5].startswith(f"invalid report skipped: a line of {MAX_LINE_BYTES + 28:,} bytes, longer than 16 MiB")
        assert line[6] == "last line not read: it has no newline (40 bytes): torn by a crash, or still being written"
    assert results[0] == results[1] == (
        {"files": 2, "reports": 8, "stored": 4, "duplicates": 0, "invalid": 2, "conflicting": 2}, 1, 1, 0.433155)


def test_audit_names_the_field_each_invalid_line_breaks(tmp_path):
    """`auditor audit` logs "FILE:LINE: invalid report skipped: <field>: <message>" naming
    the wire field a rule blames (as the service's 422 does), not the block or the report;
    a line of float32 values whose squares underflow (sum_sq 0) is a report, not skipped."""
    good = reference_reports("fields", buggy=False)[0]
    bad = [
        ({"local": {**good["local"], "count": -1.0}}, "local.count: Value error, count must be >= 0, got -1.0"),
        ({"coords": {"cp": 2}}, "coords.cp: Value error, coords.cp (2) must be < sizes.cp (2)"),
        ({"rank": 5}, "rank: Value error, rank (5) must be < world_size (2)"),
        ({"world_size": 4}, "world_size: Value error, world_size (4) must equal the product of sizes dp*cp*tp*pp = 2"),
        ({"local": {"count": 2.0, "sum": 2.0, "sum_sq": 1.0}},
         "local.sum_sq: Value error, local.sum_sq (1.0) is below local.sum²/local.count (2.0) beyond float32 "
         "rounding: the values would have negative variance"),
        ({"local": {"count": 2.0, "sum": -1.3e-31, "sum_sq": 0.0}, "applied": {"mean": -6.5e-32}}, None),
    ]
    spool = tmp_path / "spool"
    spool.mkdir()
    path = spool / "rank0.jsonl"
    path.write_text("".join(json.dumps({**good, "step": i, **change}) + "\n" for i, (change, _) in enumerate(bad)))
    out = _auditor("audit", str(spool), "--format", "json")
    assert out.returncode == 0, out.stderr
    skipped = [ln[ln.index(f"{path}:"):] for ln in out.stderr.splitlines() if "invalid report skipped" in ln]
    assert skipped == [f"{path}:{i + 1}: invalid report skipped: {why}" for i, (_, why) in enumerate(bad) if why]


def test_a_line_whose_step_int_cannot_read_is_skipped_not_a_crash(tmp_path):
    """A garbage spool line whose step has 5,000 digits (more than int() reads) ended
    `auditor audit` with a traceback and exit 2 (the merge key's int() raised ValueError in
    the spool reader) and nothing was audited. It is now one invalid line named by file and
    line, in both ways of reading, and the reference step beside it is audited consistent."""
    a, b = reference_reports("huge-step", buggy=False)
    spool = tmp_path / "spool"
    spool.mkdir()
    path = spool / "rank0.jsonl"
    junk = ['{"run_id":"huge-step","statistic":"advantages","step":' + "9" * 5000 + ',"rank":0}',
            '{"run_id": "huge-step", "statistic": "advantages", "step": ' + "9" * 5000 + "}"]
    path.write_text("\n".join([json.dumps(a), *junk, json.dumps(b)]) + "\n")
    for reader_process in (False, True):
        (report,), counts = audit_offline([spool], reader_process=reader_process)
        assert (report["status"], counts["invalid"], counts["stored"]) == ("consistent", 2, 2)
    out = _auditor("audit", str(spool), "--check", "--quiet")
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert [ln[ln.index(f"{path}:"):].split(": ")[0] for ln in out.stderr.splitlines() if "invalid report" in ln] == \
        [f"{path}:2", f"{path}:3"]
