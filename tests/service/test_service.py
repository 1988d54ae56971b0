"""The service's flows in this process (no HTTP), on SQLite and PostgreSQL: the same
verdicts, conflicts and reports as the API serves (tests/server/test_api.py)."""

from __future__ import annotations

import time

import pytest
from factory import reference_reports

from auditor.db.store import ReportsExist, RowDeleted
from auditor.contract.models import DEFAULT_SPECS, Report, RunRegistration
from auditor.service import ConflictError, Contended, NotFound


def batch(run_id: str, buggy: bool, step: int = 0) -> list[Report]:
    return [Report.model_validate(r) for r in reference_reports(run_id, buggy=buggy, step=step)]


def test_ingest_audits_the_reference_case(service, run_id):
    """Ingest stores and audits the step it completes in one call: the reference bug gives
    cp_disagreement 0.433154 σ and applied error 0.267869 σ; a re-send is a duplicate."""
    out = service.ingest(batch(run_id, buggy=True))
    assert (out.accepted, out.duplicates, [v for _, _, v in out.audited]) == (2, 0, ["inconsistent"])
    assert service.ingest(batch(run_id, buggy=True)).duplicates == 2
    rep = service.report(run_id)
    (s,) = rep.statistics
    assert rep.consistent is False and set(s.faults) == {"cp_disagreement", "group_mismatch", "wrong_group"}
    assert s.cp_disagreement_sigma == pytest.approx(0.433154, abs=1e-6)
    assert s.applied_error_sigma == pytest.approx(0.267869, abs=1e-6)
    step, _ = service.step(run_id, "advantages", 0)
    assert step.verdict == "inconsistent" and [r.rank for r in step.ranks] == [0, 1]
    assert step.ranks[0].correct_mean == pytest.approx(0.1, abs=1e-6)


def test_conflicts_store_nothing_and_name_the_reports(service, run_id):
    """A different report under a stored key, another topology or another spec: 409-shaped
    ConflictError naming the offending index; nothing of the batch is stored."""
    service.ingest(batch(run_id, buggy=False)[:1])
    changed = batch(run_id, buggy=True)
    with pytest.raises(ConflictError) as e:
        service.ingest(changed)
    assert e.value.error == "conflicting_report" and e.value.conflicts[0]["index"] == 0
    assert "the stored report stays" in e.value.message
    other = reference_reports(run_id, buggy=False)
    other[0]["world_size"], other[0]["sizes"]["dp"] = 4, 2
    with pytest.raises(ConflictError) as e:
        service.ingest([Report.model_validate(other[0])])
    assert e.value.error == "topology_conflict" and e.value.conflicts == [{"index": 0, "field": "sizes"}]
    spec = dict(reference_reports(run_id, buggy=False)[1], spec={"reduce_over": ["dp"]})
    with pytest.raises(ConflictError) as e:
        service.ingest([Report.model_validate(spec)])
    assert e.value.error == "spec_conflict"
    assert service.get_run(run_id).steps_audited == 0  # the step is still open: nothing more was stored


def test_sweep_audits_incomplete_steps_once(service, run_id):
    """A step missing a report is audited by the sweep after the grace period: incomplete,
    missing_report for rank 1; a second sweep finds nothing of it."""
    service.ingest(batch(run_id, buggy=False)[:1])
    assert service.sweep(grace_seconds=0.0, now=time.time() + 1) >= 1
    step, _ = service.step(run_id, "advantages", 0)
    assert step.verdict == "incomplete" and step.faults[0].ranks == [1]
    assert step.faults[0].evidence == {"missing": 1, "expected": 2}
    service.sweep(grace_seconds=0.0, now=time.time() + 1)
    assert service.report(run_id).statistics[0].steps_audited == 1


def test_registration_and_reads(service, run_id):
    """register_run fixes the topology (idempotent, 409 on a contradiction); unknown runs,
    statistics and steps are NotFound; list_runs shows the run."""
    reg = RunRegistration.model_validate({"world_size": 2, "sizes": {"cp": 2}})
    assert service.register_run(run_id, reg).sizes == {"dp": 1, "cp": 2, "tp": 1, "pp": 1}
    assert service.register_run(run_id, reg).world_size == 2
    with pytest.raises(ConflictError):
        service.register_run(run_id, RunRegistration.model_validate({"world_size": 2, "sizes": {"dp": 2}}))
    assert run_id in {r.run_id for r in service.list_runs()}
    for call in (lambda: service.get_run(run_id + "-x"), lambda: service.step(run_id, "nope", 0),
                 lambda: service.report(run_id, statistic="nope")):
        with pytest.raises(NotFound):
            call()


def test_ingest_takes_a_bounded_number_of_statements_per_batch(service, run_id):
    """A batch completing 20 or 200 steps (some inconsistent) is stored, audited and its
    verdicts recorded in the same number of SQL statements: the cost is per batch, not per
    step; every step gets its verdict."""
    import sqlalchemy as sa

    counts = []
    service.ingest(batch(run_id, buggy=False, step=10_000))  # the run and series exist (and are cached)
    for first, steps in ((0, 20), (20, 200)):  # ≥ 32 reports: PostgreSQL's COPY path both times
        reports = [r for s in range(first, first + steps) for r in batch(run_id, buggy=s % 7 == 3, step=s)]
        statements = []
        listen = lambda *a, **k: statements.append(a[2])  # noqa: E731
        sa.event.listen(service.store.engine, "before_cursor_execute", listen)
        try:
            out = service.ingest(reports)
        finally:
            sa.event.remove(service.store.engine, "before_cursor_execute", listen)
        assert len(out.audited) == steps
        assert sum(v == "inconsistent" for _, _, v in out.audited) == sum(s % 7 == 3 for s in range(first, first + steps))
        counts.append(len(statements))
    assert counts[0] == counts[1], counts


def test_a_run_deleted_by_another_process_never_receives_reports_under_a_reused_id(fresh_database_url):
    """Two services on one database (replicas, ``--workers``): one caches run A's series,
    the other deletes run A and creates run B, whose series may get A's old id (SQLite
    reuses the largest deleted rowid). Reports of A sent to the first service then create
    run A anew; none of them lands in B's series, and B's verdict stays its own."""
    from auditor.db.engine import ensure_schema, make_engine
    from auditor.service import Service

    engine = make_engine(fresh_database_url)
    ensure_schema(engine, fresh_database_url)
    first, second = Service.from_engine(engine), Service.from_engine(engine)
    try:
        assert first.ingest(batch("run-a", buggy=False, step=0)).accepted == 2
        second.delete_run("run-a")
        assert second.ingest(batch("run-b", buggy=True, step=0)).accepted == 2
        out = first.ingest(batch("run-a", buggy=False, step=1))
        assert (out.accepted, [v for _, _, v in out.audited]) == (2, ["consistent"])
        b = second.report("run-b")
        (sb,) = b.statistics
        assert (sb.steps_audited, sb.cp_disagreement_sigma) == (1, pytest.approx(0.433154, abs=1e-6))
        assert [r.step for r in second.steps("run-b", "advantages")[0].steps] == [0]
        a = second.report("run-a")
        (sa_,) = a.statistics
        assert (a.consistent, sa_.steps_audited) == (True, 1)
    finally:
        first.close()
        second.close()


def test_a_run_deleted_while_an_ingest_is_in_flight_leaves_no_row_behind(fresh_database_url, monkeypatch):
    """An ingest of run A has written a step's reports and not committed when another
    service deletes run A: the deletion waits for it (the ingest holds its series,
    Store.lock_series) and then deletes what it committed too, so no report or step row is
    left without its series (PostgreSQL has no foreign key to cascade them, migration 0006).
    An ingest after the deletion makes run A anew."""
    import threading

    import sqlalchemy as sa

    from auditor.db.engine import ensure_schema, make_engine
    from auditor.db.tables import reports, series, step_audits
    from auditor.service import Service

    engine = make_engine(fresh_database_url)
    ensure_schema(engine, fresh_database_url)
    first, second = Service.from_engine(engine), Service.from_engine(engine)
    wrote, go = threading.Event(), threading.Event()
    insert = first.store.insert_all_new

    def insert_then_wait(conn, rows, meanwhile=None):
        out = insert(conn, rows, meanwhile)
        wrote.set()
        assert go.wait(30)
        return out

    try:
        assert first.ingest(batch("run-a", buggy=False, step=0)).accepted == 2
        monkeypatch.setattr(first.store, "insert_all_new", insert_then_wait)
        ingest = threading.Thread(target=first.ingest, args=(batch("run-a", buggy=False, step=1),))
        ingest.start()
        assert wrote.wait(30)
        deleted: list = []
        deleter = threading.Thread(target=lambda: deleted.append(second.delete_run("run-a")))
        deleter.start()
        deleter.join(1.0)
        assert deleter.is_alive()  # waits for the ingest in flight
        go.set()
        ingest.join(30)
        deleter.join(30)
        assert not ingest.is_alive() and not deleter.is_alive()
        assert deleted[0]["run_id"] == "run-a"
        with engine.connect() as conn:
            for table in (reports, step_audits):
                orphans = conn.execute(sa.select(sa.func.count()).select_from(table).where(
                    ~table.c.series_id.in_(sa.select(series.c.id)))).scalar_one()
                assert orphans == 0, table.name
            assert conn.execute(sa.select(sa.func.count()).select_from(reports)).scalar_one() == 0
        monkeypatch.undo()
        out = first.ingest(batch("run-a", buggy=True, step=2))  # cached series gone: made anew
        assert (out.accepted, [v for _, _, v in out.audited]) == (2, ["inconsistent"])
        assert second.report("run-a").statistics[0].steps_audited == 1
    finally:
        go.set()
        first.close()
        second.close()


def _state(service, run_id: str) -> dict:
    """Everything stored of a run's one statistic, without ids: step rows, faults, series
    aggregates and fault counts."""
    store = service.store
    with store.read() as conn:
        (s,) = store.series_rows(conn, run_id)
        srow = {k: v for k, v in s.items() if k not in ("id", "run_id")}
        sid = s["id"]
        steps = {r["step"]: {k: v for k, v in store.step_row(conn, sid, r["step"]).items() if k != "series_id"}
                 for r in store.step_rows(conn, sid, limit=10_000)}
        faults = {st: [{k: v for k, v in f.items() if k not in ("id", "series_id")}
                       for f in store.step_faults(conn, sid, st)] for st in steps}
        return {"series": srow, "steps": steps, "faults": faults, "fault_counts": store.fault_counts(conn, sid)}


def test_steps_complete_in_hand_are_recorded_as_the_general_path_records_them(service, run_id, monkeypatch):
    """Batches mixing steps they complete in hand (inserted with their verdict, no
    count_arrivals) with steps split across batches, a step the sweep audited incomplete
    that a late report completes (re-audit), and re-sent duplicates leave the same outcomes,
    step rows, faults, series aggregates and fault counts as the general path (upsert the
    step row, then UPDATE its verdict) does for the same batches."""
    t0 = time.time()

    def reports(rid, steps, ranks=(0, 1)):
        return [r for s in steps for r in batch(rid, buggy=s % 5 == 2, step=s) if r.rank in ranks]

    def rounds(rid):  # (reports, now) in order; None: a sweep at that time
        return [
            (reports(rid, range(0, 40)) + reports(rid, (40, 41, 60), ranks=(0,)), t0),
            (None, t0 + 10),  # steps 40, 41 and 60 audited incomplete
            (reports(rid, (40,), ranks=(1,)) + reports(rid, range(42, 50)) + reports(rid, (5, 41), ranks=(0,))
             + reports(rid, (60,), ranks=(1,)), t0 + 20),
            (reports(rid, range(0, 40)), t0 + 30),  # all re-sent
            (reports(rid, range(50, 60)) + reports(rid, (41,), ranks=(1,)), t0 + 40),
        ]

    counted: list[set] = []  # the steps of each count_arrivals call (round 4 adds nothing: no call)
    count_arrivals = service.store.count_arrivals

    def spy(conn, added, expected, now):
        counted.append(set(added))
        return count_arrivals(conn, added, expected, now)

    def general(rs, now):  # no step completed in hand; a batch with a re-send: report by report
        try:
            return service._ingest_retrying(rs, now, in_hand=False)
        except ReportsExist:
            return service._ingest_retrying(rs, now, in_hand=False, bulk=False)

    outcomes = {}
    for rid, in_hand in ((run_id, True), (run_id + "-general", False)):
        outs = []
        monkeypatch.setattr(service.store, "count_arrivals", spy)
        for rs, now in rounds(rid):
            if rs is None:
                service.sweep(grace_seconds=5.0, now=now)
                continue
            out = service.ingest(rs, now) if in_hand else general(rs, now)
            sid = service._series[(rid, "advantages")].id
            outs.append((out.accepted, out.duplicates, sorted((st, v) for s, st, v in out.audited if s == sid)))
        outcomes[in_hand] = outs
        if in_hand:  # the steps completed in hand never had a step row before their verdict
            assert [sorted(st for _, st in keys) for keys in counted] == [[40, 41, 60], [40, 60], [41]]
            counted.clear()
    assert outcomes[True] == outcomes[False]
    assert [(a, d, len(v)) for a, d, v in outcomes[True]] == [(83, 0, 40), (18, 2, 10), (0, 80, 0), (21, 0, 11)]
    new, general = _state(service, run_id), _state(service, run_id + "-general")
    assert new == general
    assert new["series"]["steps_consistent"] == 49 and new["series"]["steps_inconsistent"] == 12
    assert new["series"]["superseded_incomplete"] == 3 and new["steps"][41]["previous_verdict"] == "incomplete"
    assert new["fault_counts"]["cp_disagreement"] == 12


@pytest.mark.parametrize("buggy", [True, False], ids=["unclean", "clean"])
def test_a_step_row_left_without_its_reports_sends_the_batch_the_general_way(service, run_id, buggy):
    """A step whose reports were deleted under its kept step row, then sent again in full:
    the batch completes it in hand, its step row exists after all, and the batch is
    ingested again the general way (the reports stored, the step row's count raised, no
    second verdict), as before steps were completed in hand. ``clean``: the step goes
    through the columns (its row inserted by ``COPY`` on PostgreSQL, which the existing
    row fails with a unique violation), ``unclean``: through the exact engine."""
    service.ingest(batch(run_id, buggy=buggy, step=0) + batch(run_id, buggy=False, step=1))
    sid = service._series[(run_id, "advantages")].id
    with service.store.write() as conn:
        assert service.store.delete_rank_range(conn, sid, 0, 2) == 2
    out = service.ingest(batch(run_id, buggy=buggy, step=0) + batch(run_id, buggy=False, step=2))
    assert (out.accepted, out.duplicates, [(st, v) for _, st, v in out.audited]) == (4, 0, [(2, "consistent")])
    state = _state(service, run_id)
    verdict = "inconsistent" if buggy else "consistent"
    assert (state["steps"][0]["received"], state["steps"][0]["verdict"]) == (4, verdict)
    assert (state["series"]["steps_inconsistent"], state["series"]["steps_consistent"]) == ((1, 2) if buggy else (0, 3))


@pytest.mark.parametrize("table", ["runs", "series"])
def test_a_run_deleted_between_finding_and_reading_its_row_is_created_anew(service, database_url, run_id,
                                                                           monkeypatch, table):
    """A ``DELETE /v1/runs`` that commits between ``ensure_run``'s (or ``ensure_series``')
    INSERT, which found the row, and its SELECT, which no longer does (PostgreSQL, read
    committed), made a 500 (NoResultFound: 1 of ~480 posts of a new-user probe with a
    deleter in a loop). Now the ingest is tried again and creates the run anew; a
    registration likewise. SQLite's write transaction holds the database, so the deletion
    cannot come in between there."""
    if not database_url.startswith("postgresql"):
        pytest.skip("SQLite: the deletion waits for the ingest's write transaction")
    import sqlalchemy as sa

    from auditor.db.engine import make_engine
    from auditor.service import Service

    other = Service.from_engine(make_engine(database_url))
    fired: list[dict | None] = []

    def delete_in_between(conn, statement, *args, **kw):
        result = execute(conn, statement, *args, **kw)
        if (not fired and isinstance(statement, sa.sql.dml.Insert) and statement.table.name == table):
            fired.append(other.delete_run(run_id))  # commits on its own connection
        return result

    try:
        service.ingest(batch(run_id, buggy=False, step=0))
        service._runs.clear()  # the next ingest reads the run again (no cache): ensure_run's path
        service._series.clear()
        execute = sa.Connection.execute
        monkeypatch.setattr(sa.Connection, "execute", delete_in_between)
        out = service.ingest(batch(run_id, buggy=True, step=1))
        monkeypatch.undo()
        assert fired and fired[0]["run_id"] == run_id  # the deletion did come in between
        assert (out.accepted, [(st, v) for _, st, v in out.audited]) == (2, [(1, "inconsistent")])
        report = service.report(run_id)
        (adv,) = report.statistics
        assert (adv.steps_audited, adv.steps_inconsistent, adv.first_bad_step) == (1, 1, 1)

        fired.clear()
        monkeypatch.setattr(sa.Connection, "execute", delete_in_between)
        reg = RunRegistration.model_validate({"world_size": 2, "sizes": {"dp": 1, "cp": 2, "tp": 1, "pp": 1},
                                              "statistics": {"advantages": {"kind": "moments"}}})
        run = service.register_run(run_id, reg)
        monkeypatch.undo()
        assert fired and run.run_id == run_id and run.statistics == ["advantages"]
        assert run.steps_audited == 0  # the run made anew: the deletion took its steps

        calls: list[int] = []

        def deleted_every_time(*args, **kw):  # the race met on every attempt
            calls.append(1)
            raise RowDeleted(f"run {run_id!r}")

        monkeypatch.setattr(service.ingestion, "attempt", deleted_every_time)
        with pytest.raises(Contended, match="deleted and created anew 3 times"):  # the API's 503
            service.ingest(batch(run_id, buggy=False, step=2))
        monkeypatch.undo()
        assert len(calls) == 3
    finally:
        other.close()


def test_a_resend_that_changes_only_num_microbatches_is_a_conflict(service, run_id):
    """num_microbatches is kept in the step row (expected reports), not the report row: a
    re-send identical but for it was counted a duplicate (200) while the step expects
    another number of microbatches. It is a 409 naming the field, whether the step is
    open or audited, and an identical re-send stays a duplicate."""
    def rep(run, mb, nmb):
        return Report.model_validate({
            "run_id": run, "statistic": "s", "step": 0, "rank": 0, "world_size": 1, "microbatch": mb,
            "num_microbatches": nmb, "local": {"count": 4.0, "sum": 2.0, "sum_sq": 3.0},
            "applied": {"count": 4.0, "sum": 2.0, "sum_sq": 3.0}})

    assert service.ingest([rep(run_id, 0, 2)]).accepted == 1  # step 0 open: 1 of 2 microbatches
    for nmb in (1, 3):
        with pytest.raises(ConflictError) as e:
            service.ingest([rep(run_id, 0, nmb)])
        assert e.value.error == "conflicting_report" and e.value.conflicts[0]["fields"] == ["num_microbatches"]
        assert f"says num_microbatches={nmb}, but other reports of that step say 2" in e.value.message
    out = service.ingest([rep(run_id, 0, 2)])
    assert (out.accepted, out.duplicates) == (0, 1)
    out = service.ingest([rep(run_id, 1, 2)])
    assert (out.accepted, [v for _, _, v in out.audited]) == (1, ["consistent"])

    other = run_id + "-b"  # audited with 1 microbatch, then a re-send claiming 2
    assert [v for _, _, v in service.ingest([rep(other, 0, 1)]).audited] == ["consistent"]
    with pytest.raises(ConflictError, match="says num_microbatches=2, but other reports of that step say 1"):
        service.ingest([rep(other, 0, 2)])
    assert service.ingest([rep(other, 0, 1)]).duplicates == 1


def test_a_series_stored_with_a_placement_outside_its_run_refuses_reports_with_a_409(service, run_id):
    """A registration before f47c80a could store a placement outside the run's sizes
    (dp=[5] on dp=1); every report of that statistic was then a 500 (ValueError resolving
    the placement). Such a stored series now answers 409 spec_conflict naming the spec
    (the trainer's client dead-letters instead of retrying), nothing stored, and the other
    statistics of the run are unaffected."""
    ok = batch(run_id, buggy=False, step=0)
    service.ingest(ok)
    with service.store.write() as conn:  # what the registration stored then (no validation)
        service.store.ensure_series(conn, run_id, "placed", "moments",
                                    {**DEFAULT_SPECS["moments"].model_dump(), "placement": {"dp": [5]}}, time.time())
    bad = [r.model_copy(update={"statistic": "placed"}) for r in batch(run_id, buggy=False, step=1)]
    with pytest.raises(ConflictError) as e:
        service.ingest(bad)
    assert e.value.error == "spec_conflict" and e.value.conflicts == [{"index": 0, "field": "spec"}]
    assert "registered with a placement that does not fit the run's topology" in e.value.message
    assert "spec.placement.dp" in e.value.message
    out = service.ingest(batch(run_id, buggy=True, step=1))
    assert (out.accepted, [v for _, _, v in out.audited]) == (2, ["inconsistent"])
