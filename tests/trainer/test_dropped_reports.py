"""Issue 24: a report the client drops at hand-over (its ring full) reaches the service as a
count: the next report of the series it delivers carries ``dropped`` (count, first and last
step), the service counts it once on the series, and the run's audit is never "consistent"
for it — report JSON, ``auditor check`` (fails unless ``--allow-dropped``), the run page,
the Reader and ``/metrics`` say so. A real client, real gloo process, real server, SQLite
and PostgreSQL (the ``live_server`` fixture's backends)."""

from __future__ import annotations

import contextlib
import json
import re

import pytest

from auditor.testing.cli import run_auditor
from auditor.testing.http import assert_problem, only_series, post_reports, post_reports_ok
from auditor.testing.wait import wait_until
from auditor.testing.world import spawn_world
from auditor.trainer.handover import Gaps


def test_gaps_sum_per_series_and_ride_on_the_next_report_once():
    """Drops of one series are summed (count, the lowest and highest step); the next report
    of that series carries them once; another series' report carries nothing; a report that
    names no run, statistic and step cannot be told."""
    gaps = Gaps()
    for step in (7, 3, 5):
        assert gaps.add({"run_id": "r", "statistic": "adv", "step": step})
    assert not gaps.add({"v": 1}) and not gaps.add(None) and not gaps.add({"run_id": "r", "statistic": "a", "step": 1.0})
    other = {"run_id": "r", "statistic": "loss", "step": 9}
    assert gaps.attach(other) is other
    told = gaps.attach({"run_id": "r", "statistic": "adv", "step": 8})
    assert told["dropped"] == {"count": 3, "first_step": 3, "last_step": 7} and told["step"] == 8
    again = {"run_id": "r", "statistic": "adv", "step": 9}
    assert gaps.attach(again) is again and not gaps.pending


def _starved_worker(rank: int, world: int, port: int, url: str, run_id: str) -> dict:
    import os

    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import distributed_masked_whiten

    os.environ["AUDITOR_TOPOLOGY"] = "dp=1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    client = AuditorClient(url, rank=rank, spool=False, ring_size=1)
    values, mask = torch.tensor([1.5, -0.5, -1.0, 2.0]), torch.ones(4)

    def whiten(step: int) -> None:
        distributed_masked_whiten(values + step, mask, client=client, run_id=run_id, step=step)

    # one ring slot and a starved sender (it reads slots under the lock the test holds):
    # step 0 takes the slot, steps 1-3 find the ring full and are dropped
    with client._ring.resolve_lock:
        for step in range(4):
            whiten(step)
    for step in (4, 5):
        assert client.flush(timeout=30)
        whiten(step)
    assert client.flush(timeout=30)
    client.close()
    dist.destroy_process_group()
    return dict(client.stats)


@pytest.mark.multiprocess
def test_dropped_reports_reach_the_service_and_the_run_is_not_consistent(live_server, run_id):
    """One rank (so the dropped steps leave no incomplete step behind: without the count the
    run would read consistent) reports steps 0-5 through a one-slot ring; 1-3 are dropped.
    The service stores steps 0, 4, 5 consistent and the series' 3 dropped reports, steps
    1-3; the run's status is incomplete, check fails naming them (passes with
    --allow-dropped), the page, the Reader and /metrics show the count."""
    (stats,) = spawn_world(_starved_worker, 1, (live_server.url, run_id), 120.0)
    assert (stats["sent"], stats["reports_dropped"], stats["dropped"]) == (3, 3, 3)
    wait_until(lambda: live_server.get(f"/v1/runs/{run_id}").json()["steps_audited"] == 3, what="the audit")
    report = live_server.get(f"/v1/runs/{run_id}/report").json()
    (st,) = report["statistics"]
    assert (st["steps_consistent"], st["steps_incomplete"], st["steps_pending"]) == (3, 0, 0)
    assert (st["reports_dropped"], st["dropped_first_step"], st["dropped_last_step"]) == (3, 1, 3)
    assert (st["status"], report["status"], report["consistent"], report["reports_dropped"]) == (
        "incomplete", "incomplete", False, 3)
    run = live_server.get(f"/v1/runs/{run_id}").json()
    assert (run["status"], run["reports_dropped"]) == ("incomplete", 3)
    listed = live_server.get("/v1/runs", params={"status": "incomplete", "limit": 200}).json()["runs"]
    assert run_id in {r["run_id"] for r in listed}
    assert run_id not in {r["run_id"] for r in live_server.get(
        "/v1/runs", params={"status": "consistent", "limit": 200}).json()["runs"]}

    want = (f"{run_id}: DROPPED REPORTS — 3 report(s) were dropped by the trainer's client before they were sent, "
            "steps 1–3 (advantages 3; its ring or queue was full: client stats['reports_dropped']): the audit of "
            "those steps has gaps, their values were never checked; pass --allow-dropped to accept that")
    for source in (("--url", live_server.url), ("--database-url", live_server.database_url)):
        out = run_auditor("check", run_id, *source)
        assert out.returncode == 1 and want in out.stdout.splitlines(), out.stdout + out.stderr
        out = run_auditor("check", run_id, "--allow-dropped", *source)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "(allowed by --allow-dropped)" in out.stdout
    out = run_auditor("report", run_id, "--url", live_server.url)
    assert "INCOMPLETE" in out.stdout.splitlines()[0] and "gaps: 3 report(s) were dropped" in out.stdout, out.stdout

    from auditor import Reader

    with Reader(live_server.url) as r:
        doc = r.report(run_id)
        assert (doc.reports_dropped, doc.status, doc.consistent) == (3, "incomplete", False)
        adv = doc.statistic("advantages")
        assert (adv.reports_dropped, adv.dropped_first_step, adv.dropped_last_step) == (3, 1, 3)
        assert doc.check()[0] is False and doc.check(allow_dropped=True)[0] is True

    page = live_server.get(f"/runs/{run_id}").text
    assert 'id="run-dropped"' in page and "3 report(s) were dropped" in page
    metrics = live_server.get("/metrics").text
    line = re.search(rf'^auditor_reports_dropped_total\{{run="{re.escape(run_id)}",statistic="advantages"\}} (\S+)$',
                     metrics, re.M)
    assert line is not None and float(line.group(1)) == 3.0


@pytest.mark.multiprocess
def test_a_resent_report_does_not_count_its_drops_twice(live_server, run_id):
    """The same report carrying ``dropped`` sent twice (a retry after a lost answer): the
    second is a duplicate and its drops are not counted again; first_step > last_step is a
    422 naming the field."""
    from factory import world_reports

    (rep,) = world_reports(run_id, step=4, dp=1, cp=1)
    rep["dropped"] = {"count": 2, "first_step": 2, "last_step": 3}
    for expect in ((1, 0), (0, 1)):
        r = live_server.post("/v1/reports", json={"reports": [rep]})
        assert r.status_code == 200 and (r.json()["accepted"], r.json()["duplicates"]) == expect, r.text
    (st,) = live_server.get(f"/v1/runs/{run_id}/report").json()["statistics"]
    assert (st["reports_dropped"], st["dropped_first_step"], st["dropped_last_step"]) == (2, 2, 3)
    bad = {**rep, "step": 5, "dropped": {"count": 1, "first_step": 4, "last_step": 1}}
    r = live_server.post("/v1/reports", json={"reports": [bad]})
    assert r.status_code == 422 and "reports[0].dropped.first_step" in json.dumps(r.json()), r.text


def test_spooled_reports_carry_the_drops_and_an_offline_audit_fails_on_them(tmp_path):
    """File-only client, one ring slot, a starved spill thread: steps 1-2 are dropped, the
    spooled step-3 report carries ``dropped`` {2, 1, 2}; ``auditor audit --check`` of the
    spool stores it and fails naming the dropped reports (passes with --allow-dropped)."""
    import torch
    from factory import world_reports

    from auditor.trainer.client import AuditorClient

    spool = tmp_path / "spool"
    client = AuditorClient(f"file://{spool}", rank=0, ring_size=1)

    def report(step: int) -> None:
        (body,) = world_reports("offline-gaps", step=step, dp=1, cp=1)
        client.report_deferred(torch.zeros(1, dtype=torch.float64), lambda v, b=body: b, body)

    with client._ring.resolve_lock:
        for step in range(3):
            report(step)
    assert client.flush(timeout=30)
    report(3)
    assert client.flush(timeout=30)
    client.close()
    (f,) = spool.glob("*.jsonl")
    lines = [json.loads(x) for x in f.read_text().splitlines()]
    assert [(r["step"], r.get("dropped")) for r in lines] == [
        (0, {"count": 2, "first_step": 1, "last_step": 2}), (3, None)]  # the slot's report was built after the drops
    out = run_auditor("audit", str(spool), "--check")
    assert out.returncode == 1 and "DROPPED REPORTS — 2 report(s)" in out.stdout + out.stderr, out.stdout + out.stderr
    out = run_auditor("audit", str(spool), "--check", "--allow-dropped")
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_resent_report_with_a_grown_tally_counts_the_growth(live_server, run_id):
    """The client's tally only grows (``Gaps.attach`` adds the drops it still has to tell to
    a report it sends again): a re-send of a stored report whose ``dropped`` grew (2 → 5,
    steps 2-3 → 1-3) was a duplicate and its 3 new drops were lost. It stays a duplicate of
    the values and the growth is counted (5 in all, steps 1-3); the same tally again counts
    nothing; a lower count, other steps at the same count, or no tally where one was stored
    contradict it: 409 conflicting_report naming the dropped fields, the stored one stays,
    and the refusal is counted on the series. Two copies of the report in one batch keep the
    higher tally."""
    from factory import world_reports

    (rep,) = world_reports(run_id, step=4, dp=1, cp=1)
    first = {**rep, "dropped": {"count": 2, "first_step": 2, "last_step": 3}}
    grown = {**rep, "dropped": {"count": 5, "first_step": 1, "last_step": 3}}
    assert post_reports_ok(live_server, [first])["accepted"] == 1
    for again in (grown, grown):
        out = post_reports_ok(live_server, [again])
        assert (out["accepted"], out["duplicates"]) == (0, 1)
        st = only_series(live_server, run_id)
        assert (st["reports_dropped"], st["dropped_first_step"], st["dropped_last_step"]) == (5, 1, 3)
    for told, fields in (({"count": 4, "first_step": 1, "last_step": 3}, ["dropped.count"]),
                         ({"count": 5, "first_step": 2, "last_step": 4}, ["dropped.first_step", "dropped.last_step"]),
                         ({"count": 6, "first_step": 2, "last_step": 3}, ["dropped.count", "dropped.first_step"]),
                         (None, ["dropped.count", "dropped.first_step", "dropped.last_step"])):
        body = assert_problem(post_reports(live_server, [{**rep, "dropped": told}] if told else [rep]), 409,
                              "conflicting_report")
        assert [c["fields"] for c in body["conflicts"]] == [fields], body
        assert "where the stored report says {count: 5, first_step: 1, last_step: 3}" in body["detail"], body
    st = only_series(live_server, run_id)
    assert (st["reports_dropped"], st["refused_reports"], st["refused_kind"]) == (5, 4, "conflicting_report")
    # in one batch: the higher copy wins, whichever comes first; copies that contradict are a 409
    (nxt,) = world_reports(run_id, step=5, dp=1, cp=1)
    low, high = ({**nxt, "dropped": {"count": n, "first_step": 0, "last_step": n}} for n in (1, 2))
    assert post_reports_ok(live_server, [high, low])["duplicates"] == 1
    assert post_reports_ok(live_server, [low, high])["duplicates"] == 2
    st = only_series(live_server, run_id)
    assert (st["reports_dropped"], st["dropped_first_step"], st["dropped_last_step"]) == (7, 0, 3)
    odd = {**nxt, "step": 6, "dropped": {"count": 2, "first_step": 1, "last_step": 1}}
    body = assert_problem(post_reports(live_server, [{**odd, "dropped": {"count": 1, "first_step": 0, "last_step": 0}},
                                                     odd]), 409, "conflicting_report")
    assert "reports[0]" in body["detail"] and body["conflicts"][0]["index"] == 1, body


def test_the_drops_are_counted_in_the_ingest_transaction(service, run_id, monkeypatch):
    """The count was written in a transaction of its own after the ingest's commit: a crash
    between the two (here: every write transaction after the first fails) stored the report
    and lost its drops. The ingest is one transaction: both or neither, on either database;
    a re-send's growth likewise."""
    from factory import world_reports

    from auditor.contract.models import Report

    (rep,) = world_reports(run_id, step=4, dp=1, cp=1)
    real, committed = service.store.write, []

    @contextlib.contextmanager
    def write_once():
        """A write transaction, unless one committed already (a failed attempt's rollback
        is no commit: the ingest retries a re-send row by row)."""
        if committed:
            raise RuntimeError("the process died after the ingest's commit")
        with real() as conn:
            yield conn
        committed.append(1)

    monkeypatch.setattr(service.store, "write", write_once)
    told = Report.model_validate({**rep, "dropped": {"count": 2, "first_step": 2, "last_step": 3}})
    assert service.ingest([told]).accepted == 1
    monkeypatch.undo()
    st = service.report(run_id).statistics[0]
    assert (st.reports_dropped, st.dropped_first_step, st.dropped_last_step) == (2, 2, 3)
    committed.clear()
    monkeypatch.setattr(service.store, "write", write_once)
    grown = Report.model_validate({**rep, "dropped": {"count": 3, "first_step": 1, "last_step": 3}})
    assert service.ingest([grown]).duplicates == 1
    monkeypatch.undo()
    st = service.report(run_id).statistics[0]
    assert (st.reports_dropped, st.dropped_first_step, st.dropped_last_step) == (3, 1, 3)


def test_counts_at_the_wire_s_bound_saturate_the_series_count(live_server, run_id):
    """Every rank may tell up to 2**62 drops (the wire's bound on ``dropped.count``): two
    ranks, each at the bound, first in one batch and then in two, are stored (200, not a
    500 "bigint out of range" on PostgreSQL) and the series count saturates at 2**62 (on
    SQLite the sum became a float that broke every read of the run list); the run list,
    the report and ``auditor runs`` still read."""
    from factory import world_reports

    from auditor.db.drops import MAX_DROPPED
    from auditor.contract.fields import MAX_STEP

    assert MAX_DROPPED == MAX_STEP == 2**62
    most = {"count": 2**62, "first_step": 0, "last_step": 2}
    batches = [world_reports(run_id, step=4, dp=2, cp=1), *([r] for r in world_reports(run_id, step=5, dp=2, cp=1))]
    for batch in batches:
        post_reports_ok(live_server, [{**r, "dropped": most} for r in batch])
    st = only_series(live_server, run_id)
    assert (st["reports_dropped"], st["dropped_first_step"], st["dropped_last_step"]) == (2**62, 0, 2)
    runs = live_server.get("/v1/runs", params={"limit": 1000}).json()["runs"]
    assert [r["reports_dropped"] for r in runs if r["run_id"] == run_id] == [2**62]
    out = run_auditor("runs", "--url", live_server.url)
    assert out.returncode == 0, out.stderr
