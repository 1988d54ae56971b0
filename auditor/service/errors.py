"""The service's errors and all their wording: conflicts (HTTP 409), limits (422), unknown
runs (404), contention (503), and the retry signal of a stale cache.

Every 409 says what was stored, what the batch said, and that nothing of the batch was
stored; ``conflicts`` lists ``{"index": i, "fields": [wire names], ...}`` per offending
report, so a client can point at the report and field.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Sequence

from auditor.core import DIMS
from auditor.db.rows import COLUMNS, COMPARED
from auditor.contract.models import Report

if TYPE_CHECKING:
    from auditor.contract.models import StatisticSpec
    from auditor.db.store import Store
    from auditor.service.model import SeriesInfo, Topology


class ConflictError(Exception):
    """A batch contradicts what is stored (HTTP 409); nothing of the batch was stored.

    ``error`` is ``conflicting_report``, ``coordinate_conflict``, ``topology_conflict``,
    ``spec_conflict``, ``workload_conflict`` or ``placement_conflict``; ``conflicts`` lists ``{"index": i, "fields": [wire names], ...}`` per
    offending report.
    """

    def __init__(self, error: str, message: str, conflicts: list[dict], against_stored: bool = True):
        super().__init__(message)
        self.error, self.message, self.conflicts = error, message, conflicts
        #: False when the batch contradicts only itself (two of its reports, or a placement):
        #: nothing stored was contradicted, so the refusal is not counted against a series
        self.against_stored = against_stored


class NotFound(Exception):
    """No such run, statistic or step (HTTP 404)."""


class LimitError(Exception):
    """A request would take the service past a configured limit (HTTP 422); nothing was
    stored. ``field`` is the wire field (``reports[3].statistic``, ``statistics.NAME``)."""

    def __init__(self, field: str, loc: list, message: str):
        super().__init__(message)
        self.field, self.loc, self.message = field, loc, message


class Contended(Exception):
    """A write kept meeting concurrent deletions of the runs it touches; nothing of it was
    stored (the API answers 503 with Retry-After)."""


class StaleCaches(Exception):
    """A run this process has cached was deleted (and maybe created anew) by another
    process: the ingest drops its caches and tries the batch once more
    (:data:`auditor.service.ingest.RETRY`)."""


def contended_ingest(attempts: int) -> Contended:
    """503: a batch met concurrent deletions of its runs ``attempts`` times."""
    return Contended(f"the runs of this batch were deleted and created anew {attempts} times "
                     "while it was stored; nothing of it was stored")


def contended_registration(run_id: str, attempts: int) -> Contended:
    """503: a registration met concurrent deletions of its run ``attempts`` times."""
    return Contended(f"run {run_id!r} was deleted {attempts} times while it was registered; nothing was stored")


def topology_conflict(run_id: str, stored: "Topology", topo: "Topology", index: int | None,
                      first: int | None) -> ConflictError:
    """409 ``topology_conflict``: run ``run_id`` is stored (or, ``first``: was created by
    report ``first`` of this batch) with topology ``stored``; report ``index`` says ``topo``."""
    field_ = "topology" if stored.known != topo.known else "order" if stored.order != topo.order else "sizes"
    where = [{"index": index, "field": field_}] if index is not None else []
    if first is not None:
        return ConflictError(
            "topology_conflict",
            f"reports[{first}] and reports[{index}] of this batch disagree on the topology of the new run "
            f"{run_id!r}: {stored.describe()} against {topo.describe()}; every report of a run must give "
            "the same topology (world_size, sizes, order, topology); nothing of this batch was stored",
            [{**w, "other_index": first} for w in where], against_stored=False,
        )
    return ConflictError(
        "topology_conflict",
        f"run {run_id!r} was registered with {stored.describe()}; this report says {topo.describe()}; "
        "nothing of this batch was stored",
        where,
    )


def workload_conflict(run_id: str, stored: str, sent: str, index: int | None, first: int | None = None) -> ConflictError:
    """409 ``workload_conflict``: run ``run_id`` is labelled workload ``stored`` (or, ``first``:
    report ``first`` of this batch says so); report ``index`` (None: the registration) says
    ``sent``. A run's label is the first one given; it never changes."""
    where = [{"index": index, "field": "workload"}] if index is not None else []
    if first is not None:
        return ConflictError(
            "workload_conflict",
            f"reports[{first}] and reports[{index}] of this batch give run {run_id!r} two workloads, {stored!r} "
            f"and {sent!r}; every report of a run must give the same workload (or none); nothing of this batch "
            "was stored", [{**w, "other_index": first} for w in where], against_stored=False)
    said = "this registration says" if index is None else "this report says"
    return ConflictError(
        "workload_conflict",
        f"run {run_id!r} belongs to workload {stored!r} (the first label it was given; it never changes); "
        f"{said} {sent!r}; nothing of this {'registration' if index is None else 'batch'} was stored", where)


def spec_conflict(info: "SeriesInfo", kind: str, spec: "StatisticSpec | None", index: int | None) -> ConflictError:
    """409 ``spec_conflict``: the series is stored with another kind or spec."""
    return ConflictError(
        "spec_conflict",
        f"statistic {info.statistic!r} of run {info.run_id!r} is kind={info.kind!r} spec={info.spec.model_dump()}; "
        f"this report says kind={kind!r} spec={spec.model_dump() if spec else None}",
        [{"index": index, "field": "spec" if info.kind == kind else "kind"}] if index is not None else [],
    )


def unfit_placement(i: int, r: Report, exc: ValueError) -> ConflictError:
    """409 ``spec_conflict``: a statistic registered (before the rule, f47c80a) with a
    placement that does not fit its run's topology: no report of it can be stored."""
    return ConflictError(
        "spec_conflict",
        f"statistic {r.statistic!r} of run {r.run_id!r} was registered with a placement that "
        f"does not fit the run's topology ({exc}); no report of it can be stored: delete the "
        "run (DELETE /v1/runs/{run_id}) and register it again; nothing of this batch was stored",
        [{"index": i, "field": "spec"}], against_stored=False)


def statistics_limit(run_id: str, statistic: str, have: int, limit: int, index: int | None) -> LimitError:
    """422: run ``run_id`` has ``have`` statistics, the most one run may have."""
    field, loc = ((f"reports[{index}].statistic", ["reports", index, "statistic"]) if index is not None
                  else (f"statistics.{statistic}", ["statistics", statistic]))
    return LimitError(field, loc, f"run {run_id!r} already has {have} statistics, the most one run may have "
                                  f"(AUDITOR_MAX_STATISTICS_PER_RUN={limit}); {statistic!r} was not added")


def coordinate_conflict(conflicts: list[dict]) -> ConflictError:
    """409 ``coordinate_conflict`` of ``conflicts`` (entries naming both ranks and the shared
    coordinates, ``other_index`` when the other report is of this batch)."""
    first = conflicts[0]
    where = f"reports[{first['other_index']}]" if "other_index" in first else "a stored report"
    coords = ", ".join(f"{k}={v}" for k, v in first["coords"].items())
    message = (f"reports[{first['index']}] (rank {first['rank']}) and {where} (rank {first['other_rank']}) both "
               f"claim coords {coords} of step {first['step']} microbatch {first['microbatch']}: one place in "
               "the world holds one rank; nothing of this batch was stored")
    return ConflictError("coordinate_conflict", message, conflicts)


def check_placed(i: int, r: Report, allowed: dict[str, set[int]]) -> None:
    """409 ``placement_conflict`` for a report from a rank outside the statistic's placement."""
    for d, ok in allowed.items():
        c = getattr(r.coords, d)
        if c not in ok:
            raise ConflictError(
                "placement_conflict",
                f"reports[{i}] comes from rank {r.rank} ({d}={c}), but statistic {r.statistic!r} of run "
                f"{r.run_id!r} lives only where {d} is in {sorted(ok)} (spec.placement); nothing of this batch "
                "was stored",
                [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step, "rank": r.rank,
                  "coords": {d: c}, "fields": [f"coords.{d}"]}],
                against_stored=False,
            )


def microbatch_conflict(i: int, r: Report, other: int, against_stored: bool = True) -> ConflictError:
    """409: report ``i`` says another ``num_microbatches`` (``other``) than its step."""
    return ConflictError(
        "conflicting_report",
        f"reports[{i}] (step {r.step}, rank {r.rank}) says num_microbatches={r.num_microbatches}, but other "
        f"reports of that step say {other}: every report of a step must give the same num_microbatches; "
        "nothing of this batch was stored",
        [{"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
          "microbatch": r.microbatch, "rank": r.rank, "fields": ["num_microbatches"]}],
        against_stored,
    )


def conflict(clashes: list[tuple[int, tuple, tuple, tuple]], batch: Sequence[Report],
              within: int | None = None) -> ConflictError:
    """409 for reports that differ from one with the same key: the stored one, or (``within``:
    its index) an earlier one of the same batch."""
    conflicts = []
    for i, _key, stored, sent in clashes:
        stored, sent = dict(zip(COLUMNS, stored)), dict(zip(COLUMNS, sent))
        fields = list(dict.fromkeys(wire_fields(stored, sent)))
        r = batch[i]
        conflicts.append({
            "index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
            "microbatch": r.microbatch, "rank": r.rank, "fields": fields,
        })
    first = conflicts[0]
    if within is not None:
        message = (f"reports[{within}] and reports[{first['index']}] have the same (run, statistic, step, "
                   f"microbatch, rank) but differ in {', '.join(first['fields'])}; nothing of this batch "
                   "was stored")
    else:
        message = (f"{len(conflicts)} report(s) differ from the stored report with the same (run, statistic, "
                   f"step, microbatch, rank), e.g. reports[{first['index']}] (step {first['step']}, rank "
                   f"{first['rank']}) differs in {', '.join(first['fields'])}; the stored report stays, "
                   "nothing of this batch was stored")
    return ConflictError("conflicting_report", message, conflicts, against_stored=within is None)


def dropped_conflict(clashes: list[tuple[int, tuple | None, tuple | None]], batch: Sequence[Report],
                     within: int | None = None) -> ConflictError:
    """409 ``conflicting_report`` for re-sent reports whose ``dropped`` tally contradicts the
    stored one's, or (``within``: its index) an earlier copy's in the same batch: the tally
    (count, first_step, last_step) of a report only grows (a higher count over steps that
    cover the stored ones); a lower, an equal count with other steps, or none where one
    was stored is a contradiction. ``clashes``: (index, stored tally, sent tally; None:
    none) per report."""
    def told(d: tuple | None) -> str:
        return "none" if d is None else f"{{count: {d[0]}, first_step: {d[1]}, last_step: {d[2]}}}"

    conflicts = []
    for i, had, sent in clashes:
        r = batch[i]
        fields = [f"dropped.{f}" for f, a, b in zip(("count", "first_step", "last_step"), had or (None,) * 3,
                                                     sent or (None,) * 3) if a != b]
        conflicts.append({"index": i, "run_id": r.run_id, "statistic": r.statistic, "step": r.step,
                          "microbatch": r.microbatch, "rank": r.rank, "fields": fields})
    i, had, sent = clashes[0]
    whose = f"reports[{within}]" if within is not None else "the stored report"
    message = (f"{len(conflicts)} re-sent report(s) contradict the dropped tally of {whose} with the same (run, "
               f"statistic, step, microbatch, rank), e.g. reports[{i}] (step {batch[i].step}, rank {batch[i].rank}) "
               f"says dropped {told(sent)} where {whose} says {told(had)}: a client's tally of the reports it "
               "dropped only grows (a higher count, steps covering the earlier ones); "
               + ("nothing of this batch was stored" if within is not None
                  else "the stored report stays, nothing of this batch was stored"))
    return ConflictError("conflicting_report", message, conflicts, against_stored=within is None)


#: ``reports`` column → the wire field it stores (409 bodies name wire fields).
_WIRE_FIELD = {
    **{f"local_{f}": f"local.{f}" for f in ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq")},
    **{f"applied_{f}": f"applied.{f}" for f in ("count", "sum", "sum_sq", "mean", "var")},
    **{d: f"coords.{d}" for d in DIMS},
}


def wire_fields(stored: dict, sent: dict):
    """Wire names of the fields in which two ``reports`` rows differ (``non_finite`` holds
    the column names of NaN/Inf values, so a difference there names those fields)."""
    for c in COMPARED:
        if stored[c] == sent[c]:
            continue
        if c == "non_finite":
            names = set((stored[c] or "").split(",")) ^ set((sent[c] or "").split(","))
            yield from (_WIRE_FIELD.get(n, n) for n in sorted(names) if n)
        else:
            yield _WIRE_FIELD.get(c, c)


log = logging.getLogger("auditor.service")


def record_refused(store: "Store", exc: ConflictError, batch: Sequence[Report], now: float) -> None:
    """Count the reports ``exc`` refused per series (``series.refused_*``), in a write
    transaction of its own after the batch's rollback: the reports its ``conflicts`` name,
    or for a topology (spec) conflict every report of the batch of that run (statistic).
    Never raises: a failure is logged, the 409 stays a 409."""
    try:
        picked: list[Report] = []
        for c in exc.conflicts:
            i = c.get("index")
            if i is None or not 0 <= i < len(batch) or "other_index" in c:
                continue  # a registration, or two reports of this batch: nothing stored contradicted
            r = batch[i]
            if exc.error == "topology_conflict":
                picked.extend(x for x in batch if x.run_id == r.run_id)
            elif exc.error == "spec_conflict":
                picked.extend(x for x in batch if (x.run_id, x.statistic) == (r.run_id, r.statistic))
            else:
                picked.append(r)
        per: dict[tuple[str, str], list[int]] = defaultdict(list)
        for r in {id(r): r for r in picked}.values():
            per[(r.run_id, r.statistic)].append(r.step)
        if not per:
            return
        rows = [(rid, st, len(steps), min(steps), max(steps), exc.error) for (rid, st), steps in per.items()]
        with store.write() as conn:
            store.record_refused(conn, rows, now)
    except Exception:  # noqa: BLE001 - counting must never turn the 409 into a 500
        log.exception("could not count the reports refused by a %s", exc.error)
