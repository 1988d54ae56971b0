"""The store in this process, on SQLite and PostgreSQL: SQL only, rows and dataclasses out,
and the exactly-once primitives the service's flows rely on."""

from __future__ import annotations

import time

import pytest
from factory import reference_reports

from auditor import core
from auditor.db.store import COLUMNS, KEY, Store, rank_report, report_row
from auditor.schemas import Report


@pytest.fixture
def store(service) -> Store:
    return service.store


def _rows(run_id: str, series_id: int, now: float, step: int = 0) -> list[tuple]:
    reports = [Report.model_validate(r) for r in reference_reports(run_id, buggy=True, step=step)]
    return sorted(report_row(r, series_id, now) for r in reports)


def test_runs_and_series_are_created_once_and_read_back(store, run_id):
    """ensure_run/ensure_series insert once and return what is stored: a second call with
    another topology or spec returns the first (the service words the 409)."""
    now = time.time()
    with store.write() as conn:
        first = store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        again = store.ensure_run(conn, run_id, 4, (2, 2, 1, 1), now + 1)
        s1 = store.ensure_series(conn, run_id, "adv", "moments", {"reduce_over": ["dp", "cp"]}, now)
        s2 = store.ensure_series(conn, run_id, "adv", "sum", {"reduce_over": ["dp"]}, now)
    assert (first.world_size, first.sizes) == (2, (1, 2, 1, 1)) and again == first
    assert (s1.kind, s1.spec) == ("moments", {"reduce_over": ["dp", "cp"]}) and s2 == s1
    with store.read() as conn:
        srow, run = store.series_by_id(conn, s1.id)
        assert (srow, run) == (s1, first)
        assert store.run(conn, run_id)["world_size"] == 2
        assert [s["statistic"] for s in store.series_rows(conn, run_id)] == ["adv"]


def test_bulk_insert_is_all_or_nothing_and_reads_back_the_engine_input(store, run_id):
    """insert_all_new stores every row of a new batch (True) or nothing (False, a key
    exists); insert_returning then names the keys it stored; step_reports gives the engine
    the same RankReports as the rows in hand (rank_report)."""
    now = time.time()
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
        rows = _rows(run_id, sid, now)
        assert [r[:4] for r in rows] == [(sid, 0, 0, 0), (sid, 0, 0, 1)] and len(rows[0]) == len(COLUMNS)
        assert store.insert_all_new(conn, rows) is (store.dialect == "sqlite")  # PG: < 32 rows go row by row
        inserted = store.insert_returning(conn, rows)
        assert inserted == (set() if store.dialect == "sqlite" else {r[:4] for r in rows})
        assert store.insert_all_new(conn, rows) is False
        assert store.insert_returning(conn, rows) == set()
        stored = store.fetch_reports(conn, [r[:4] for r in rows])
        assert {k: v[:-1] for k, v in stored.items()} == {r[:4]: r[:-1] for r in rows}
        got = sorted(store.step_reports(conn, sid, 0), key=lambda r: r.rank)
    assert got == [rank_report(r) for r in rows]
    assert got[1].group_ranks == (1,) and got[1].local_count == 85.0 and KEY == COLUMNS[:4]


def test_a_verdict_is_recorded_once_with_its_aggregates(store, run_id):
    """count_arrivals adds to the step row and returns it; record_verdict writes the verdict
    only while the step is open (a second call is False and changes nothing); the series
    aggregates, fault counts and the history loader read it back."""
    now = time.time()
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
        rows = _rows(run_id, sid, now)
        store.insert_returning(conn, rows)
        (arrival,) = store.count_arrivals(conn, {(sid, 0): 2}, {(sid, 0): 2}, now)
        assert (arrival.received, arrival.expected, arrival.verdict) == (2, 2, None)
        v = core.audit_step([rank_report(r) for r in rows], (1, 2, 1, 1), core.Spec())
        assert store.record_verdict(conn, sid, 0, v, now) is True
        assert store.record_verdict(conn, sid, 0, v, now) is False
        (g,) = v.groups  # key: the coordinates outside reduce_over (tp, pp)
        assert store.history(conn, sid, 1)() == {(0, 0): [(0, 150.0, pytest.approx(0.1, abs=1e-12), g.var)]}
    with store.read() as conn:
        row = store.step_row(conn, sid, 0)
        assert row["verdict"] == "inconsistent" and row["cp_disagreement_sigma"] == pytest.approx(0.433154, abs=1e-6)
        assert store.fault_counts(conn, sid) == {"cp_disagreement": 1, "group_mismatch": 1, "wrong_group": 1}
        assert [f["kind"] for f in store.step_faults(conn, sid, 0)] == [str(f.kind) for f in v.faults]
        assert store.pending_steps(conn, sid) == 0
        assert [b["step"] for b in store.bad_steps(conn, sid, 5)] == [0]
        (s,) = store.series_rows(conn, run_id)
        assert (s["steps_inconsistent"], s["first_bad_step"], s["last_audited_step"]) == (1, 0, 0)
    (m,) = [m for m in store.metric_series(now - 1) if m["run_id"] == run_id]
    assert m["faults"] == {"cp_disagreement": 1, "group_mismatch": 1, "wrong_group": 1}


def test_open_steps_are_due_after_their_grace_period(store, run_id):
    """due_steps lists open steps first seen at or before the cut-off, in key order."""
    now = time.time()
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
        store.insert_returning(conn, _rows(run_id, sid, now)[:1])
        store.count_arrivals(conn, {(sid, 0): 1}, {(sid, 0): 2}, now)
    with store.read() as conn:
        assert (sid, 0, 2) in store.due_steps(conn, now, 10_000)
        assert (sid, 0, 2) not in store.due_steps(conn, now - 1, 10_000)
