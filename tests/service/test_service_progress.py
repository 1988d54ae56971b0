"""Hang localisation text (``progress``) of a rank that never sent anything, on SQLite and
PostgreSQL: "rank 0 sent nothing" when it has no report of the run at all, "sent nothing
since before step N" when it reported before the window of the newest steps."""

from __future__ import annotations

import time

from auditor.contract.models import Report
from auditor.contract.reads import ProgressAt, StatisticReport
from auditor.service import PROGRESS_WINDOW


def _report(run: str, rank: int, step: int) -> Report:
    return Report.model_validate(
        {"run_id": run, "statistic": "loss_tokens", "step": step, "rank": rank, "world_size": 4,
         "coords": {"dp": rank}, "sizes": {"dp": 4}, "kind": "sum", "local": {"sum": 10.0 + rank},
         "applied": {"sum": 46.0}})


def _progress(service, run: str, steps: int, rank0_steps: range) -> StatisticReport:
    """Steps 0..steps-1 from ranks 1-3, and from rank 0 only ``rank0_steps``; then the sweep
    (grace 0) audits the incomplete steps."""
    for step in range(steps):
        service.ingest([_report(run, r, step) for r in range(4) if r or step in rank0_steps])
    service.sweep(grace_seconds=0.0, now=time.time() + 10)
    (stat,) = service.report(run).statistics
    assert stat.steps_incomplete == steps - len(rank0_steps)
    return stat


def test_a_rank_with_no_report_in_the_run_sent_nothing(service, run_id):
    """20 steps, rank 0's spool deleted (it never sent a report): "rank 0 sent nothing;
    ranks 1-3 at 19" (was "rank 0 sent nothing since before step 4"); 1 rank behind."""
    stat = _progress(service, run_id, 20, range(0))
    assert 20 - PROGRESS_WINDOW == 4
    assert stat.progress.summary == "rank 0 sent nothing; ranks 1-3 at 19"
    assert stat.progress.at == [ProgressAt(step=None, ranks="0"), ProgressAt(step=19, ranks="1-3")]
    assert stat.ranks_behind == 1


def test_a_rank_that_stopped_before_the_window_sent_nothing_since(service, run_id):
    """Rank 0 sent steps 0-2 and stopped: its last report is before the window of the newest
    16 steps (4-19): "rank 0 sent nothing since before step 4; ranks 1-3 at 19"."""
    stat = _progress(service, run_id, 20, range(3))
    assert stat.progress.summary == "rank 0 sent nothing since before step 4; ranks 1-3 at 19"
    assert stat.ranks_behind == 1
