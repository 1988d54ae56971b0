"""Bounded cardinality: statistics per run capped at registration, the metrics' series
capped with an aggregate of the rest."""

from __future__ import annotations

import time

from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import post_reports as post
from auditor.testing.server import ServerProcess


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
