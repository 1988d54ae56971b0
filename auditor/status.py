"""The one definition of a run's (and a statistic's) status, for every surface that shows it.

The report JSON (``status`` and the boolean ``consistent``), ``auditor report`` (table,
markdown, HTML), ``auditor check`` and ``auditor audit --check``, ``auditor runs``, the run
list and its ``?status=`` filter, the run page, :class:`auditor.Reader` and the pytest
plugin all decide "consistent" here, from the per-statistic step counts. Standard library
only: the pages and the read client (leaves) import it as well as the service and the store.

Status, worst first:

``inconsistent``
    some step is ``inconsistent`` or ``audit_error`` (the engine could not judge it: no
    evidence of consistency).
``unverified``
    no such step, but some step was audited without a layout that says which group each
    rank should have reduced over (topology unknown, and the values alone do not establish
    it: :mod:`auditor.core.layoutless`). Nothing wrong was found, and nothing proves the
    groups right: a reduction over the wrong process group would look the same.
``incomplete``
    no such step, but some step was audited while reports were missing (``missing_report``):
    the missing ranks' values were never checked; or every audited step is consistent but a
    trainer's client dropped reports of the statistic before sending them
    (``reports_dropped``, issue 24: its ring or queue was full): the audit has gaps.
``consistent``
    every audited step is consistent, and no report was dropped by a client.
``pending``
    no step audited yet (reports may still be arriving).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

#: Every status, worst first.
STATUSES = ("inconsistent", "unverified", "incomplete", "consistent", "pending")
#: The ``?status=`` values of ``GET /v1/runs`` and the run list.
FILTERS = STATUSES


def statistic_status(counts: Mapping[str, Any]) -> str:
    """The status of one statistic from its step counts (a ``series`` row or a statistic
    of the report JSON: ``steps_consistent``, ``steps_inconsistent``, ``steps_incomplete``,
    ``steps_audit_error``, ``steps_unverified``, and ``reports_dropped``: consistent steps
    with reports dropped by a client are ``incomplete``; a missing or null count is 0).
    Raises nothing."""
    def n(key: str) -> int:
        return int(counts.get(key) or 0)

    if n("steps_inconsistent") or n("steps_audit_error"):
        return "inconsistent"
    if n("steps_unverified"):
        return "unverified"
    if n("steps_incomplete"):
        return "incomplete"
    if n("steps_consistent"):
        return "incomplete" if n("reports_dropped") else "consistent"
    return "pending"


def combine(statuses: Iterable[str]) -> str:
    """The status of a run from its statistics' statuses: the worst of them, except that
    ``pending`` statistics do not hide the others' consistency (a run whose audited steps are
    all consistent is ``consistent``); ``pending`` when nothing was audited."""
    seen = set(statuses)
    for s in STATUSES:
        if s in seen:
            return s
    return "pending"


def run_status(statistics: Iterable[Mapping[str, Any]]) -> str:
    """The status of a run from its statistics' step counts (series rows or the report's
    ``statistics``): :func:`combine` of :func:`statistic_status`."""
    return combine(statistic_status(s) for s in statistics)


def is_consistent(status: str) -> bool:
    """The report's boolean ``consistent``: true only for status ``consistent``."""
    return status == "consistent"


def status_of(document: Mapping[str, Any]) -> str:
    """The status of a report, run summary or statistic JSON document: its ``status`` when
    the service sent one, else derived from its step counts (``statistics`` of a report, or
    the counts themselves) — for documents of services older than this field."""
    s = document.get("status")
    if isinstance(s, str) and s in STATUSES:
        return s
    if isinstance(document.get("statistics"), list) and document["statistics"] and isinstance(
            document["statistics"][0], Mapping):
        return run_status(document["statistics"])
    if "steps_consistent" in document:
        return statistic_status(document)
    return "consistent" if document.get("consistent") else "inconsistent"


def _ranks_text(ranks: Iterable[int]) -> str:
    """Sorted ranks as ranges: ``0,2-3``."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(parts)


def _span(lo: Any, hi: Any) -> str:
    """``step 6`` for one step, ``steps 0–2`` for a range."""
    return f"step {lo}" if lo == hi else f"steps {lo}–{hi}"


def incomplete_line(report: Mapping[str, Any]) -> str:
    """What is incomplete in a report, in one line: how many steps were audited with
    reports missing, per statistic, and which ranks' reports were missing (from the
    ``missing_report`` faults of the report's ``bad_steps``, which list up to its
    ``bad_steps`` limit of steps)."""
    parts, missing = [], set()
    total, cut = 0, False
    for s in report.get("statistics") or []:
        n = lost_steps(s)
        if not n:
            continue
        total += n
        parts.append(f"{s.get('statistic')} {n} of {s.get('steps_audited')}")
        for step in s.get("bad_steps") or []:
            for f in step.get("faults") or []:
                if f.get("kind") == "missing_report":
                    missing.update(f.get("ranks") or [])
                    cut = cut or bool(f.get("ranks_truncated"))  # a report lists up to 1,024 a fault
    more = " and more" if cut else ""
    who = f"rank{'s' if len(missing) != 1 or cut else ''} {_ranks_text(missing)}{more} never reported" if missing else (
        "the missing ranks are listed in the report's bad steps")
    return (f"{total} step(s) audited with reports missing ({', '.join(parts)}); {who}: their values were "
            "never checked")


def lost_steps(statistic: Mapping[str, Any]) -> int:
    """Steps of a statistic audited with reports missing: the incomplete ones, or more when
    steps of another verdict (``unverified``, ``inconsistent``) also had reports missing
    (one ``missing_report`` fault per such step)."""
    return max(int(statistic.get("steps_incomplete") or 0),
               int((statistic.get("faults") or {}).get("missing_report") or 0))


def reports_missing(report: Mapping[str, Any]) -> bool:
    """Whether some step of the report was audited with reports missing (:func:`lost_steps`)."""
    return any(lost_steps(s) for s in report.get("statistics") or [])


def refused_line(report: Mapping[str, Any]) -> str | None:
    """The refused-reports warning of a report (None if no report was refused): ``N
    reports conflicting with stored ones were refused, steps a–b: the run id was reused or a
    rank re-sent different values``, with the statistics and the last conflict kind."""
    stats = [s for s in report.get("statistics") or [] if s.get("refused_reports")]
    if not stats:
        return None
    n = sum(int(s["refused_reports"]) for s in stats)
    lo = min(s["refused_first_step"] for s in stats if s.get("refused_first_step") is not None)
    hi = max(s["refused_last_step"] for s in stats if s.get("refused_last_step") is not None)
    kinds = sorted({s.get("refused_kind") for s in stats if s.get("refused_kind")})
    names = ", ".join(f"{s['statistic']} {s['refused_reports']}" for s in stats)
    return (f"{n} report(s) conflicting with stored ones were refused, {_span(lo, hi)} ({names}; "
            f"{', '.join(kinds) or 'conflict'}): the run id was reused or a rank re-sent different values")


def dropped_line(report: Mapping[str, Any]) -> str | None:
    """The dropped-reports warning of a report (None if no client dropped any): ``N
    report(s) were dropped by the trainer's client before they were sent, steps a–b``, per
    statistic: those steps' audits have gaps (a rank's values were never checked)."""
    stats = [s for s in report.get("statistics") or [] if s.get("reports_dropped")]
    if not stats:
        return None
    n = sum(int(s["reports_dropped"]) for s in stats)
    lo = min(s["dropped_first_step"] for s in stats if s.get("dropped_first_step") is not None)
    hi = max(s["dropped_last_step"] for s in stats if s.get("dropped_last_step") is not None)
    names = ", ".join(f"{s['statistic']} {s['reports_dropped']}" for s in stats)
    return (f"{n} report(s) were dropped by the trainer's client before they were sent, {_span(lo, hi)} "
            f"({names}; its ring or queue was full: client stats['reports_dropped']): the audit of those steps "
            "has gaps, their values were never checked")


#: What to set so that the groups can be checked, one line per way (the run page, ``check``,
#: the pytest plugin and ``auditor report`` show these).
HOW_TO_VERIFY = (
    "Megatron-core: call parallel_state.initialize_model_parallel(...) before the first report "
    "(a stubbed megatron.core.mpu with get_context_parallel_world_size/rank and "
    "get_data_parallel_group(with_context_parallel=...) is read too)",
    "DeviceMesh (torchtitan, FSDP2): auditor.set_device_mesh(mesh) once on every rank",
    "anything else: AUDITOR_TOPOLOGY=dp=4,cp=2 (your job's sizes) on every rank, or auditor.set_topology(dp=4, cp=2)",
)


def unverified_line(report: Mapping[str, Any]) -> str:
    """Why a report is ``unverified``, in one line: how many steps per statistic; for the
    ``fingerprint`` statistics, that a replica group held one rank (no replica to compare
    with); for the others, where the layout came from (``topology_source``) and what to set
    (:data:`HOW_TO_VERIFY`)."""
    stats = [s for s in report.get("statistics") or [] if s.get("steps_unverified")]
    out = []
    for fingerprints in (True, False):
        part = [s for s in stats if (s.get("kind") == "fingerprint") == fingerprints]
        if part:
            out.append(_unverified_part(part, fingerprints, report.get("topology_source")))
    return "; ".join(out)


def _unverified_part(stats: list, fingerprints: bool, src: Any) -> str:
    parts = ", ".join(f"{s.get('statistic')} {int(s['steps_unverified'])} of {s.get('steps_audited')}" for s in stats)
    n = sum(int(s["steps_unverified"]) for s in stats)
    if fingerprints:
        return (f"{n} step(s) of fingerprint statistics ({parts}) audited with a replica group of one rank: the "
                "tensor had no replica to compare it with, so its drift was not checked (a world of one, or "
                "replica dims of size 1)")
    came = f"; layout source: {src}" if src else ""
    return (f"{n} step(s) audited without a known layout ({parts}{came}): no fault found, but which process group "
            "each rank should have reduced over is unknown, so a reduction over the wrong group (a CP or DP bug) "
            "cannot be told from a right one. To check it: " + "; ".join(HOW_TO_VERIFY))


def check(report: Mapping[str, Any], *, allow_incomplete: bool = False, allow_refused: bool = False,
          min_steps: int = 0, allow_pending: bool = False, allow_unverified: bool = False,
          allow_dropped: bool = False) -> tuple[bool, list[str]]:
    """The CI check of one run's report JSON (``auditor check``, ``auditor audit --check``,
    the pytest plugin): ``(passed, lines)``. Fails when the status is ``inconsistent``;
    ``incomplete`` (unless ``allow_incomplete``: runs known to lose ranks); some step has
    reports but no verdict yet (unless ``allow_pending``: a check of a live run), since
    the reports that did arrive may be wrong; reports were refused for contradicting stored
    ones (unless ``allow_refused``); a trainer's client dropped reports before sending them
    (unless ``allow_dropped``: the audit has gaps); ``unverified`` (unless ``allow_unverified``: a run
    known to have no layout, accepted as checked only against the groups its ranks reduced
    over); or fewer than ``min_steps`` steps were audited. ``lines`` say why, one per
    finding, the first naming the run and its status."""
    run_id = report.get("run_id")
    stats = report.get("statistics") or []
    state = status_of(report)
    audited = sum(int(s.get("steps_audited") or 0) for s in stats)
    lines: list[str] = []
    passed = _state_lines(report, state, audited, allow_incomplete, allow_unverified, lines)
    passed &= _pending_lines(run_id, stats, allow_pending, lines)
    for said, allowed, what in ((refused_line(report), allow_refused, "refused"),
                                (dropped_line(report), allow_dropped, "dropped")):
        if said is None:
            continue
        if allowed:
            lines.append(f"{run_id}: {said} (allowed by --allow-{what})")
        else:
            lines.append(f"{run_id}: {what.upper()} REPORTS — {said}; pass --allow-{what} to accept that")
            passed = False
    if audited < min_steps:
        lines.append(f"{run_id}: only {audited} step(s) audited, fewer than --min-steps {min_steps}")
        passed = False
    return passed, lines


def _state_lines(report: Mapping[str, Any], state: str, audited: int, allow_incomplete: bool,
                 allow_unverified: bool, lines: list[str]) -> bool:
    """Appends the lines of the run's status (inconsistent, unverified, incomplete, pending,
    consistent); False when that status fails the check."""
    run_id = report.get("run_id")
    stats = report.get("statistics") or []
    passed = True
    if state == "inconsistent":
        lines.extend(_inconsistent_lines(report))
        passed = False
    elif state == "unverified":
        if allow_unverified:
            lines.append(f"{run_id}: unverified, allowed by --allow-unverified ({audited} step(s) audited) — "
                         f"{unverified_line(report)}")
        else:
            lines.append(f"{run_id}: UNVERIFIED — {unverified_line(report)}; pass --allow-unverified to accept a "
                         "run checked only against the groups its ranks reduced over")
            passed = False
    if state in ("unverified", "incomplete") and any(lost_steps(s) for s in stats):
        if allow_incomplete:
            lines.append(f"{run_id}: incomplete, allowed by --allow-incomplete ({audited} step(s) audited) — "
                         f"{incomplete_line(report)}")
        else:
            lines.append(f"{run_id}: INCOMPLETE — {incomplete_line(report)}; pass --allow-incomplete for a run "
                         "known to lose ranks")
            passed = False
    if state == "pending":
        lines.append(f"{run_id}: no step audited yet (0 step(s) audited)")
    elif state == "consistent":
        lines.append(f"{run_id}: consistent ({audited} step(s) audited)")
    return passed


def _inconsistent_lines(report: Mapping[str, Any]) -> list[str]:
    """The lines of an inconsistent run: its faults per statistic, then whether it is also
    incomplete or unverified."""
    run_id = report.get("run_id")
    stats = report.get("statistics") or []
    bad = [s for s in stats if s.get("steps_inconsistent") or s.get("steps_audit_error")]
    detail = ", ".join(
        f"{s['statistic']}: {s.get('steps_inconsistent') or 0} step(s) "
        f"({', '.join(sorted(k for k in (s.get('faults') or {}) if k != 'missing_report'))})"
        + (f", {s['steps_audit_error']} step(s) the engine could not audit" if s.get("steps_audit_error") else "")
        for s in bad)
    lines = [f"{run_id}: INCONSISTENT — {detail}"]
    if any(lost_steps(s) for s in stats):
        lines.append(f"{run_id}: also incomplete — {incomplete_line(report)}")
    if any(s.get("steps_unverified") for s in stats):
        lines.append(f"{run_id}: also unverified — {unverified_line(report)}")
    return lines


def _pending_lines(run_id, stats: list, allow_pending: bool, lines: list[str]) -> bool:
    """Appends the line of the steps that hold reports but no verdict yet, if any; False
    when they fail the check (not ``allow_pending``)."""
    pending = {s["statistic"]: int(s.get("steps_pending") or 0) for s in stats if s.get("steps_pending")}
    if not pending:
        return True
    what = ", ".join(f"{name}: {n} step(s)" for name, n in pending.items())
    if allow_pending:
        lines.append(f"{run_id}: not audited yet, allowed by --allow-pending — {what}")
        return True
    lines.append(f"{run_id}: NOT AUDITED YET — {what} hold reports but no verdict (a rank has not "
                 "reported, or its reports are still arriving; the service audits a step once every "
                 "rank reported, or after AUDITOR_GRACE_SECONDS); check again later, or pass "
                 "--allow-pending to check a live run")
    return False
