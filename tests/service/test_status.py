"""One status for a run and a statistic (auditor.status), on SQLite and PostgreSQL: runs
whose steps were audited with reports missing are ``incomplete``, never "consistent"; reports
a 409 refused for contradicting stored ones are counted per series and fail the check; a run
of unknown topology is ``unverified`` unless its values prove its groups; a new run's batch that disagrees with itself is worded
as such."""

from __future__ import annotations

import logging
import time

import pytest
from factory import world_reports

from auditor import status
from auditor.contract.models import Report
from auditor.service import ConflictError, NotFound


def batch(run_id: str, steps=range(1), **kw) -> list[Report]:
    return [Report.model_validate(r) for s in steps for r in world_reports(run_id, step=s, **kw)]


def test_a_run_missing_a_rank_is_incomplete_everywhere(service, run_id):
    """dp=2×cp=2, rank 1's reports never arrive, 6 steps swept: status incomplete (not
    consistent) in the report, the statistic and the run summary; the ?status= filters put it
    under incomplete only; the check fails naming 6 steps and rank 1, and passes with
    allow_incomplete; no CP σ is shown (a CP peer is missing), not 0."""
    for s in range(6):
        service.ingest(batch(run_id, [s], skip_ranks=(1,)))
    assert service.sweep(grace_seconds=0.0, now=time.time() + 1) >= 6
    rep = service.report(run_id)
    (st,) = rep.statistics
    assert (rep.status, rep.consistent, st.status) == ("incomplete", False, "incomplete")
    assert (st.steps_consistent, st.steps_inconsistent, st.steps_incomplete) == (0, 0, 6)
    assert st.faults == {"missing_report": 6}
    assert (st.cp_disagreement_sigma, st.worst_cp_disagreement_sigma, st.worst_cp_disagreement_step) == (
        None, None, None)
    assert [d.cp_disagreement_sigma for d in st.bad_steps] == [None] * 6
    assert [s.cp_disagreement_sigma for s in service.steps(run_id, "advantages")[0].steps] == [None] * 6
    run = service.get_run(run_id)
    assert (run.status, run.consistent, run.steps_incomplete, run.refused_reports) == (
        "incomplete", False, 6, 0)
    assert run_id in {r.run_id for r in service.list_runs("incomplete")}
    for other in ("consistent", "inconsistent", "pending"):
        assert run_id not in {r.run_id for r in service.list_runs(other)}, other
    passed, lines = rep.check(min_steps=6)
    assert passed is False
    assert lines == [f"{run_id}: INCOMPLETE — 6 step(s) audited with reports missing (advantages 6 of 6); rank 1 "
                     "never reported: their values were never checked; pass --allow-incomplete for a run known to "
                     "lose ranks"]
    passed, lines = rep.check(allow_incomplete=True, min_steps=6)
    assert passed is True and lines[0].startswith(f"{run_id}: incomplete, allowed by --allow-incomplete (6 step(s)")


def test_statuses_order_inconsistent_over_incomplete_over_consistent(service, run_id):
    """A consistent step plus an incomplete one: incomplete; plus an inconsistent one:
    inconsistent (the boolean false both times); only consistent steps: consistent; nothing
    audited yet: pending."""
    open_, ok, inc = f"{run_id}-open", f"{run_id}-ok", f"{run_id}-inc"
    service.ingest(batch(open_, skip_ranks=(3,)))
    assert (service.report(open_).status, service.report(open_).consistent) == ("pending", False)
    assert open_ in {r.run_id for r in service.list_runs("pending")}
    service.ingest(batch(ok, range(2)))
    assert (service.report(ok).status, service.report(ok).consistent) == ("consistent", True)
    assert ok in {r.run_id for r in service.list_runs("consistent")}
    service.ingest(batch(inc, [0]))
    service.ingest(batch(inc, [1], skip_ranks=(2,)))
    service.sweep(grace_seconds=0.0, now=time.time() + 1)
    (st,) = service.report(inc).statistics
    assert (service.report(inc).status, st.status, st.last_audited_step) == ("incomplete", "incomplete", 1)
    # the latest CP σ would be step 1's (a CP peer missing): none; the worst is step 0's, complete
    assert (st.cp_disagreement_sigma, st.worst_cp_disagreement_step) == (None, 0)
    assert st.worst_cp_disagreement_sigma is not None
    wrong = world_reports(inc, step=2)
    wrong[0]["applied"] = dict(wrong[0]["applied"], mean=wrong[0]["applied"]["mean"] + 0.5)
    service.ingest([Report.model_validate(r) for r in wrong])
    rep = service.report(inc)
    assert (rep.status, rep.consistent, rep.statistics[0].steps_inconsistent) == ("inconsistent", False, 1)
    assert inc in {r.run_id for r in service.list_runs("inconsistent")}
    assert inc not in {r.run_id for r in service.list_runs("incomplete")}


def test_a_reused_run_id_is_counted_and_fails_the_check(service, run_id):
    """`AUDITOR_RUN_ID=ci-rerun`: a correct 3-step run, then a buggy 3-step run under the same
    id. Every report of the second is refused (409 conflicting_report) and nothing of it is
    stored; the series counts the 12 refused reports, steps 0–2, so the report says so and
    the check fails (unless allow_refused) although the stored steps are consistent."""
    service.ingest(batch(run_id, range(3)))
    t0 = time.time()
    with pytest.raises(ConflictError) as e:
        service.ingest(batch(run_id, range(3), scale=2.0))
    assert e.value.error == "conflicting_report" and len(e.value.conflicts) == 12
    rep = service.report(run_id)
    (st,) = rep.statistics
    assert (st.steps_audited, st.steps_consistent, rep.status) == (3, 3, "consistent")
    assert (st.refused_reports, st.refused_first_step, st.refused_last_step, st.refused_kind) == (
        12, 0, 2, "conflicting_report")
    assert st.refused_at >= t0 and rep.refused_reports == 12
    assert service.get_run(run_id).refused_reports == 12
    passed, lines = rep.check()
    assert passed is False and lines == [
        f"{run_id}: consistent (3 step(s) audited)",
        f"{run_id}: REFUSED REPORTS — 12 report(s) conflicting with stored ones were refused, steps 0–2 (advantages "
        "12; conflicting_report): the run id was reused or a rank re-sent different values; pass --allow-refused to "
        "accept that"]
    assert rep.check(allow_refused=True)[0] is True
    # a later refusal of one step widens nothing and adds one
    with pytest.raises(ConflictError):
        service.ingest(batch(run_id, [1], scale=3.0)[:1])
    st = service.report(run_id).statistics[0]
    assert (st.refused_reports, st.refused_first_step, st.refused_last_step) == (13, 0, 2)
    # a batch contradicting only itself contradicts nothing stored: not counted
    twice = batch(run_id, [5])
    with pytest.raises(ConflictError) as e:
        service.ingest(twice + batch(run_id, [5], scale=2.0)[:1])
    assert "nothing of this batch was stored" in e.value.message
    assert service.report(run_id).statistics[0].refused_reports == 13


def test_counting_refusals_never_turns_the_409_into_a_500(service, run_id, monkeypatch, caplog):
    """If the count cannot be written, the ConflictError (409) is raised all the same and the
    failure is logged."""
    service.ingest(batch(run_id))

    def broken(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(service.store, "record_refused", broken)
    with caplog.at_level(logging.ERROR, logger="auditor.service"):
        with pytest.raises(ConflictError) as e:
            service.ingest(batch(run_id, scale=2.0))
    assert e.value.error == "conflicting_report"
    assert "could not count the reports refused by a conflicting_report" in caplog.text
    monkeypatch.undo()
    assert service.report(run_id).statistics[0].refused_reports == 0


def test_topology_and_spec_conflicts_count_against_an_existing_series(service, run_id):
    """A batch of another topology (then of another spec) for a stored run: every report of
    it is counted (kind topology_conflict, spec_conflict) against the series that exists."""
    service.ingest(batch(run_id))
    other = [Report.model_validate(r) for r in world_reports(run_id, step=1, dp=4)]
    with pytest.raises(ConflictError) as e:
        service.ingest(other)
    assert e.value.error == "topology_conflict" and "was registered with" in e.value.message
    assert "nothing of this batch was stored" in e.value.message
    st = service.report(run_id).statistics[0]
    assert (st.refused_reports, st.refused_first_step, st.refused_last_step, st.refused_kind) == (
        8, 1, 1, "topology_conflict")
    respec = [Report.model_validate(dict(r, spec={"reduce_over": ["dp"]})) for r in world_reports(run_id, step=2)]
    with pytest.raises(ConflictError) as e:
        service.ingest(respec)
    assert e.value.error == "spec_conflict"
    st = service.report(run_id).statistics[0]
    assert (st.refused_reports, st.refused_first_step, st.refused_last_step, st.refused_kind) == (
        12, 1, 2, "spec_conflict")


def test_a_new_runs_batch_mixing_topologies_says_the_batch_disagrees(service, run_id):
    """The first batch of run t5z mixes dp=2 and dp=4 reports: the 409 says the batch's own
    reports disagree (nothing was registered: the run stays unknown) and that nothing of the
    batch was stored."""
    mixed = batch(run_id) + [Report.model_validate(r) for r in world_reports(run_id, step=1, dp=4)]
    with pytest.raises(ConflictError) as e:
        service.ingest(mixed)
    assert e.value.error == "topology_conflict"
    assert e.value.message == (
        f"reports[0] and reports[4] of this batch disagree on the topology of the new run {run_id!r}: "
        "{'world_size': 4, 'sizes': {'dp': 2, 'cp': 2, 'tp': 1, 'pp': 1}} against {'world_size': 8, 'sizes': "
        "{'dp': 4, 'cp': 2, 'tp': 1, 'pp': 1}}; every report of a run must give the same topology (world_size, "
        "sizes, order, topology); nothing of this batch was stored")
    assert e.value.conflicts == [{"index": 4, "field": "sizes", "other_index": 0}]
    with pytest.raises(NotFound):
        service.get_run(run_id)


def unknown(run_id: str, locals_, applied_, step: int = 0, ranks=None) -> list[Report]:
    """A token-count (``sum``) step of a 2-rank run that declared no topology."""
    return [Report.model_validate({
        "run_id": run_id, "statistic": "s", "step": step, "rank": r, "world_size": 2, "topology": "unknown",
        "kind": "sum", "local": {"sum": locals_[r]}, "applied": {"sum": applied_[r]}, "group_ranks": [0, 1]})
        for r in (ranks if ranks is not None else range(2))]


def test_unknown_topology_is_unverified_everywhere_unless_the_values_prove_the_group(service, run_id):
    """No topology. Ranks with different token counts (1, 2) both dividing by 3: the data
    prove they are not replicas and had to reduce together — consistent, the check passes
    with one line. Ranks with equal counts (2, 2) both dividing by 4: replicas or not, the
    values cannot say — unverified in the report, the statistic, the run summary and the
    ?status= filter (ranked over incomplete, under inconsistent); the check fails naming the
    steps and the three ways to set the layout, and passes with allow_unverified only."""
    proven, blind = f"{run_id}-proven", f"{run_id}-blind"
    service.ingest(unknown(proven, (1.0, 2.0), (3.0, 3.0)))
    rep = service.report(proven)
    assert (rep.status, rep.consistent, rep.steps_unverified) == ("consistent", True, 0)
    assert rep.check() == (True, [f"{proven}: consistent (1 step(s) audited)"])

    service.ingest(unknown(blind, (2.0, 2.0), (4.0, 4.0)))
    rep = service.report(blind)
    (st,) = rep.statistics
    assert (rep.status, rep.consistent, st.status, st.steps_unverified) == (
        "unverified", False, "unverified", 1)
    assert service.get_run(blind).status == "unverified"
    assert blind in {r.run_id for r in service.list_runs("unverified")}
    assert blind not in {r.run_id for r in service.list_runs("consistent")}
    passed, lines = rep.check()
    assert passed is False and lines[0].startswith(f"{blind}: UNVERIFIED — 1 step(s) audited without a known layout")
    assert all(way in lines[0] for way in status.HOW_TO_VERIFY) and "--allow-unverified" in lines[0]
    assert rep.check(allow_incomplete=True, allow_pending=True, allow_refused=True)[0] is False
    assert rep.check(allow_unverified=True)[0] is True

    # rank 1 of step 1 never reports: unverified (not incomplete: --allow-incomplete must not pass it)
    service.ingest(unknown(blind, (2.0, 2.0), (4.0, 4.0), step=1, ranks=[0]))
    service.sweep(grace_seconds=0.0, now=time.time() + 1)
    rep = service.report(blind)
    assert (rep.status, rep.statistics[0].steps_unverified) == ("unverified", 2)
    assert rep.check(allow_incomplete=True)[0] is False
    # a lost rank needs its own flag too, and is named: --allow-unverified alone does not pass it
    passed, lines = rep.check(allow_unverified=True)
    assert passed is False and lines[1] == (
        f"{blind}: INCOMPLETE — 1 step(s) audited with reports missing (s 1 of 2); rank 1 never reported: their "
        "values were never checked; pass --allow-incomplete for a run known to lose ranks")
    assert rep.check(allow_unverified=True, allow_incomplete=True)[0] is True

    # a fault outranks it: ranks with equal counts dividing by different denominators
    service.ingest(unknown(blind, (2.0, 2.0), (4.0, 2.0), step=2))
    rep = service.report(blind)
    assert rep.status == "inconsistent" and rep.statistics[0].faults["group_mismatch"] >= 1
    passed, lines = rep.check()
    assert passed is False and [x.split(" — ")[0] for x in lines[1:]] == [f"{blind}: also incomplete",
                                                                       f"{blind}: also unverified"]
