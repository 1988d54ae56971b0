"""The reports a process stored of open steps (``auditor.service._OpenStepRows``): the batch
completing a step split across batches audits them from memory, with the verdicts and σ
of the read-back path, and reads back whenever memory cannot prove it holds every stored
report of the step (a replica stored some, a rolled-back batch, a run deleted and created
anew, an entry evicted). Both databases, real transactions; the read-back is counted by
wrapping the real :meth:`auditor.db.store.Store.report_rows`."""

from __future__ import annotations

import pytest
from factory import applied, total, world_reports

from auditor.db.store import Store
from auditor.contract.models import Report
from auditor.service import ConflictError, Service

DP, CP = 4, 2  # 8 ranks per step
PARTS = (slice(0, 3), slice(3, 6), slice(6, 8))  # a step in three batches


def step_reports(run_id: str, step: int, buggy: bool) -> list[dict]:
    """A correct 4×2 world, or (``buggy``) one whose DP-0 ranks whiten over their CP pair only."""
    reps = world_reports(run_id, step=step, dp=DP, cp=CP)
    if buggy:
        pair = applied(total(*(r["local"] for r in reps[:CP])))
        for r in reps[:CP]:
            r["applied"] = dict(pair)
    return reps


def parts(run_id: str, steps, part: slice, buggy=lambda s: s % 2 == 1) -> list[Report]:
    return [Report.model_validate(r) for s in steps for r in step_reports(run_id, s, buggy(s))[part]]


def fresh_service(service, **kw) -> tuple[Service, list]:
    """A Service of its own (its own caches, as another process or replica has) on the
    session database, and the list of the steps its store read back."""
    store = Store(service.store.engine)
    calls: list[tuple[int, int]] = []
    real = store.report_rows

    def report_rows(conn, series_id, step):
        calls.append((series_id, step))
        return real(conn, series_id, step)

    store.report_rows = report_rows
    return Service(store, **kw), calls


def state(service: Service, run_id: str) -> dict:
    """The verdicts, σ, faults and counts stored of every step of the run's one statistic."""
    store = service.store
    with store.read() as conn:
        (s,) = store.series_rows(conn, run_id)
        srow = {k: v for k, v in s.items() if k not in ("id", "run_id")}
        steps = {r["step"]: {k: v for k, v in store.step_row(conn, s["id"], r["step"]).items() if k != "series_id"}
                 for r in store.step_rows(conn, s["id"], limit=1000)}
        faults = {st: [{k: v for k, v in f.items() if k not in ("id", "series_id")}
                       for f in store.step_faults(conn, s["id"], st)] for st in steps}
        return {"series": srow, "steps": steps, "faults": faults}


def test_a_step_in_three_batches_is_audited_from_memory_as_read_back(service, run_id):
    """Four steps (two inconsistent) sent in three batches: the third batch audits them
    from the rows the first two stored, kept in memory (no read-back), and every stored
    verdict, σ and fault equals that of a service keeping nothing (which reads back)."""
    kept, kept_reads = fresh_service(service)
    none, none_reads = fresh_service(service, open_step_rows=0)
    for svc, rid in ((kept, run_id), (none, run_id + "-b")):
        for k, part in enumerate(PARTS):
            out = svc.ingest(parts(rid, range(4), part), now=1000.0 + k)
            assert out.accepted == 4 * (part.stop - part.start)
        assert [(st, v) for _, st, v in out.audited] == [(0, "consistent"), (1, "inconsistent"),
                                                        (2, "consistent"), (3, "inconsistent")]
    assert kept_reads == [] and len(none_reads) == 4
    assert len(kept._open) == 0  # the complete steps' rows are dropped
    got, want = state(kept, run_id), state(none, run_id + "-b")
    assert got == want
    assert got["steps"][1]["applied_error_sigma"] == pytest.approx(0.146971, abs=1e-6)
    assert [f["kind"] for f in got["faults"][1]] == ["group_mismatch", "wrong_group"]


def test_a_step_partly_stored_by_a_replica_is_read_back(service, run_id):
    """Two services on one database (replicas): the first stores parts 1 and 3 of a step,
    the second part 2 in between. The step row's count then exceeds what the first holds:
    it reads the step back, and the verdict is that of the whole step."""
    a, a_reads = fresh_service(service)
    b, b_reads = fresh_service(service)
    a.ingest(parts(run_id, [0, 1], PARTS[0]))
    assert len(a._open) == 6
    b.ingest(parts(run_id, [0, 1], PARTS[1]))
    assert len(b._open) == 0  # B did not store all of the steps' reports: nothing to keep
    out = a.ingest(parts(run_id, [0, 1], PARTS[2]))
    assert [(st, v) for _, st, v in out.audited] == [(0, "consistent"), (1, "inconsistent")]
    assert len(a_reads) == 2 and b_reads == [] and len(a._open) == 0
    steps = state(a, run_id)["steps"]
    assert (steps[0]["received"], steps[1]["received"]) == (8, 8)
    assert steps[1]["complete_at_audit"] and steps[1]["applied_error_sigma"] == pytest.approx(0.146971, abs=1e-6)


def test_a_rolled_back_batch_leaves_no_rows(service, run_id):
    """A batch refused with a 409 after its new reports were inserted (a re-send of a
    stored report with another dtype) is rolled back:
    the rows it would have added are not kept; the step then completes from memory with
    the rows of the batches that were stored."""
    svc, reads = fresh_service(service)
    svc.ingest(parts(run_id, [0], PARTS[0]))
    assert len(svc._open) == 3
    second = parts(run_id, [0], PARTS[1])
    clash = Report.model_validate(dict(step_reports(run_id, 0, False)[0], dtype="bfloat16"))
    with pytest.raises(ConflictError):
        svc.ingest(second + [clash])
    assert len(svc._open) == 3
    out = svc.ingest(second + parts(run_id, [0], PARTS[2]))
    assert [v for _, _, v in out.audited] == ["consistent"] and reads == []
    assert state(svc, run_id)["steps"][0]["received"] == 8


def test_a_run_deleted_and_created_anew_is_not_confused_with_its_old_rows(service, run_id):
    """A service keeps part 1 of a correct step; another deletes the run and stores parts
    1 and 2 of a buggy step under the same run id; the first then completes the step: it
    notices the new incarnation, reads back and finds it inconsistent. A run deleted by
    this service drops its rows."""
    a, a_reads = fresh_service(service)
    b, _ = fresh_service(service)
    a.ingest(parts(run_id, [0], PARTS[0], buggy=lambda s: False))
    assert len(a._open) == 3
    b.delete_run(run_id)
    b.ingest(parts(run_id, [0], PARTS[0], buggy=lambda s: True) + parts(run_id, [0], PARTS[1], buggy=lambda s: True))
    out = a.ingest(parts(run_id, [0], PARTS[2], buggy=lambda s: True))
    assert [v for _, _, v in out.audited] == ["inconsistent"] and len(a_reads) == 1

    a.ingest(parts(run_id, [1], PARTS[0]))
    assert len(a._open) == 3
    a.delete_run(run_id)
    assert len(a._open) == 0


def test_the_oldest_steps_are_evicted_at_the_bound_and_read_back(service, run_id):
    """With room for 7 rows, parts 1 and 2 of steps 0 and 1 (6 rows each) keep step 1's
    only (step 0, the oldest, is evicted); completing both reads step 0 back and audits
    step 1 from memory."""
    svc, reads = fresh_service(service, open_step_rows=7)
    svc.ingest(parts(run_id, [0, 1], PARTS[0]))
    assert len(svc._open) == 6
    svc.ingest(parts(run_id, [0, 1], PARTS[1]))
    assert len(svc._open) == 6
    out = svc.ingest(parts(run_id, [0, 1], PARTS[2]))
    assert [(st, v) for _, st, v in out.audited] == [(0, "consistent"), (1, "inconsistent")]
    assert [st for _, st in reads] == [0] and len(svc._open) == 0


def test_a_step_the_sweep_audited_incomplete_is_re_audited_from_memory(service, run_id):
    """A step missing its last rank is audited incomplete by the sweep; the late report
    completes it and the re-audit uses the rows kept (they stay until then): consistent."""
    svc, reads = fresh_service(service)
    reps = parts(run_id, [0], slice(0, 8))
    svc.ingest(reps[:7], now=1000.0)
    assert svc.sweep(grace_seconds=1.0, now=1010.0) >= 1
    assert state(svc, run_id)["steps"][0]["verdict"] == "incomplete"
    assert len(reads) == 1 and len(svc._open) == 7  # the sweep read it back; the rows stay
    reads.clear()
    out = svc.ingest(reps[7:], now=1020.0)
    assert [v for _, _, v in out.audited] == ["consistent"] and reads == []
    step = state(svc, run_id)["steps"][0]
    assert (step["previous_verdict"], step["complete_at_audit"]) == ("incomplete", True)
