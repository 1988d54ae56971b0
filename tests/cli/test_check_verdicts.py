"""What `auditor check`, `auditor report`, `auditor runs` and `auditor audit --check` say of
incomplete runs, of runs with refused reports and of runs of unknown topology — against a
live service and straight against its database (SQLite and PostgreSQL)."""

from __future__ import annotations

import json

from factory import world_reports

from auditor import status
from auditor.testing.cli import run_auditor
from auditor.testing.wait import wait_until


auditor = run_auditor


def incomplete_run(live_server, run_id: str, steps: int = 6) -> None:
    """dp=2×cp=2, 6 steps, rank 1's reports never sent; the service's sweep (grace 2 s)
    audits every step incomplete."""
    for s in range(steps):
        r = live_server.post("/v1/reports", json={"reports": world_reports(run_id, step=s, skip_ranks=(1,))})
        assert r.status_code == 200, r.text
    wait_until(lambda: live_server.get(f"/v1/runs/{run_id}").json()["steps_audited"] == steps, what="the sweep")


def test_check_fails_an_incomplete_run_and_says_what_is_missing(live_server, run_id):
    """The new-user repro: check --min-steps 6 of a run missing rank 1 exits 1 naming 6 steps
    and rank 1 (was: "consistent (6 step(s) audited)", exit 0); --allow-incomplete passes;
    report's header says INCOMPLETE with the 0/0/0/6 table and no CP σ of 0; JSON status
    incomplete, consistent false; runs shows the status and the incomplete count."""
    run_id = f"incomplete-run-with-a-long-id-that-a-user-copies-{run_id[-8:]}"  # never cut in `auditor runs`
    incomplete_run(live_server, run_id)
    want = (f"{run_id}: INCOMPLETE — 6 step(s) audited with reports missing (advantages 6 of 6); rank 1 never "
            "reported: their values were never checked; pass --allow-incomplete for a run known to lose ranks")
    for source in (("--url", live_server.url), ("--database-url", live_server.database_url)):
        out = auditor("check", run_id, "--min-steps", "6", *source)
        assert (out.returncode, out.stdout.strip()) == (1, want), out.stderr
        out = auditor("check", run_id, "--min-steps", "6", "--allow-incomplete", *source)
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.startswith(f"{run_id}: incomplete, allowed by --allow-incomplete (6 step(s) audited)")
    data = json.loads(auditor("report", run_id, "--url", live_server.url, "--format", "json").stdout)
    (st,) = data["statistics"]
    assert (data["status"], data["consistent"], st["status"], st["steps_incomplete"]) == (
        "incomplete", False, "incomplete", 6)
    assert st["worst_cp_disagreement_sigma"] is None and st["cp_disagreement_sigma"] is None
    out = auditor("report", run_id, "--url", live_server.url)
    head = out.stdout.splitlines()[0]
    assert f"run {run_id}: INCOMPLETE" in head and "consistent" not in head, out.stdout
    assert "6 step(s) audited with reports missing" in out.stdout and "0/0/0/6 of 6" in out.stdout
    assert "0.000000" not in out.stdout and "missing_report ×6" in out.stdout
    out = auditor("runs", "--url", live_server.url)
    assert "incomplete" in out.stdout and "refused" in out.stdout  # the columns
    (line,) = [x for x in out.stdout.splitlines() if run_id in x]
    assert [c.strip() for c in line.split("│")[1:-1]] == [
        run_id, "INCOMPLETE", "—", "4", "2×2×1×1", "advantages", "6", "0", "0", "6", "0", "0"], out.stdout


def test_check_fails_a_reused_run_id(live_server, run_id):
    """`AUDITOR_RUN_ID=ci-rerun`: a correct 3-step run, then a buggy one under the same id.
    The service refuses the second (409 conflicting_report) and counts it; check exits 1
    saying so (was: "consistent", exit 0), --allow-refused passes; report says it too."""
    assert live_server.post("/v1/reports", json={"reports": [
        r for s in range(3) for r in world_reports(run_id, step=s)]}).status_code == 200
    r = live_server.post("/v1/reports", json={"reports": [
        r for s in range(3) for r in world_reports(run_id, step=s, scale=2.0)]})
    assert r.status_code == 409 and "conflicting_report" in r.text
    line = (f"{run_id}: REFUSED REPORTS — 12 report(s) conflicting with stored ones were refused, steps 0–2 "
            "(advantages 12; conflicting_report): the run id was reused or a rank re-sent different values; pass "
            "--allow-refused to accept that")
    for source in (("--url", live_server.url), ("--database-url", live_server.database_url)):
        out = auditor("check", run_id, *source)
        assert (out.returncode, out.stdout.splitlines()) == (1, [f"{run_id}: consistent (3 step(s) audited)", line])
        assert auditor("check", run_id, "--allow-refused", *source).returncode == 0
    data = json.loads(auditor("report", run_id, "--url", live_server.url, "--format", "json").stdout)
    assert (data["refused_reports"], data["statistics"][0]["refused_kind"]) == (12, "conflicting_report")
    out = auditor("report", run_id, "--url", live_server.url)
    assert "12 report(s) conflicting with stored ones were refused, steps 0–2" in " ".join(out.stdout.split())


def test_check_of_an_unknown_topology_fails_unverified_unless_allowed(live_server, run_id):
    """No topology and equal token counts (the values cannot prove the group): `check` exits 1
    with the UNVERIFIED line naming the three ways to set the layout, over HTTP and on the
    database; --allow-unverified exits 0; `report`, `runs`, the run page, the run list's
    filter and the Reader say unverified."""
    reports = [{"run_id": run_id, "statistic": "s", "step": 0, "rank": r, "world_size": 2, "topology": "unknown",
                "kind": "sum", "local": {"sum": 2.0}, "applied": {"sum": 4.0}, "group_ranks": [0, 1]}
               for r in range(2)]
    assert live_server.post("/v1/reports", json={"reports": reports}).status_code == 200
    for source in (("--url", live_server.url), ("--database-url", live_server.database_url)):
        out = auditor("check", run_id, *source)
        (line,) = out.stdout.splitlines()
        assert out.returncode == 1 and line.startswith(f"{run_id}: UNVERIFIED — 1 step(s) audited without a known")
        assert all(way in line for way in status.HOW_TO_VERIFY)
        assert auditor("check", run_id, "--allow-unverified", *source).returncode == 0
        assert auditor("check", run_id, "--allow-incomplete", "--allow-pending", *source).returncode == 1
    out = auditor("report", run_id, "--url", live_server.url)
    assert f"run {run_id}: UNVERIFIED" in out.stdout and "0/0/1/0 of 1" in out.stdout
    assert "UNVERIFIED" in auditor("runs", "--url", live_server.url).stdout
    page = live_server.get(f"/runs/{run_id}").text
    assert 'id="run-verdict">UNVERIFIED<' in page and 'id="run-unverified"' in page
    assert "AUDITOR_TOPOLOGY=dp=4,cp=2" in page and "set_device_mesh" in page
    assert run_id in live_server.get("/?status=unverified").text
    assert run_id not in live_server.get("/?status=consistent").text
    from auditor import Reader

    with Reader(live_server.url) as r:
        rep = r.report(run_id)
        assert (rep.status, rep.steps_unverified, rep.statistic("s").steps_unverified) == ("unverified", 1, 1)
        assert rep.check()[0] is False and rep.check(allow_unverified=True)[0] is True
        assert [x.run_id for x in r.runs(status="unverified") if x.run_id == run_id] == [run_id]


def test_audit_check_of_spools_missing_a_rank_exits_1(tmp_path, run_id):
    """`auditor audit DIR --check` of a dp=2×cp=2 run whose rank 1 file was deleted: the
    header says INCOMPLETE, JSON status incomplete, exit 1 with the line; --allow-incomplete
    exits 0."""
    spool = tmp_path / "spool"
    spool.mkdir()
    for rank in (0, 2, 3):  # rank1.jsonl deleted
        (spool / f"rank{rank}.jsonl").write_text("".join(
            json.dumps(r) + "\n" for s in range(6) for r in world_reports(run_id, step=s) if r["rank"] == rank))
    out = auditor("audit", str(spool), "--check")
    assert out.returncode == 1, out.stdout + out.stderr
    assert f"run {run_id}: INCOMPLETE" in out.stdout and "0/0/0/6 of 6" in out.stdout
    assert f"{run_id}: INCOMPLETE — 6 step(s) audited with reports missing (advantages 6 of 6); rank 1 never " \
           "reported" in out.stdout
    out = auditor("audit", str(spool), "--check", "--format", "json")
    (data,) = json.loads(out.stdout)
    assert (out.returncode, data["status"], data["consistent"]) == (1, "incomplete", False)
    assert "rank 1 never reported" in out.stderr
    assert auditor("audit", str(spool), "--check", "--allow-incomplete").returncode == 0


def test_check_fails_while_a_step_holds_reports_but_no_verdict(fresh_database_url, run_id):
    """The new-user trial's repro: step 0 of a dp=2×cp=2 run complete and correct, step 1
    with only ranks 0 and 1, whose values are wrong (each whitened with a DP-only group's
    statistic), not yet audited (no sweep ran). `check` said "consistent (1 step(s)
    audited)", exit 0; it now fails naming the step not audited yet, and --allow-pending
    (a check of a live run) passes with the line. Both name the ranks the step waits for
    (the service knows them; `check` hid them)."""
    from auditor.db.engine import ensure_schema, make_engine
    from auditor.contract.models import Report
    from auditor.service import Service

    engine = make_engine(fresh_database_url)
    ensure_schema(engine, fresh_database_url)
    svc = Service.from_engine(engine)
    try:
        wrong = world_reports(run_id, step=1, skip_ranks=(2, 3))
        for r in wrong:
            r["applied"] = {"mean": r["applied"]["mean"] + 0.3, "var": r["applied"]["var"] * 1.5}
        for batch in (world_reports(run_id, step=0), wrong):
            svc.ingest([Report.model_validate(r) for r in batch])
    finally:
        svc.close()
    out = auditor("check", run_id, "--database-url", fresh_database_url)
    assert out.returncode == 1, out.stdout + out.stderr
    assert out.stdout.splitlines() == [
        f"{run_id}: consistent (1 step(s) audited)",
        f"{run_id}: NOT AUDITED YET — advantages: 1 step(s) hold reports but no verdict (a rank has not reported, "
        "or its reports are still arriving; the service audits a step once every rank reported, or after "
        "AUDITOR_GRACE_SECONDS); check again later, or pass --allow-pending to check a live run",
        f"{run_id}: advantages step 1 has 2 of 4 report(s): ranks 2-3 not reported yet"]  # who it waits for
    out = auditor("check", run_id, "--database-url", fresh_database_url, "--allow-pending")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.splitlines()[1] == (f"{run_id}: not audited yet, allowed by --allow-pending — "
                                          "advantages: 1 step(s)")
