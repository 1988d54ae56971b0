"""A run's end of life: deleted in bounded chunks (other runs keep being ingested), or dropped
with its reports once idle past the retention."""

from __future__ import annotations

import time

import httpx
import sqlalchemy as sa
from factory import reference_reports

from auditor.testing.http import assert_problem
from auditor.testing.http import post_reports as post
from auditor.testing.server import ServerProcess


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
