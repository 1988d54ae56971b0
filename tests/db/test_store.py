"""The store in this process, on SQLite and PostgreSQL: SQL only, rows and dataclasses out,
and the exactly-once primitives the service's flows rely on."""

from __future__ import annotations

import contextlib
import re
import tempfile
import time

import pytest
import sqlalchemy as sa
from factory import reference_reports

from auditor import core
from auditor.db.store import COLUMNS, KEY, ReportsExist, Store, VerdictItem, rank_report, report_row
from auditor.contract.models import Report


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
        assert store.run(conn, run_id).world_size == 2
        assert [s["statistic"] for s in store.series_rows(conn, run_id)] == ["adv"]


def test_bulk_insert_is_all_or_nothing_and_reads_back_the_engine_input(store, run_id):
    """insert_all_new stores every row of a new batch (True), or raises ReportsExist when
    a key exists (the caller's transaction is then rolled back: nothing of it stays);
    insert_returning names the keys it stored; step_reports gives the engine the same
    RankReports as the rows in hand (rank_report; group_ranks as the stored text)."""
    now = time.time()
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
        rows = _rows(run_id, sid, now)
        assert [r[:4] for r in rows] == [(sid, 0, 0, 0), (sid, 0, 0, 1)] and len(rows[0]) == len(COLUMNS)
        assert store.insert_all_new(conn, rows) is (store.dialect == "sqlite")  # PG: < 32 rows go row by row
        inserted = store.insert_returning(conn, rows)
        assert inserted == (set() if store.dialect == "sqlite" else {r[:4] for r in rows})
    with store.write() as conn:
        if store.dialect == "sqlite":
            with pytest.raises(ReportsExist):
                store.insert_all_new(conn, rows)
        else:
            assert store.insert_all_new(conn, rows) is False
    with store.write() as conn:
        assert store.insert_returning(conn, rows) == set()
        stored = store.fetch_reports(conn, [r[:4] for r in rows])
        assert {k: v[:-1] for k, v in stored.items()} == {r[:4]: r[:-1] for r in rows}
        got = sorted(store.step_reports(conn, sid, 0), key=lambda r: r.rank)
    assert got == [rank_report(r) for r in rows]
    assert got[1].group_ranks == "1" and got[1].local_count == 85.0 and KEY == COLUMNS[:4]  # the stored text


def test_bulk_insert_of_any_size_stores_each_row_once(store, run_id):
    """Batches of 1, 17, 256, 529 (256 + 256 + 16 + 1) and 300 rows (SQLite inserts 256, 16
    and then single rows per statement) are stored whole and read back equal, in every
    chunk's place; a batch with one stored key, in a 256-row chunk or among the single rows
    at its end, raises ReportsExist, and its transaction's rollback leaves nothing of it."""
    now = time.time()
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
    step = 0
    for n in (1, 17, 256, 529, 300):
        rows = sorted(r for s in range(step, step + (n + 1) // 2) for r in _rows(run_id, sid, now, step=s))[:n]
        rows = [(*r[:-3], f"{r[1]},{r[3]}", *r[-2:]) for r in rows]  # a distinct value per row (non_finite)
        step += (n + 1) // 2
        with store.write() as conn:
            assert store.insert_all_new(conn, rows) is (store.dialect == "sqlite" or n >= 32)
            if store.dialect == "postgresql" and n < 32:
                assert store.insert_returning(conn, rows) == {r[:4] for r in rows}
        with store.read() as conn:
            stored = store.fetch_reports(conn, [r[:4] for r in rows])
        assert {k: v[:-1] for k, v in stored.items()} == {r[:4]: r[:-1] for r in rows}, n
    for at in (100, 299):  # in the first 256-row statement; the last single row
        again = sorted(r for s in range(step, step + 150) for r in _rows(run_id, sid, now, step=s))
        again[at] = (*again[at][:1], 1, *again[at][2:])  # step 1's key (either rank): stored above
        with pytest.raises(ReportsExist), store.write() as conn:
            store.insert_all_new(conn, again)
        with store.read() as conn:
            assert store.fetch_reports(conn, [r[:4] for r in again if r[1] >= step]) == {}


def test_a_verdict_is_recorded_once_with_its_aggregates(store, run_id):
    """count_arrivals adds to the step row and returns it; record_verdicts writes the verdict
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
        assert store.record_verdicts(conn, [VerdictItem(sid, 0, v)], now) == [True]
        assert store.record_verdicts(conn, [VerdictItem(sid, 0, v)], now) == [False]
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


def _verdict(verdict: str, cp=None, ae=None, faults=(), step_groups=1) -> core.StepVerdict:
    fs = [core.Fault(core.FaultKind(k), f"{k} message", [0, 1], {"max_error_sigma": 1.5} if k != "missing_report"
                     else {"missing": 1, "expected": 2}) for k in faults]
    groups = [core.GroupStat((0, g), 0, [], 150.0, 0.1 * g, 1.25) for g in range(step_groups)]
    return core.StepVerdict(verdict, fs, [], groups, cp, ae, 0.01 if verdict == "consistent" else None)


#: (step, verdict, complete, previous, progress) in three rounds: first audits in an order
#: that is not the step order (a newer step before older ones), ties and NaN among the σ
#: figures, then re-audits (incomplete → consistent, inconsistent → consistent) mixed with
#: first audits and a step recorded already (it must lose).
_PROGRESS = {"newest_step": 7, "ranks_behind": 1, "at": [], "summary": "rank 1 stopped at step 3"}
_ROUNDS = [
    [(7, _verdict("consistent", 0.2, 0.3), True, None, None),
     (0, _verdict("consistent", 0.1, 0.2), True, None, None),
     (1, _verdict("inconsistent", 0.5, 0.9, ("cp_disagreement", "group_mismatch")), True, None, None),
     (2, _verdict("incomplete", None, None, ("missing_report",)), False, None, _PROGRESS),
     (3, _verdict("consistent", 0.5, 0.9, step_groups=2), True, None, None),
     (4, _verdict("inconsistent", float("nan"), 2.0, ("missing_report", "group_mismatch")), False, None, None),
     (5, _verdict("audit_error", None, None, ("audit_error",)), True, None, None)],
    [(8, _verdict("inconsistent", 3.0, 0.1, ("wrong_group",)), True, None, None),
     (6, _verdict("consistent", 0.05, 0.05), True, None, None)],
    [(2, _verdict("consistent", 0.3, 0.3), True, "incomplete", None),
     (4, _verdict("consistent", 0.2, 0.1), True, "inconsistent", None),
     (1, _verdict("consistent"), True, None, None),
     (9, _verdict("incomplete", None, None, ("missing_report",)), False, None, dict(_PROGRESS, newest_step=9)),
     (10, _verdict("consistent", 0.4, 0.4), True, None, None)],
]


def test_record_verdicts_all_at_once_equals_one_by_one(store, run_id):
    """The same rounds of verdicts recorded one by one (a record_verdicts call per item, key
    order) in one series and all at once (one call per round) in another leave identical step
    rows, faults, series aggregates and fault counts, and win/lose the same."""
    now = time.time()
    sids = []
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        for name in ("one", "all"):
            sid = store.ensure_series(conn, run_id, name, "moments", {}, now).id
            sids.append(sid)
            store.count_arrivals(conn, {(sid, s): 1 for s in range(11)}, {(sid, s): 2 for s in range(11)}, now)
    for r, items in enumerate(_ROUNDS):
        with store.write() as conn:
            one = [ok for st, v, c, p, g in sorted(items, key=lambda it: it[0])
                   for ok in store.record_verdicts(conn, [VerdictItem(sids[0], st, v, c, p, g)], now + r)]
            many = store.record_verdicts(conn, [VerdictItem(sids[1], st, v, c, p, g) for st, v, c, p, g in items],
                                         now + r)
        assert [ok for _, ok in sorted(zip([it[0] for it in items], many))] == one
    assert one == [False, True, True, True, True]  # steps 1, 2, 4, 9, 10: step 1 was recorded already
    with store.read() as conn:
        rows = [store.series_rows(conn, run_id, statistic=name)[0] for name in ("one", "all")]
        strip = {"id", "statistic"}
        assert {k: v for k, v in rows[0].items() if k not in strip} == {k: v for k, v in rows[1].items()
                                                                        if k not in strip}
        assert (rows[0]["first_bad_step"], rows[0]["last_bad_step"], rows[0]["last_audited_step"]) == (1, 8, 10)
        assert rows[0]["superseded_incomplete"] == 1 and rows[0]["ranks_behind"] == 0
        for s in range(11):
            a, b = (dict(store.step_row(conn, sid, s)) for sid in sids)
            assert {**a, "series_id": 0} == {**b, "series_id": 0}, s
            fa, fb = ([dict(f) for f in store.step_faults(conn, sid, s)] for sid in sids)
            assert fa == fb, s
        assert store.fault_counts(conn, sids[0]) == store.fault_counts(conn, sids[1]) == {
            "audit_error": 1, "missing_report": 1, "wrong_group": 1, "cp_disagreement": 1, "group_mismatch": 1}


@contextlib.contextmanager
def _executions(conn: sa.Connection, out: list):
    """Append to ``out`` what the database executes on ``conn`` meanwhile: on PostgreSQL
    each backend execution (libpq's protocol trace: ``Execute`` and simple ``Query``
    messages; psycopg's executemany sends one ``Execute`` per parameter set); on SQLite
    each run of one statement (SQLite's trace callback, literals blanked, consecutive
    repeats, i.e. an ``executemany``, counted once)."""
    raw = conn.connection.driver_connection
    if conn.dialect.name == "postgresql":
        import psycopg

        with tempfile.TemporaryFile("w+") as f:
            raw.pgconn.trace(f.fileno())
            raw.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
            try:
                yield
            finally:
                raw.pgconn.untrace()
                f.seek(0)
                out += [line for line in f.read().splitlines()
                        if line.startswith("F\t") and line.split("\t")[2] in ("Execute", "Query")]
        return
    seen: list[str] = []
    raw.set_trace_callback(seen.append)
    try:
        yield
    finally:
        raw.set_trace_callback(None)
    shapes = [re.sub(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?(?:e[+-]?\d+)?\b|\bNULL\b", "?", q) for q in seen]
    out += [q for i, q in enumerate(shapes) if i == 0 or shapes[i - 1] != q]


def test_record_verdicts_takes_a_bounded_number_of_statements(store, run_id):
    """Counting the arrivals of 5, 200 or 1,337 steps and recording their verdicts (with
    faults; steps with a step row and fresh steps inserted with their verdict) takes a few
    statements whatever the number of steps: on PostgreSQL the same few backend executions
    (one per statement, not per step), on SQLite a few statement texts (multi-row VALUES of
    500, 32 and 1 rows, consecutive runs of one text counted once)."""
    now = time.time()
    counts = []
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id

    def verdict(s):
        return (_verdict("inconsistent", 0.1 * s, 0.2, ("group_mismatch",)) if s % 3 else
                _verdict("consistent", 0.1, 0.1))

    for steps in (range(5), range(5, 205), range(205, 1542)):
        executed: list = []
        with store.write() as conn, _executions(conn, executed):
            store.count_arrivals(conn, {(sid, s): 2 for s in steps}, {(sid, s): 2 for s in steps}, now)
            done = store.record_verdicts(
                conn, [VerdictItem(sid, s, verdict(s)) for s in steps]
                + [VerdictItem(sid, 10_000 + s, verdict(s), fresh=True, expected=2, received=2) for s in steps], now)
        assert all(done)
        counts.append(len(executed))
    assert max(counts) <= 12 and (store.dialect == "sqlite" or counts[0] == counts[1] == counts[2]), counts
    with store.read() as conn:
        assert [(r["step"], r["received"], r["verdict"]) for r in store.step_rows(conn, sid, start=10_000, stop=10_002)] \
            == [(10_000, 2, "consistent"), (10_001, 2, "inconsistent"), (10_002, 2, "inconsistent")]
        (s,) = store.series_rows(conn, run_id)
        assert (s["steps_consistent"], s["steps_inconsistent"]) == (2 * 514, 2 * 1028)  # s % 3 == 0 consistent
        for st in (3, 4, 200):  # a fresh row is what count_arrivals and the verdict UPDATE leave
            assert dict(store.step_row(conn, sid, 10_000 + st)) == {**store.step_row(conn, sid, st), "step": 10_000 + st}


def test_verdict_updates_find_the_step_row_by_its_key_on_sqlite(store):
    """SQLite's plan for the verdict UPDATEs (and the bad-step recount) is a key lookup:
    with ``verdict`` in the filter, a plan over ``ix_step_audits_open`` would scan every
    open step of every series for each verdict written."""
    if store.dialect != "sqlite":
        pytest.skip("a SQLite query plan")
    with store.read() as conn:
        raw = conn.connection.driver_connection
        for sql in (store._step_sql_of["first"], store._step_sql_of["again"],
                    str(store._series_stmt.compile(dialect=store.engine.dialect))):
            plan = [row[3] for row in raw.execute("EXPLAIN QUERY PLAN " + sql, [None] * sql.count("?"))]
            assert all("ix_step_audits_open" not in p and not p.startswith("SCAN") for p in plan), plan
            assert any("(series_id=? AND step=?)" in p or "(rowid=?)" in p for p in plan), plan


def test_the_sweeps_queries_use_the_partial_step_indexes(fresh_database_url):
    """The sweep's reads use the partial indexes of revision 0007, as each database plans
    them: ``due_steps`` searches ``ix_step_audits_open`` (``WHERE verdict IS NULL``) by
    first_seen and ``reaudit_steps`` reads ``ix_step_audits_complete_at_audit`` (``WHERE
    complete_at_audit IS FALSE``); ``pending_steps`` keeps ``ix_step_audits_series_verdict_step``.
    A query whose WHERE stopped implying an index's predicate (on SQLite: term for term,
    ``IS 0`` and not ``= 0`` or ``IS FALSE``) would scan the table. 6,000 steps over three
    series, 1 % open, 2 % audited incomplete; PostgreSQL ANALYZEd, SQLite as the service
    leaves it (no statistics)."""
    from auditor.db.engine import make_engine, upgrade

    upgrade(fresh_database_url)
    engine = make_engine(fresh_database_url)
    store, now, n = Store(engine), 1e6, 6000
    with store.write() as conn:
        store.ensure_run(conn, "plans", 2, (1, 2, 1, 1), now)
        sids = [store.ensure_series(conn, "plans", f"s{i}", "moments", {}, now).id for i in range(3)]
        conn.execute(sa.text(
            "WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < :n) "
            "INSERT INTO step_audits (series_id, step, expected, received, first_seen, verdict, complete_at_audit, "
            "audited_at) SELECT CASE i % 3 WHEN 0 THEN :a WHEN 1 THEN :b ELSE :c END, i, 2, "
            "CASE WHEN i % 100 = 1 THEN 1 ELSE 2 END, i, CASE WHEN i > :open THEN NULL WHEN i % 50 = 1 "
            "THEN 'incomplete' ELSE 'consistent' END, CASE WHEN i > :open THEN NULL ELSE i % 50 <> 1 END, i FROM g"),
            {"n": n, "open": n - n // 100, "a": sids[0], "b": sids[1], "c": sids[2]})
        if store.dialect == "postgresql":
            conn.execute(sa.text("ANALYZE step_audits"))
    seen: list[tuple[str, object]] = []

    def capture(conn, cursor, statement, parameters, context, executemany):
        seen.append((statement, parameters))

    plans = {}
    try:
        with store.read() as conn:
            for name, read in (("due", lambda: store.due_steps(conn, n - n // 100 + 10, 100)),
                               ("reaudit", lambda: store.reaudit_steps(conn, 100)),
                               ("pending", lambda: store.pending_steps(conn, sids[1]))):
                sa.event.listen(engine, "before_cursor_execute", capture)
                try:
                    got = read()
                finally:
                    sa.event.remove(engine, "before_cursor_execute", capture)
                statement, parameters = [x for x in seen if x[0].lstrip().upper().startswith("SELECT")][-1]
                if store.dialect == "postgresql":
                    plans[name] = [r[0] for r in conn.exec_driver_sql("EXPLAIN " + statement, parameters)]
                else:
                    plans[name] = [r[3] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, parameters)]
                assert got == {"due": sorted((sids[i % 3], i, 2) for i in range(5941, 5951)),
                               "reaudit": sorted((sids[i % 3], i, 2, "incomplete") for i in range(51, 5941, 100)),
                               "pending": 20}[name], (name, got)
    finally:
        engine.dispose()
    text = {k: "\n".join(v) for k, v in plans.items()}
    if store.dialect == "sqlite":
        assert "SEARCH step_audits USING INDEX ix_step_audits_open (verdict=? AND first_seen<?)" in text["due"], text
        assert "SCAN step_audits USING INDEX ix_step_audits_complete_at_audit" in text["reaudit"], text
        assert "ix_step_audits_series_verdict_step (series_id=? AND verdict=?)" in text["pending"], text
    else:
        assert re.search(r"Index Scan on ix_step_audits_open\b.*\n.*Index Cond: \(first_seen <=", text["due"]), text
        assert "Index Scan on ix_step_audits_complete_at_audit" in text["reaudit"], text
        assert "Index Scan on ix_step_audits_series_verdict_step" in text["pending"], text
    assert not any("Seq Scan" in t for t in text.values()), text


def test_verdict_text_and_numbers_are_stored_as_given(store, run_id):
    """Fault messages and evidence with quotes, backslashes, braces, commas, NULL, unicode
    and newlines, NaN/Inf and tiny/huge σ figures and group values, in fresh and updated
    step rows, read back as given (PostgreSQL takes them as array literals)."""
    now = time.time()
    nasty = 'a "quoted", {braced} \\ back\\slash NULL\nσ≈1e-7 \'single\''
    with store.write() as conn:
        store.ensure_run(conn, run_id, 2, (1, 2, 1, 1), now)
        sid = store.ensure_series(conn, run_id, "adv", "moments", {}, now).id
        store.count_arrivals(conn, {(sid, 0): 2}, {(sid, 0): 2}, now)
        items = []
        for st, fresh in ((0, False), (1, True)):
            fault = core.Fault(core.FaultKind("group_mismatch"), nasty, [0, 1],
                               {"text": nasty, "x": float("inf"), "y": [1e-300, None]})
            groups = [core.GroupStat((0, 1), 0, [], 150.0, 1e-300, float("nan")),
                      core.GroupStat((0, 2), 0, [], 2.0, -1e300, 0.1)]
            v = core.StepVerdict("inconsistent", [fault], [], groups, 1e-7 * (st + 1), 1e300, None)
            items.append(VerdictItem(sid, st, v, fresh=fresh, expected=2, received=2))
        assert store.record_verdicts(conn, items, now) == [True, True]
    with store.read() as conn:
        for st in (0, 1):
            row = store.step_row(conn, sid, st)
            assert (row["cp_disagreement_sigma"], row["applied_error_sigma"]) == (1e-7 * (st + 1), 1e300)
            assert row["groups"] == [[[0, 1], 0, 150.0, 1e-300, "nan"], [[0, 2], 0, 2.0, -1e300, 0.1]]
            (f,) = store.step_faults(conn, sid, st)
            assert (f["message"], f["evidence"]) == (nasty, {"text": nasty, "x": "inf", "y": [1e-300, None]})
