"""/metrics stays true across uvicorn workers, and idle runs age out: real `auditor serve`
processes on SQLite and on PostgreSQL, scraped over HTTP.

The audit series are read from the database at scrape time (every worker and replica exports
the same values). The ingest series (reports received/rejected, ingest latency) are counted
in the process that served the request; with ``--workers N`` they use prometheus-client's
multiprocess mode, so whichever worker answers the scrape exports the sum over all workers.
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from factory import reference_reports
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from auditor.testing.server import ServerProcess

RECEIVED = "auditor_reports_received_total"
REJECTED = "auditor_reports_rejected_total"
LATENCY_COUNT = "auditor_ingest_duration_seconds_count"
STALE_PID = 4_194_301  # above Linux's pid_max default range: never a live process


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """One scrape on a new connection (so it may land on any worker): {(sample, labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=30, headers={"connection": "close"}).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def workers_of(server: ServerProcess, n: int, exclude: set[int] = frozenset(), timeout: float = 30) -> list[int]:
    """The pids of the server's ``n`` uvicorn worker processes (multiprocessing spawn children)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = []
        for c in children(server.proc.pid):
            try:
                if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes() and c not in exclude:
                    pids.append(c)
            except FileNotFoundError:
                pass
        if len(pids) == n:
            try:
                server.get("/healthz").raise_for_status()
                return sorted(pids)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise AssertionError(f"expected {n} workers of pid {server.proc.pid}, found {pids}")
        time.sleep(0.2)


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def received_in_file(path: Path) -> float:
    """Reports-received value one worker wrote to its own mmap file."""
    if not path.exists():
        return 0.0
    return sum(entry[1] for entry in MmapedDict.read_all_values_from_file(str(path))
               if json.loads(entry[0])[1] == RECEIVED)


def post_reports(url: str, reports: list[dict]) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", json={"reports": reports}, timeout=60, headers={"connection": "close"})


@pytest.mark.parametrize("given_dir", [True, False], ids=["PROMETHEUS_MULTIPROC_DIR-set", "serve-makes-dir"])
def test_ingest_counters_are_summed_over_workers(fresh_database_url, tmp_path, given_dir):
    """`auditor serve --workers 2`: after reports were served by both workers (each worker's
    own mmap file shows some), every scrape — whichever worker answers — exports
    auditor_reports_received_total equal to all reports accepted, the rejected counter per
    reason equal to all reports rejected (422 validation, 409 conflicting_report), and an
    ingest-latency count equal to all successful POSTs; the audit counters agree too. A
    metrics directory left over from an earlier run (a counter of 1000) is wiped at start.
    When a worker is killed (SIGKILL), uvicorn starts a new one and the totals still include
    the dead worker's reports; later reports add to them exactly. Without a preset directory
    `serve` makes a temporary one and removes it on exit."""
    env = {}
    mp_dir = tmp_path / "prom-mp"
    if given_dir:
        mp_dir.mkdir()
        stale = MmapedDict(str(mp_dir / f"counter_{STALE_PID}.db"))
        stale.write_value(mmap_key("auditor_reports_received", RECEIVED, [], [], "stale"), 1000.0, 0.0)
        stale.close()
        env["PROMETHEUS_MULTIPROC_DIR"] = str(mp_dir)
    server = ServerProcess(fresh_database_url, tmp_path / "server.log", args=("--workers", "2"), **env).start()
    try:
        pids = workers_of(server, 2)
        dirs = {environ_of(p).get("PROMETHEUS_MULTIPROC_DIR") for p in pids}
        assert len(dirs) == 1 and None not in dirs
        mp_dir = Path(dirs.pop())
        if given_dir:
            assert mp_dir == tmp_path / "prom-mp"
        assert not (mp_dir / f"counter_{STALE_PID}.db").exists()

        run_prefix = f"mw-{uuid.uuid4().hex[:6]}"
        accepted = posts = 0
        audited_runs = []
        with ThreadPoolExecutor(8) as pool:
            for rnd in range(60):  # until both workers served reports (usually the first round)
                runs = [f"{run_prefix}-{rnd}-{i}" for i in range(16)]
                results = list(pool.map(lambda r: post_reports(server.url, reference_reports(r, buggy=True)), runs))
                for r in results:
                    assert r.status_code == 200, r.text
                    accepted += r.json()["accepted"]
                    posts += 1
                audited_runs += runs
                if all(received_in_file(mp_dir / f"counter_{p}.db") > 0 for p in pids):
                    break
        per_worker = [received_in_file(mp_dir / f"counter_{p}.db") for p in pids]
        assert all(v > 0 for v in per_worker) and sum(per_worker) == accepted, per_worker

        bad = reference_reports(f"{run_prefix}-bad", buggy=True)
        bad[0]["local"]["count"] = -1
        for _ in range(3):
            assert post_reports(server.url, bad).status_code == 422
        clash = reference_reports(audited_runs[0], buggy=True)
        clash[1]["local"]["sum"] += 1.0
        assert post_reports(server.url, clash).status_code == 409

        def expect(received: float, latency_count: float) -> None:
            for _ in range(12):
                m = scrape(server.url)
                assert m[(RECEIVED, ())] == received
                assert m[(LATENCY_COUNT, ())] == latency_count
                assert m[(REJECTED, (("reason", "validation"),))] == 3 * 2
                assert m[(REJECTED, (("reason", "conflicting_report"),))] == 1
                key = ("auditor_steps_audited_total",
                       (("run", audited_runs[-1]), ("statistic", "advantages"), ("verdict", "inconsistent")))
                assert m[key] == 1

        expect(accepted, posts)

        os.kill(pids[0], signal.SIGKILL)
        new = workers_of(server, 2, exclude={pids[0]}, timeout=60)
        assert pids[0] not in new and pids[1] in new
        expect(accepted, posts)  # the dead worker's reports still count

        more = [f"{run_prefix}-after-{i}" for i in range(8)]
        for run in more:
            assert post_reports(server.url, reference_reports(run, buggy=False)).status_code == 200
        expect(accepted + 2 * len(more), posts + len(more))
        assert scrape(server.url)[("auditor_steps_audited_total", (
            ("run", more[-1]), ("statistic", "advantages"), ("verdict", "consistent")))] == 1
    finally:
        server.stop()
    assert mp_dir.exists() == given_dir


def test_single_worker_uses_no_multiprocess_dir(fresh_database_url, tmp_path):
    """With one worker (the default) no multiprocess directory is used: the ingest counters
    are ordinary in-process metrics and still count exactly what was posted."""
    server = ServerProcess(fresh_database_url, tmp_path / "server.log").start()
    try:
        assert "PROMETHEUS_MULTIPROC_DIR" not in environ_of(server.proc.pid)
        run = f"one-{uuid.uuid4().hex[:6]}"
        assert post_reports(server.url, reference_reports(run, buggy=False)).status_code == 200
        m = scrape(server.url)
        assert m[(RECEIVED, ())] == 2 and m[(LATENCY_COUNT, ())] == 1
    finally:
        server.stop()


def test_idle_runs_stop_being_exported(fresh_database_url, tmp_path):
    """AUDITOR_METRICS_RETENTION_SECONDS=2: a run whose last audit is older than 2 s has no
    series on /metrics any more while a fresh run has; when the idle run is audited again its
    series come back with their full totals (counters do not restart)."""
    server = ServerProcess(fresh_database_url, tmp_path / "server.log",
                           AUDITOR_METRICS_RETENTION_SECONDS="2").start()
    try:
        old, new = f"idle-{uuid.uuid4().hex[:6]}", f"fresh-{uuid.uuid4().hex[:6]}"

        def steps(m, run, verdict):
            return m.get(("auditor_steps_audited_total",
                          (("run", run), ("statistic", "advantages"), ("verdict", verdict))))

        def runs_in(m) -> set[str]:
            return {dict(labels).get("run") for _, labels in m} - {None}

        assert post_reports(server.url, reference_reports(old, buggy=True, step=0)).status_code == 200
        m = scrape(server.url)
        assert steps(m, old, "inconsistent") == 1 and old in runs_in(m)
        assert m[("auditor_cp_disagreement_sigma", (("run", old), ("statistic", "advantages")))] == pytest.approx(
            0.433154, abs=1e-6)

        time.sleep(2.5)
        assert post_reports(server.url, reference_reports(new, buggy=False)).status_code == 200
        m = scrape(server.url)
        assert old not in runs_in(m), "idle run still exported"
        assert new in runs_in(m) and steps(m, new, "consistent") == 1

        assert post_reports(server.url, reference_reports(old, buggy=True, step=1)).status_code == 200
        m = scrape(server.url)
        assert steps(m, old, "inconsistent") == 2
        assert m[("auditor_last_audited_step", (("run", old), ("statistic", "advantages")))] == 1
    finally:
        server.stop()
