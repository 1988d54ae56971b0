"""The store: the only code that speaks SQL. Rows in, rows and dataclasses out.

Every method takes the connection of a transaction the caller opened with :meth:`Store.write`
(``BEGIN IMMEDIATE`` on SQLite) or :meth:`Store.read`, so one flow of
:class:`auditor.service.Service` — ingest, find completed steps, audit them, record the
verdicts — runs inside one transaction. Nothing here decides a verdict, words an error or
shapes a response.

Exactly-once auditing. Every step has one ``step_audits`` row. An ingest transaction
inserts its reports (``ON CONFLICT DO NOTHING``), then upserts the step rows it touched
(:meth:`Store.count_arrivals`), adding the number of reports it really inserted,
``RETURNING`` the new count. The upsert takes the row lock, so concurrent transactions
(threads, workers, replicas) that add to one step serialize on it, and exactly one of them
sees ``received == expected``; that one audits the step in the same transaction. The verdict
is written with ``UPDATE ... WHERE verdict IS NULL`` (:meth:`Store.record_verdicts`), so the
sweep (missing reports after the grace period) and an ingest can never both record a
verdict. On SQLite, write transactions are ``BEGIN IMMEDIATE`` and simply queue.

A step whose every report one ingest transaction inserted (``Service._fresh_steps``) skips
the upsert: no other transaction can have made its row, so it is audited with the rows in
hand and its row INSERTed with the verdict (``ON CONFLICT DO NOTHING``; a row that exists
after all sends the batch the general way). On PostgreSQL the step-row statements run once
per batch over ``unnest`` arrays, not once per step.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
import sqlite3
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import msgspec
import numpy as np
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from auditor.core import (
    REPLACEABLE, STALE_LOOKBACK, VERDICTS, RankReport, StepVerdict, batch, compress_ranks, compress_ranks_shared,
)
from auditor.db.engine import write_begin
from auditor.db.tables import faults, reports, runs, series, series_faults, step_audits
from auditor.status import STATUSES

KEY = ("series_id", "step", "microbatch", "rank")
#: Column order of ``reports`` (and of the tuples :func:`report_row` builds). The key comes
#: first and ``received_at`` last, so ``row[:4]`` is the key and ``row[:-1]`` is what an
#: identical re-send must match (:data:`COMPARED`).
COLUMNS = tuple(c.name for c in reports.columns)
COMPARED = tuple(c for c in COLUMNS if c != "received_at")
assert COLUMNS[:4] == KEY and COLUMNS[-1] == "received_at" and COLUMNS[:-1] == COMPARED
_REPORT_FIELDS = tuple(f for f in RankReport.__dataclass_fields__)
_LOCAL_FIELDS = ("count", "sum", "sum_sq", "min", "max", "replicated_sum_sq")
_APPLIED_FIELDS = ("count", "sum", "sum_sq", "mean", "var")
_FLOAT_NAMES = tuple(f"local_{f}" for f in _LOCAL_FIELDS) + tuple(f"applied_{f}" for f in _APPLIED_FIELDS)
_NO_APPLIED = (None,) * len(_APPLIED_FIELDS)
#: Picks the RankReport fields (in dataclass order) out of a ``reports`` row tuple.
_AUDIT_FIELDS = operator.itemgetter(*(COLUMNS.index(f) for f in _REPORT_FIELDS))
_APPLIED_COLUMN = COLUMNS.index("applied")
#: Columns of a ``reports`` row that :func:`elements` reads.
_INT_INDEX = tuple(COLUMNS.index(c) for c in ("dp", "cp", "tp", "pp", "microbatch", "rank"))
_VALUE_INDEX = tuple(COLUMNS.index(c) for c in batch.VALUE_FIELDS)
_DTYPE, _NON_FINITE, _GROUP_RANKS_COLUMN = (COLUMNS.index(c) for c in ("dtype", "non_finite", "group_ranks"))
#: Rows per SQLite ``INSERT`` statement of :meth:`Store.insert_all_new` (27 parameters each).
_SQLITE_ROWS_PER_INSERT = 256
_flatten = itertools.chain.from_iterable
#: Below this many rows a PostgreSQL batch is inserted with one ``INSERT ... RETURNING``.
_PG_COPY_MIN_ROWS = 32
_json_encode = msgspec.json.Encoder().encode
#: Step rows per multi-row ``VALUES`` statement on SQLite (:func:`_size_runs`; up to 17
#: parameters a row, SQLite allows 32,766 per statement).
_SQLITE_CHUNK_SIZES = (500, 32, 1)


def _size_runs(n: int, sizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """Cover ``range(n)`` with chunks of the fixed ``sizes`` (descending, the last 1),
    largest first: per size ``k`` used, ``(k, start, end)``, its chunks starting at
    ``start, start + k, … < end``. Multi-row ``VALUES`` statements on SQLite are cut this
    way so that each has one of a few texts: the driver keeps up to 128 prepared statements
    per connection (``sqlite3.connect(cached_statements=)``), and a text per remainder
    (one per batch size met) filled that cache with statements of hundreds of rows —
    server RSS grew to 1.3 GB over 4 M reports (benchmarks/memory.py)."""
    out, start = [], 0
    for k in sizes:
        end = start + (n - start) // k * k
        if end > start:
            out.append((k, start, end))
        start = end
    return out


_PG_COPY_TYPES = {"BIGINT": "int8", "INTEGER": "int4", "FLOAT": "float8", "BOOLEAN": "bool", "TEXT": "text"}


@dataclass(frozen=True, slots=True)
class RunRow:
    """A stored run: its topology, fixed by its first report or registration (DESIGN.md
    §3.1: ``expert`` = (edp, ep, etp, pp) or None, ``order`` = Megatron's rank order or
    None, ``known`` False for an unknown topology)."""

    run_id: str
    world_size: int
    sizes: tuple[int, int, int, int]
    created_at: float
    expert: tuple[int, int, int, int] | None = None
    order: str | None = None
    known: bool = True
    #: where the first report's layout came from (``Report.topology_source``), if it said
    source: str | None = None


@dataclass(frozen=True, slots=True)
class SeriesRow:
    """A stored (run, statistic): its id, kind and spec (the JSON dict as stored)."""

    id: int
    run_id: str
    statistic: str
    kind: str
    spec: dict


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs 5× (1.05 vs 0.21 µs)
class Arrival:
    """A step row after an ingest added to it (:meth:`Store.count_arrivals`)."""

    series_id: int
    step: int
    received: int
    expected: int
    verdict: str | None
    #: False when ``verdict`` was recorded while reports were missing (the report that
    #: completes the step re-audits it); None while open.
    complete_at_audit: bool | None = None


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs 5× (1.05 vs 0.21 µs)
class VerdictItem:
    """One step's verdict to record (:meth:`Store.record_verdicts`)."""

    series_id: int
    step: int
    verdict: StepVerdict
    #: all expected reports were audited (else the report that completes the step re-audits)
    complete: bool = True
    #: re-audit: the verdict recorded while reports were missing that this one replaces
    previous: str | None = None
    #: hang localisation of a step audited with missing reports (``Service._progress``)
    progress: dict | None = None
    #: the step has no row yet: INSERT it with the verdict, ``expected`` and ``received``
    #: (``first_seen`` = ``audited_at``), instead of UPDATEing the row
    #: :meth:`Store.count_arrivals` made. Lost (False) if the row exists after all.
    fresh: bool = False
    expected: int = 0
    received: int = 0


@dataclass(slots=True)
class CleanSteps:
    """Consistent verdicts of steps of one series that have no step row yet (every report
    of each was inserted by the recording transaction: ``Service._fresh_steps``), as
    columns (one entry per step, steps ascending) from
    :func:`auditor.core.batch.clean_columns`: :meth:`Store.record_verdicts` INSERTs their
    step rows with ``received = expected``, no faults, no object per step."""

    series_id: int
    steps: list[int]
    expected: list[int]
    cp_sigma: list[float | None]
    err_sigma: list[float | None]
    tol_sigma: list[float | None]
    #: per step its groups as JSON text (``[[key, mb, count, mean, var], ...]``)
    groups: list[str]

    @classmethod
    def of(cls, series_id: int, steps: Sequence[int], expected: Sequence[int], clean: batch.Clean) -> "CleanSteps":
        """The steps of ``clean`` (``clean.index`` into ``steps`` and ``expected``)."""
        return cls(series_id, [steps[i] for i in clean.index], [expected[i] for i in clean.index],
                   clean.cp_sigma, clean.err_sigma, clean.tol_sigma,
                   [_json_encode(g).decode() for g in clean.groups])

    def split(self, step: int) -> tuple["CleanSteps", "CleanSteps"]:
        """The steps before ``step`` and those from it on."""
        i = bisect.bisect_left(self.steps, step)
        return (CleanSteps(self.series_id, *(x[:i] for x in self._columns())),
                CleanSteps(self.series_id, *(x[i:] for x in self._columns())))

    def _columns(self) -> tuple[list, ...]:
        return self.steps, self.expected, self.cp_sigma, self.err_sigma, self.tol_sigma, self.groups

    def entries(self) -> Iterator[tuple]:
        """:func:`_series_params` entries: (step, verdict, cp σ, applied error σ, previous, progress)."""
        return zip(self.steps, itertools.repeat("consistent"), self.cp_sigma, self.err_sigma,
                   itertools.repeat(None), itertools.repeat(None))


class RowDeleted(Exception):
    """A run or series row an ``INSERT ... ON CONFLICT DO NOTHING`` found was gone by the
    next statement: a concurrent ``DELETE /v1/runs/{run_id}`` committed in between. The
    caller's transaction is rolled back and tried again (``Service._ingest_retrying``)."""


class ReportsExist(Exception):
    """:meth:`Store.insert_all_new` met a stored report (its key, or its coordinates in its
    step): the caller's transaction is rolled back (part of the batch may be inserted; on
    PostgreSQL the unique violation aborted it) and the batch ingested again with
    :meth:`Store.insert_returning`, which finds out report by report (``Service.ingest``)."""


class StepRowExists(Exception):
    """A step row :meth:`Store.record_verdicts` was to INSERT with its verdict (a ``fresh``
    item, :class:`CleanSteps`) existed after all: the caller's transaction is rolled back
    and the batch ingested again the general way (``Service._ingest``)."""


def _bind(name: str, type_: Any) -> Any:
    """A typed parameter that PostgreSQL can type even where it only meets IS NULL."""
    return sa.cast(sa.bindparam(name, type_=type_), type_)


#: The columns of a step row's verdict, in the order of :meth:`Store._verdict_values`.
_VERDICT_COLUMNS = ("verdict", "complete_at_audit", "cp_disagreement_sigma", "applied_error_sigma", "tolerance_sigma",
                    "fault_kinds", "groups")
_ADD_RECEIVED = ("ON CONFLICT (series_id, step) DO UPDATE SET received = step_audits.received + excluded.received "
                 "RETURNING series_id, step, received, expected, verdict, complete_at_audit")
_SET_VERDICT = ", ".join(f"{c} = ?" for c in _VERDICT_COLUMNS) + ", audited_at = ?"


def _verdict_sql(dialect: str) -> dict[str, str]:
    """The step row statements of :meth:`Store.record_verdicts` and
    :meth:`Store.count_arrivals`, as driver SQL (positional parameters).

    SQLite (``executemany`` of one row each; no round trips to save): ``insert`` a fresh step
    row with its verdict (``ON CONFLICT DO NOTHING``; ``insert_rows``: up to 500 of them in one
    multi-row ``VALUES``), ``first`` audit (``verdict IS NULL``),
    ``again`` (re-audit of the ``previous`` verdict, recorded while incomplete), ``faults``
    (their rows), and ``arrivals`` (the upsert, one multi-row ``VALUES`` per chunk,
    ``RETURNING``).

    PostgreSQL: one statement per kind for all steps, over ``unnest`` of one array per
    column, so the backend executes it once (psycopg's ``executemany`` executes it once per
    parameter set, ~30 µs of backend time each): ``insert`` and ``arrivals`` in array
    (= key) order (``WITH ORDINALITY ... ORDER BY``, so their locks are taken in key order),
    ``update`` (first audits and re-audits together, ``RETURNING`` the keys it won),
    ``faults`` (ids in key order); ``copy``: the step rows of clean steps complete in hand
    (:meth:`Store._clean_step_rows`).
    """
    cols = ", ".join(_VERDICT_COLUMNS)
    if dialect != "postgresql":
        key = "series_id = ? AND step = ?"
        row = f"({', '.join('?' * (len(_VERDICT_COLUMNS) + 6))})"
        insert = f"INSERT INTO step_audits (series_id, step, expected, received, first_seen, {cols}, audited_at) VALUES "
        return {
            "insert": f"{insert}{row} ON CONFLICT DO NOTHING",
            "insert_rows": insert + "{values} ON CONFLICT DO NOTHING",
            "row": row,
            "first": f"UPDATE step_audits SET {_SET_VERDICT} WHERE {key} AND verdict IS NULL",
            "again": f"UPDATE step_audits SET {_SET_VERDICT}, previous_verdict = ?, verdict_changed_at = ? "
                     f"WHERE {key} AND verdict = ? AND complete_at_audit IS 0",
            "faults": "INSERT INTO faults (series_id, step, kind, ranks, message, evidence) VALUES (?, ?, ?, ?, ?, ?)",
            "arrivals": "INSERT INTO step_audits (series_id, step, received, expected, first_seen) VALUES {values} "
                        f"{_ADD_RECEIVED}",
        }
    v = ("v.verdict, v.complete, v.cp, v.ae, v.tol, v.kinds, v.groups::json")
    arrays = ("%s::bigint[], %s::bigint[], %s::text[], %s::bool[], %s::float8[], %s::float8[], %s::float8[], "
              "%s::text[], %s::text[]")
    names = "sid, st, verdict, complete, cp, ae, tol, kinds, groups"
    return {
        "copy": f"COPY step_audits (series_id, step, expected, received, first_seen, {cols}, audited_at) "
                "FROM STDIN (FORMAT BINARY)",
        "insert": f"INSERT INTO step_audits (series_id, step, expected, received, first_seen, {cols}, audited_at) "
                  f"SELECT v.sid, v.st, v.exp, v.rec, %s, {v}, %s "
                  f"FROM unnest({arrays}, %s::int[], %s::int[]) WITH ORDINALITY AS v({names}, exp, rec, ord) "
                  "ORDER BY v.ord ON CONFLICT DO NOTHING RETURNING series_id, step",
        "update": f"UPDATE step_audits AS a SET ({cols}, audited_at, previous_verdict, verdict_changed_at) = "
                  f"({v}, %s, CASE WHEN v.prev IS NULL THEN a.previous_verdict ELSE v.prev END, "
                  "CASE WHEN v.prev IS NULL THEN a.verdict_changed_at ELSE %s END) "
                  f"FROM unnest({arrays}, %s::text[]) AS v({names}, prev) "
                  "WHERE a.series_id = v.sid AND a.step = v.st AND CASE WHEN v.prev IS NULL THEN a.verdict IS NULL "
                  "ELSE a.verdict = v.prev AND a.complete_at_audit IS FALSE END "
                  "RETURNING a.series_id, a.step",
        "faults": "INSERT INTO faults (series_id, step, kind, ranks, message, evidence) "
                  "SELECT v.sid, v.st, v.kind, v.ranks, v.message, v.evidence::json "
                  "FROM unnest(%s::bigint[], %s::bigint[], %s::text[], %s::text[], %s::text[], %s::text[]) "
                  "WITH ORDINALITY AS v(sid, st, kind, ranks, message, evidence, ord) ORDER BY v.ord",
        "arrivals": "INSERT INTO step_audits (series_id, step, received, expected, first_seen) "
                    "SELECT v.sid, v.st, v.rec, v.exp, %s FROM unnest(%s::bigint[], %s::bigint[], %s::int[], %s::int[]) "
                    f"WITH ORDINALITY AS v(sid, st, rec, exp, ord) ORDER BY v.ord {_ADD_RECEIVED}",
    }


def _series_statement() -> Any:
    """The ``series`` UPDATE of :meth:`Store.record_verdicts`, one parameter set per series
    (or per item, applied in order): verdict counts by delta, first/last bad step, worst σ
    and its step, the newest step's σ figures, hang localisation."""
    s = series.c
    sid = _bind("sid", sa.BigInteger)
    lstep = _bind("lstep", sa.BigInteger)
    latest = sa.or_(s.last_audited_step.is_(None), s.last_audited_step <= lstep)
    recompute = _bind("recompute", sa.Integer) == 1
    has_progress = _bind("has_progress", sa.Integer) == 1
    values: dict[str, Any] = {"updated_at": sa.bindparam("now", type_=sa.Float)}
    for v in VERDICTS:
        values[f"steps_{v}"] = s[f"steps_{v}"] + _bind(f"d_{v}", sa.BigInteger)
    for v in REPLACEABLE:
        values[f"superseded_{v}"] = s[f"superseded_{v}"] + _bind(f"s_{v}", sa.BigInteger)
    for col, agg, key, beyond in (("first_bad_step", sa.func.min, "bad_lo", operator.gt),
                                  ("last_bad_step", sa.func.max, "bad_hi", operator.lt)):
        bad = _bind(key, sa.BigInteger)
        stored = sa.select(agg(step_audits.c.step)).where(
            step_audits.c.series_id == sid, step_audits.c.verdict == "inconsistent").scalar_subquery()
        values[col] = sa.case((recompute, stored),
                              (sa.and_(bad.is_not(None), sa.or_(s[col].is_(None), beyond(s[col], bad))), bad),
                              else_=s[col])
    for name, key in (("cp_disagreement", "wcp"), ("applied_error", "wae")):
        value, col = _bind(key, sa.Float), s[f"worst_{name}_sigma"]
        higher = sa.and_(value.is_not(None), sa.or_(col.is_(None), col < value))
        values[f"worst_{name}_sigma"] = sa.case((higher, value), else_=col)
        values[f"worst_{name}_step"] = sa.case((higher, _bind(key + "_step", sa.BigInteger)),
                                               else_=s[f"worst_{name}_step"])
    values["cp_disagreement_sigma"] = sa.case((latest, _bind("cp", sa.Float)), else_=s.cp_disagreement_sigma)
    values["applied_error_sigma"] = sa.case((latest, _bind("ae", sa.Float)), else_=s.applied_error_sigma)
    values["last_audited_step"] = sa.case((latest, lstep), else_=s.last_audited_step)
    values["ranks_behind"] = sa.case((has_progress, _bind("ranks_behind", sa.Integer)), (latest, 0),
                                     else_=s.ranks_behind)
    values["progress"] = sa.case((has_progress, sa.bindparam("v_progress", type_=sa.JSON)), (latest, sa.null()),
                                 else_=s.progress)
    return series.update().where(s.id == sid).values(**values)


def _series_params(series_id: int, entries: Sequence[tuple], now: float) -> dict:
    """One parameter set of :func:`_series_statement` for ``entries`` of one series (key
    order), each ``(step, verdict, cp σ, applied error σ, previous, progress)`` (see
    :class:`VerdictItem`), whose net effect is that of recording them one by one: verdict
    deltas summed, the lowest/highest inconsistent step, the largest σ with the first step
    that reached it, the newest step's σ figures. Re-audits and progress come one entry at
    a time."""
    d: dict[str, Any] = {"sid": series_id, "now": now, "recompute": 0, "has_progress": 0, "ranks_behind": None,
                         "v_progress": None}
    for v in VERDICTS:
        d[f"d_{v}"] = 0
    for v in REPLACEABLE:
        d[f"s_{v}"] = 0
    bad = []
    wcp = wcp_step = wae = wae_step = None
    for step, v, cp, ae, previous, progress in entries:
        d[f"d_{v}"] += 1
        if v == "inconsistent":
            bad.append(step)
        if previous is not None:  # the same verdict again: steps_<v> unchanged, one more superseded
            d[f"d_{previous}"] -= 1
            d[f"s_{previous}"] += 1
            if previous == "inconsistent" and v != "inconsistent":
                d["recompute"] = 1  # the step no longer counts as bad
        if progress is not None:
            d.update(has_progress=1, ranks_behind=progress["ranks_behind"], v_progress=json_safe(progress))
        if cp is not None and (wcp is None or wcp < cp) and math.isfinite(cp):
            wcp, wcp_step = cp, step
        if ae is not None and (wae is None or wae < ae) and math.isfinite(ae):
            wae, wae_step = ae, step
    d["bad_lo"], d["bad_hi"] = (min(bad), max(bad)) if bad else (None, None)
    d["wcp"], d["wcp_step"], d["wae"], d["wae_step"] = wcp, wcp_step, wae, wae_step
    last = max(entries, key=_FIRST)
    d["lstep"] = last[0]
    d["cp"] = finite_or_none(last[2])
    d["ae"] = finite_or_none(last[3])
    return d


def _item_entry(it: VerdictItem) -> tuple:
    """The :func:`_series_params` entry of an item."""
    v = it.verdict
    return it.step, v.verdict, v.cp_disagreement_sigma, v.applied_error_sigma, it.previous, it.progress


_FIRST = operator.itemgetter(0)


def json_safe(obj: Any) -> Any:
    """Plain JSON for JSON columns (and the API's JSON): numpy scalars and arrays become
    Python values, NaN/Inf become strings (PostgreSQL's json rejects them; :func:`as_float`
    reads them back)."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, np.ndarray)):
        return [json_safe(v) for v in obj]
    return obj


def as_float(x: Any) -> float:
    """A number stored by :func:`json_safe` (``"inf"``/``"nan"`` strings included)."""
    return float(x) if x is not None else math.nan


def finite_or_none(x: float | None) -> float | None:
    """NaN/Inf stored as NULL (float columns of the σ figures)."""
    return x if x is None or math.isfinite(x) else None


def _json_text(obj: Any) -> str:
    """JSON text of what :func:`json_safe` returned (msgspec; the json module for what
    msgspec does not take, e.g. integers beyond 64 bits)."""
    try:
        return _json_encode(obj).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(obj)


def _pg_array(kind: str, xs: Sequence) -> str:
    """A PostgreSQL array literal of ``xs`` (``kind``: int, float, bool or text; None is
    NULL), for a ``%s::<type>[]`` parameter: built with str.join, several times cheaper
    than psycopg's list dumper, which adapts element by element in Python."""
    if kind == "int":
        body = ",".join(map(str, xs))
    elif kind == "float":
        body = ",".join(["NULL" if x is None else repr(x) for x in xs])
    elif kind == "bool":
        body = ",".join(["t" if x else "f" for x in xs])
    else:
        body = ",".join(["NULL" if x is None else '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
                         for x in xs])
    return "{" + body + "}"


#: Wire types of the binary ``COPY`` of fresh step rows (``_verdict_sql``'s ``copy``): the
#: ``groups`` JSON goes as text, which is also json's binary form (``json_recv`` parses it).
_PG_STEP_COPY_TYPES = ("int8", "int8", "int4", "int4", "float8", "text", "bool", "float8", "float8", "float8",
                       "text", "text", "float8")

#: Element kinds of the arrays of the PostgreSQL step-row statements (``_verdict_sql``).
_PG_VERDICT_KINDS = ("int", "int", "text", "bool", "float", "float", "float", "text", "text")


def _float_or_none(x: float | None) -> float | None:
    """:func:`finite_or_none` as a plain float (numpy scalars would not fit a typed array)."""
    return None if x is None or not math.isfinite(x) else float(x)


_LOCAL_VALUES = operator.attrgetter(*_LOCAL_FIELDS)
_APPLIED_VALUES = operator.attrgetter(*_APPLIED_FIELDS)
_COORDS = operator.attrgetter("dp", "cp", "tp", "pp", "edp", "ep", "etp")


def report_row(r, series_id: int, now: float) -> tuple:
    """Flatten one wire report (anything with the attributes of
    :class:`auditor.schemas.Report`) into a ``reports`` row, a tuple in :data:`COLUMNS`
    order (the ingest hot path: no dict per report, the fields read by C-level getters).
    NaN becomes NULL (SQLite cannot store NaN) and the names of all non-finite fields go to
    ``non_finite``; a report whose class says ``values_finite`` (the fast decoder's: msgspec
    reads no NaN or Infinity) is not searched for them."""
    app = r.applied
    loc = _LOCAL_VALUES(r.local)
    applied = _NO_APPLIED if app is None else _APPLIED_VALUES(app)
    non_finite = None
    if not r.values_finite:
        loc, applied, non_finite = _non_finite(loc, applied)
    gr = r.group_ranks
    if r.topology == "unknown":  # no coordinates: store the rank (the audit groups by group_ranks)
        return (series_id, r.step, r.microbatch, r.rank, r.rank, 0, 0, 0, 0, 0, 0, r.dtype, *loc,
                app is not None, *applied, non_finite, compress_ranks_shared(gr), now)
    return (series_id, r.step, r.microbatch, r.rank, *_COORDS(r.coords), r.dtype, *loc,
            app is not None, *applied, non_finite, None if gr is None else compress_ranks_shared(gr), now)


def _non_finite(loc: tuple, applied: tuple) -> tuple[tuple, tuple, str | None]:
    """``(loc, applied, names)`` of a report's local and applied values: NaN replaced by
    None and the comma-separated column names of the non-finite ones (None if all finite)."""
    vals = loc + applied
    try:  # one C-level pass for the common all-finite case
        if math.isfinite(math.fsum([v for v in vals if v is not None])):
            return loc, applied, None
    except (OverflowError, ValueError):  # overflow, or +Inf and -Inf together: field by field
        pass
    bad = [n for n, v in zip(_FLOAT_NAMES, vals) if v is not None and not math.isfinite(v)]
    if not bad:
        return loc, applied, None
    vals = tuple(None if v is not None and math.isnan(v) else v for v in vals)
    return vals[:len(loc)], vals[len(loc):], ",".join(bad)


def elements(steps: Sequence[Sequence[tuple]]) -> batch.Elements:
    """The columns :func:`auditor.core.audit_clean` reads, of the ``reports`` rows
    (:data:`COLUMNS` order) of several steps: ``steps[i]`` holds the rows of step ``i``.
    The rows are transposed once (``zip``, in C) and the columns made arrays (``ints`` and
    ``values`` are Fortran-ordered views of those columns; None becomes NaN)."""
    rows = [r for rs in steps for r in rs]
    n = len(rows)
    cols = list(zip(*rows)) if n else [()] * len(COLUMNS)
    return batch.Elements(
        step=np.repeat(np.arange(len(steps), dtype=np.int64), [len(rs) for rs in steps]),
        ints=np.array([cols[i] for i in _INT_INDEX], dtype=np.int64).reshape(len(_INT_INDEX), n).T,
        values=np.array([cols[i] for i in _VALUE_INDEX], dtype=np.float64).reshape(len(_VALUE_INDEX), n).T,
        applied=np.array(cols[_APPLIED_COLUMN], dtype=bool).reshape(n),
        dtype=cols[_DTYPE],
        noted=np.array([x is not None for x in cols[_NON_FINITE]], dtype=bool).reshape(n),
        group_ranks=cols[_GROUP_RANKS_COLUMN],
    )


def rank_report(row: Sequence) -> RankReport:
    """The engine's :class:`~auditor.core.types.RankReport` of a ``reports`` row tuple
    (:data:`COLUMNS` order). ``group_ranks`` stays the stored compressed text (e.g.
    ``"0-3,8-11"``): the engine compares it as text and never expands a step's groups all at
    once (a 2,400-rank step whose ranks each name ~2,400 others would be 5.8 M ints)."""
    return RankReport(*_AUDIT_FIELDS(row))


def _run_row(row) -> RunRow:
    expert = (row.edp, row.ep, row.etp, row.pp) if row.edp is not None else None
    return RunRow(row.run_id, row.world_size, (row.dp, row.cp, row.tp, row.pp), row.created_at, expert,
                  row.rank_order, row.topology != "unknown", row.topology_source)


class Store:
    """All SQL of the service. Thread-safe; holds no state but prepared statement text."""

    def __init__(self, engine: sa.Engine):
        self.engine = engine
        self.dialect = engine.dialect.name
        self._insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        names = ", ".join(f'"{c}"' for c in COLUMNS)
        #: SQLite: (rows per statement, INSERT text), largest first (:meth:`_sqlite_insert`).
        self._sqlite_chunks: list[tuple[int, str]] | None = None
        self._copy_sql = f"COPY reports ({names}) FROM STDIN (FORMAT BINARY)"
        mark = "%s" if self.dialect == "postgresql" else "?"
        self._step_sql = f"SELECT {names} FROM reports WHERE series_id = {mark} AND step = {mark}"
        self._step_sql_of = _verdict_sql(self.dialect)
        self._series_stmt = _series_statement()
        self._copy_types = [
            _PG_COPY_TYPES["TEXT" if isinstance(c.type, sa.String) else c.type.compile(postgresql.dialect())]
            for c in reports.columns
        ] if self.dialect == "postgresql" else []

    # ------------------------------------------------------------------ transactions
    def write(self):
        """A write transaction (``BEGIN IMMEDIATE`` on SQLite): ``with store.write() as conn:``."""
        return write_begin(self.engine)

    def read(self):
        """A read-only connection: ``with store.read() as conn:``."""
        return self.engine.connect()

    def dispose(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------ runs and series
    def ensure_run(self, conn: sa.Connection, run_id: str, world_size: int, sizes: tuple[int, int, int, int],
                   now: float, expert: tuple[int, int, int, int] | None = None, order: str | None = None,
                   known: bool = True, source: str | None = None) -> RunRow:
        """Create the run with this topology (and ``source``, where its layout came from)
        unless it exists; return the stored run. Raises
        :class:`RowDeleted` when a concurrent deletion of the run committed between the two
        statements (PostgreSQL, read committed: the INSERT found the row, the SELECT no
        more)."""
        conn.execute(
            self._insert(runs).values(
                run_id=run_id, world_size=world_size, created_at=now,
                **dict(zip(("dp", "cp", "tp", "pp"), sizes)),
                **(dict(zip(("edp", "ep", "etp"), expert[:3])) if expert else {}),
                rank_order=order, topology="known" if known else "unknown", topology_source=source,
            ).on_conflict_do_nothing()
        )
        row = conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).one_or_none()
        if row is None:
            raise RowDeleted(f"run {run_id!r}")
        return _run_row(row)

    def runs_created_at(self, conn: sa.Connection, run_ids: Iterable[str]) -> dict[str, float]:
        """``{run_id: created_at}`` of those of ``run_ids`` that exist (one indexed read;
        :meth:`_fetch_in`)."""
        return dict(self._fetch_in(conn, "SELECT run_id, created_at FROM runs WHERE run_id {}", sorted(run_ids)))

    def _fetch_in(self, conn: sa.Connection, sql: str, values: list) -> list[tuple]:
        """Every row of driver SQL ``sql`` whose ``{}`` is made a membership test of
        ``values``: ``= ANY(%s)`` with one array parameter (PostgreSQL), ``IN (?, ...)`` per
        500 values (SQLite, whose statements bind at most 32,766 variables, 999 before 3.32).
        On the driver's cursor: the ingest reads this way once or twice per batch, and
        SQLAlchemy's statement building and expanding ``IN`` took 90-120 µs of a 2 µs read."""
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                cur.execute(sql.format("= ANY(%s)"), (values,))
                return cur.fetchall()
            out: list[tuple] = []
            for i in range(0, len(values), 500):
                part = values[i:i + 500]
                cur.execute(sql.format(f"IN ({', '.join('?' * len(part))})"), part)
                out += cur.fetchall()
            return out
        finally:
            cur.close()

    def ensure_series(self, conn: sa.Connection, run_id: str, statistic: str, kind: str, spec: dict,
                      now: float) -> SeriesRow:
        """Create the (run, statistic) with this kind and spec unless it exists; return the
        stored one. Raises :class:`RowDeleted` as :meth:`ensure_run` does."""
        conn.execute(
            self._insert(series).values(
                run_id=run_id, statistic=statistic, kind=kind, spec=spec, created_at=now, updated_at=now,
            ).on_conflict_do_nothing()
        )
        row = conn.execute(
            sa.select(series.c.id, series.c.kind, series.c.spec)
            .where(series.c.run_id == run_id, series.c.statistic == statistic)
        ).one_or_none()
        if row is None:
            raise RowDeleted(f"statistic {statistic!r} of run {run_id!r}")
        return SeriesRow(row.id, run_id, statistic, row.kind, row.spec)

    def statistic_names(self, conn: sa.Connection, run_id: str, limit: int) -> list[str]:
        """Up to ``limit`` statistic names of a run."""
        return conn.execute(sa.select(series.c.statistic).where(series.c.run_id == run_id).limit(limit)
                            ).scalars().all()

    def series_by_id(self, conn: sa.Connection, series_id: int) -> tuple[SeriesRow, RunRow] | None:
        """A series and its run; None if it was deleted."""
        row = conn.execute(
            sa.select(series.c.id, series.c.run_id, series.c.statistic, series.c.kind, series.c.spec,
                      runs.c.world_size, runs.c.dp, runs.c.cp, runs.c.tp, runs.c.pp, runs.c.created_at,
                      runs.c.edp, runs.c.ep, runs.c.etp, runs.c.rank_order, runs.c.topology, runs.c.topology_source)
            .join(runs, runs.c.run_id == series.c.run_id).where(series.c.id == series_id)
        ).one_or_none()
        if row is None:
            return None
        return SeriesRow(row.id, row.run_id, row.statistic, row.kind, row.spec), _run_row(row)

    # ------------------------------------------------------------------------ reports
    def insert_all_new(self, conn: sa.Connection, rows: list[tuple],
                       meanwhile: Callable[[], None] | None = None) -> bool:
        """Insert ``rows`` (tuples in :data:`COLUMNS` order, in key order) with one bulk
        driver call: True when every row was stored. Raises :class:`ReportsExist` if any key
        (or any step's coordinates) is stored already; the caller rolls its transaction
        back and inserts with :meth:`insert_returning` instead. False, with nothing done,
        for a PostgreSQL batch under ``_PG_COPY_MIN_ROWS`` rows (one ``INSERT ...
        RETURNING`` costs fewer round trips than ``COPY``).

        PostgreSQL: binary ``COPY`` (a duplicate key fails it with a unique violation, after
        waiting for a concurrent writer of that key like any insert). SQLite: ``INSERT ... ON
        CONFLICT DO NOTHING`` of up to :data:`_SQLITE_ROWS_PER_INSERT` rows per statement
        (:meth:`_sqlite_insert`), all rows stored iff the change count matches.

        ``meanwhile()`` is called once the rows are sent and before their result is awaited
        (PostgreSQL: before the COPY's end, so the backend stores them meanwhile), or after
        the insert (SQLite); not when False is returned. Work it does is lost if
        :class:`ReportsExist` follows.

        No savepoint: a batch holding a stored report (a re-send) is rare, and rolling the
        whole transaction back then costs less than a savepoint on every batch did
        (SAVEPOINT and RELEASE were 7.6 % of a PostgreSQL ingest of 1,000-report batches,
        docs/performance.md)."""
        if self.dialect == "postgresql" and len(rows) < _PG_COPY_MIN_ROWS:
            return False
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                import psycopg

                try:
                    with cur.copy(self._copy_sql) as copy:
                        copy.set_types(self._copy_types)
                        for row in rows:
                            copy.write_row(row)
                        if meanwhile is not None:
                            meanwhile()
                except psycopg.errors.UniqueViolation:
                    raise ReportsExist() from None
            else:
                if self._sqlite_insert(cur, rows) != len(rows):
                    raise ReportsExist()
                if meanwhile is not None:
                    meanwhile()
        finally:
            cur.close()
        return True

    def _sqlite_insert(self, cur, rows: list[tuple]) -> int:
        """Insert ``rows`` (in order) with ``INSERT ... VALUES (...), (...), ... ON CONFLICT
        DO NOTHING`` statements of :data:`_SQLITE_ROWS_PER_INSERT` rows, then of 16, then
        one by one (three statement texts, each prepared once per connection); the number
        of rows stored.

        Why: ``executemany`` of a one-row statement pays the driver's per-execution work
        (reset, clear, step, the row's sequence checks) and SQLite's statement start per
        row; a 256-row statement binds the same parameters (the rows flattened) with 1/256
        of it: 3.0 -> 2.3 µs per row stored, commit included (10,000-row batches into a
        growing file, docs/performance.md). The chunk shrinks if the SQLite build allows
        fewer variables per statement (``SQLITE_LIMIT_VARIABLE_NUMBER``; 32,766 by default
        since 3.32, 999 before)."""
        if self._sqlite_chunks is None:
            limit = cur.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(COLUMNS)
            sizes = sorted({max(1, min(_SQLITE_ROWS_PER_INSERT, limit)), max(1, min(16, limit)), 1}, reverse=True)
            names = ", ".join(f'"{c}"' for c in COLUMNS)
            one = f"({', '.join('?' * len(COLUMNS))})"
            self._sqlite_chunks = [(k, f"INSERT INTO reports ({names}) VALUES {', '.join([one] * k)} "
                                       "ON CONFLICT DO NOTHING") for k in sizes]
        stored = 0
        sqls = dict(self._sqlite_chunks)
        for k, start, end in _size_runs(len(rows), list(sqls)):
            cur.executemany(sqls[k], rows[start:end] if k == 1 else
                            [tuple(_flatten(rows[i:i + k])) for i in range(start, end, k)])
            stored += cur.rowcount
        return stored

    def insert_returning(self, conn: sa.Connection, rows: list[tuple]) -> set[tuple]:
        """Insert ``rows`` (key order), skipping keys already stored; the keys inserted."""
        if not rows:
            return set()
        inserted = conn.execute(
            self._insert(reports).on_conflict_do_nothing().returning(
                reports.c.series_id, reports.c.step, reports.c.microbatch, reports.c.rank
            ),
            [dict(zip(COLUMNS, row)) for row in rows],
        ).all()
        return {tuple(k) for k in inserted}

    def steps_expected(self, conn: sa.Connection, steps: Iterable[tuple[int, int]]) -> dict[tuple[int, int], int]:
        """``{(series_id, step): expected}`` of those of ``steps`` that have a step row."""
        by_series: dict[int, list[int]] = defaultdict(list)
        for sid, st in steps:
            by_series[int(sid)].append(int(st))
        out: dict[tuple[int, int], int] = {}
        for sid, sts in sorted(by_series.items()):
            for _, st, e in self._fetch_in(
                    conn, f"SELECT series_id, step, expected FROM step_audits WHERE series_id = {sid} AND step {{}}",
                    sorted(sts)):
                out[(sid, st)] = e
        return out

    def fetch_reports(self, conn: sa.Connection, keys: Iterable[tuple]) -> dict[tuple, tuple]:
        """The stored ``reports`` rows (:data:`COLUMNS` order) of ``keys``, by key."""
        wanted = set(keys)
        by_series: dict[int, set[int]] = defaultdict(set)
        for s, st, _, _ in wanted:
            by_series[s].add(st)
        out = {}
        for s, steps in by_series.items():
            for row in conn.execute(
                sa.select(reports).where(reports.c.series_id == s, reports.c.step.in_(sorted(steps)))
            ).mappings():
                k = tuple(row[c] for c in KEY)
                if k in wanted:
                    out[k] = tuple(row[c] for c in COLUMNS)
        return out

    def rank_at(self, conn: sa.Connection, series_id: int, step: int, microbatch: int,
                coords: tuple[int, int, int, int]) -> int | None:
        """The rank stored at these coordinates of a step and microbatch, or None."""
        c = reports.c
        dp, cp, tp, pp = coords
        return conn.execute(
            sa.select(c.rank).where(c.series_id == series_id, c.step == step, c.microbatch == microbatch,
                                    c.dp == dp, c.cp == cp, c.tp == tp, c.pp == pp)
        ).scalar_one_or_none()

    def report_rows(self, conn: sa.Connection, series_id: int, step: int) -> list[tuple]:
        """Every stored report of one step as ``reports`` row tuples (:data:`COLUMNS` order).
        Read with the driver's cursor (one step can hold thousands of rows and this is on
        the verdict-latency path); SQLite's 0/1 ``applied`` becomes a bool as SQLAlchemy
        would make it."""
        cur = conn.connection.driver_connection.cursor()
        try:
            cur.execute(self._step_sql, (series_id, step))
            rows = cur.fetchall()
        finally:
            cur.close()
        if self.dialect == "sqlite":
            a = _APPLIED_COLUMN
            rows = [(*r[:a], bool(r[a]), *r[a + 1:]) for r in rows]
        return rows

    def step_reports(self, conn: sa.Connection, series_id: int, step: int) -> list[RankReport]:
        """Every stored report of one step, as the engine's reports (:func:`rank_report`:
        ``group_ranks`` as the stored text)."""
        return [rank_report(r) for r in self.report_rows(conn, series_id, step)]

    # ------------------------------------------------------------------------- steps
    def count_arrivals(self, conn: sa.Connection, added: Mapping[tuple[int, int], int],
                       expected: Mapping[tuple[int, int], int], now: float) -> list[Arrival]:
        """Add ``added[(series_id, step)]`` new reports to each step's row (created with
        ``expected`` reports and ``first_seen = now`` by its first report), in key order; the
        rows after the update, in key order. The upsert takes each step row's lock: this is
        where concurrent ingests of one step serialize. One statement on PostgreSQL (over
        ``unnest``, rows taken in key order), per 500 steps on SQLite (multi-row
        ``VALUES``)."""
        keys = sorted(added)
        if not keys:
            return []
        sql = self._step_sql_of["arrivals"]
        cur = conn.connection.driver_connection.cursor()
        try:
            if self.dialect == "postgresql":
                cur.execute(sql, (now, _pg_array("int", [k[0] for k in keys]), _pg_array("int", [k[1] for k in keys]),
                                  _pg_array("int", [added[k] for k in keys]),
                                  _pg_array("int", [expected[k] for k in keys])))
                got = cur.fetchall()
            else:
                got = []
                for size, start, end in _size_runs(len(keys), _SQLITE_CHUNK_SIZES):
                    text = sql.format(values=", ".join(["(?, ?, ?, ?, ?)"] * size))
                    for i in range(start, end, size):
                        cur.execute(text, [x for k in keys[i:i + size] for x in (k[0], k[1], added[k], expected[k], now)])
                        got += cur.fetchall()
        finally:
            cur.close()
        return [Arrival(sid, st, rec, exp, verdict, None if complete is None else bool(complete))
                for sid, st, rec, exp, verdict, complete in sorted(got)]

    def history(self, conn: sa.Connection, series_id: int, step: int) -> Callable[[], dict]:
        """A loader of the correct statistic of each group in the last ``STALE_LOOKBACK``
        audited steps before ``step``: ``{group key: [(step, count, mean, var), ...]}``,
        oldest first (the engine's ``history``)."""
        def load():
            hist: dict[tuple, list] = defaultdict(list)
            for row in conn.execute(
                sa.select(step_audits.c.step, step_audits.c.groups)
                .where(step_audits.c.series_id == series_id, step_audits.c.step < step,
                       step_audits.c.verdict.is_not(None))
                .order_by(step_audits.c.step.desc()).limit(STALE_LOOKBACK)
            ):
                for key, _mb, count, mean, var in row.groups or []:
                    hist[tuple(key)].append((row.step, as_float(count), as_float(mean), as_float(var)))
            return {k: v[::-1] for k, v in hist.items()}
        return load

    def record_verdicts(self, conn: sa.Connection, items: Sequence["VerdictItem"], now: float,
                        clean: Sequence[CleanSteps] = ()) -> list[bool]:
        """Record the verdicts of many steps, their faults and the series aggregates, in a
        bounded number of statements (at most ten, however many steps; on PostgreSQL each
        one backend execution, except the series UPDATE, one per series).
        Returns per item (in the given order) True if it was recorded, False (and nothing of
        it written) if another transaction recorded that step first (for a ``fresh`` item:
        if its step row existed).

        Per item: ``complete``: all expected reports were audited (else the report that
        completes the step re-audits). ``previous``: replace the verdict ``previous``
        recorded while reports were missing (a re-audit): the step row matches only while
        ``complete_at_audit`` is false, so one transaction wins across replicas; the old
        faults are deleted and taken out of ``series_faults`` (their ``superseded`` keeps
        the total), the old verdict out of ``steps_<previous>`` (into
        ``superseded_<previous>``), first/last bad step recomputed when the step stops being
        bad, and the step keeps ``previous_verdict`` and ``verdict_changed_at``.
        ``progress`` (hang localisation, a step audited with missing reports): stored on
        the series with its ``ranks_behind``; without it, a step at least as new as any
        audited resets them (every placed rank reached it).

        The series row ends as if the items had been recorded one by one in key order:
        one parameter set per series for plain first audits (their sums, extremes and
        newest step), one per item for series with re-audits or progress (the statement's
        CASE expressions then apply them in order).

        ``fresh`` items (a step whose every report this transaction inserted, see
        ``Service._ingest``) have no step row yet: it is INSERTed with the verdict,
        ``expected``, ``received`` and ``first_seen = now`` (``ON CONFLICT DO NOTHING``: an
        existing row loses, nothing of it written); the row ends as :meth:`count_arrivals`
        followed by the verdict UPDATE would leave it. ``clean`` holds more such steps, all
        consistent, as columns (:class:`CleanSteps`); if any of their rows existed,
        :class:`StepRowExists` is raised (the caller rolls back).

        Lock order: the ``step_audits`` rows (key order), then the ``series`` rows (id
        order), then the ``series_faults`` rows (key order). The series rows are updated
        before ``series_faults`` so that every auditing transaction takes these locks in
        one order; the other way round, a transaction auditing two steps with different
        fault kinds deadlocked with one auditing a third (PostgreSQL). On PostgreSQL the
        verdict UPDATE joins ``unnest`` and visits rows in plan order, not key order: that
        takes no lock out of order because its callers hold those row locks already (an
        ingest upserted them in key order in :meth:`count_arrivals`) or update one row (the
        sweep). Fresh rows are inserted in key order and are no other transaction's to
        touch: any transaction writing such a row must first insert one of the step's
        reports, and waits on this one's report keys before it can.
        """
        keys = [(it.series_id, it.step) for it in items]
        order = list(range(len(items)))
        if any(keys[i] > keys[i + 1] for i in range(len(keys) - 1)):  # the service passes them in key order
            order.sort(key=keys.__getitem__)
        won = [False] * len(items)
        clean = [c for c in clean if c.steps]
        if not order and not clean:
            return won
        values = {i: self._verdict_values(items[i]) for i in order}
        cur = conn.connection.driver_connection.cursor()
        try:
            if clean:
                self._clean_step_rows(cur, clean, now)
            if order and self.dialect == "postgresql":
                self._pg_step_rows(cur, items, order, values, now, won)
            elif order:
                self._sqlite_step_rows(conn, cur, items, order, values, now, won)
        finally:
            cur.close()
        mine = [i for i in order if won[i]]
        if not mine and not clean:
            return won

        old_faults: dict[tuple[int, int], dict[str, int]] = defaultdict(dict)
        reaudited = [(items[i].series_id, items[i].step) for i in mine if items[i].previous is not None]
        if reaudited:
            where = sa.tuple_(faults.c.series_id, faults.c.step).in_(reaudited)
            for sid, st, kind, cnt in conn.execute(
                sa.select(faults.c.series_id, faults.c.step, faults.c.kind, sa.func.count()).where(where)
                .group_by(faults.c.series_id, faults.c.step, faults.c.kind)
            ):
                old_faults[(sid, st)][kind] = cnt
            conn.execute(faults.delete().where(where))

        by_series: dict[int, list[tuple]] = defaultdict(list)
        for i in mine:
            by_series[items[i].series_id].append(_item_entry(items[i]))
        mixed = set(by_series) & {c.series_id for c in clean}
        for c in clean:
            by_series[c.series_id].extend(c.entries())
        series_params = []
        for sid in sorted(by_series):
            entries = by_series[sid]
            if sid in mixed:
                entries.sort(key=_FIRST)  # items and clean steps of one series: key order
            if any(e[4] is not None or e[5] is not None for e in entries):
                series_params += [_series_params(sid, [e], now) for e in entries]
            else:
                series_params.append(_series_params(sid, entries, now))
        conn.execute(self._series_stmt, series_params)

        fault_rows = [(items[i].series_id, items[i].step, str(f.kind), compress_ranks(f.ranks), f.message,
                       _json_text(json_safe(f.evidence)))
                      for i in mine for f in items[i].verdict.faults]
        if fault_rows:
            cur = conn.connection.driver_connection.cursor()
            try:
                if self.dialect == "postgresql":  # one execution, ids in key order
                    cur.execute(self._step_sql_of["faults"],
                                [_pg_array(k, c) for k, c in zip(("int", "int", "text", "text", "text", "text"),
                                                                 zip(*fault_rows))])
                else:
                    cur.executemany(self._step_sql_of["faults"], fault_rows)
            finally:
                cur.close()
        deltas: dict[tuple[int, str], list[int]] = defaultdict(lambda: [0, 0])
        for i in mine:
            it = items[i]
            old = old_faults.get((it.series_id, it.step), {})
            new: dict[str, int] = defaultdict(int)
            for f in it.verdict.faults:
                new[str(f.kind)] += 1
            for k in set(new) | set(old):
                d = deltas[(it.series_id, k)]
                d[0] += new.get(k, 0) - old.get(k, 0)
                d[1] += old.get(k, 0)
        if deltas:
            stmt = self._insert(series_faults)
            conn.execute(
                stmt.on_conflict_do_update(
                    index_elements=["series_id", "kind"],
                    set_={"count": series_faults.c.count + stmt.excluded.count,
                          "superseded": series_faults.c.superseded + stmt.excluded.superseded},
                ),
                [{"series_id": sid, "kind": k, "count": c, "superseded": sup}
                 for (sid, k), (c, sup) in sorted(deltas.items())],
            )
        return won

    def _pg_step_rows(self, cur, items: Sequence[VerdictItem], order: list[int], values: dict[int, tuple],
                      now: float, won: list[bool]) -> None:
        """PostgreSQL: the step rows of :meth:`record_verdicts`, one ``INSERT`` (fresh rows)
        and one ``UPDATE`` (the rest) over ``unnest``, each ``RETURNING`` the keys it wrote."""
        done: set[tuple[int, int]] = set()
        for fresh in (True, False):
            idx = [i for i in order if items[i].fresh is fresh]
            if not idx:
                continue
            cols = [_pg_array(k, c) for k, c in
                    zip(_PG_VERDICT_KINDS, zip(*((items[i].series_id, items[i].step, *values[i]) for i in idx)))]
            if fresh:
                cur.execute(self._step_sql_of["insert"],
                            (now, now, *cols, _pg_array("int", [items[i].expected for i in idx]),
                             _pg_array("int", [items[i].received for i in idx])))
            else:
                cur.execute(self._step_sql_of["update"],
                            (now, now, *cols, _pg_array("text", [items[i].previous for i in idx])))
            done.update(map(tuple, cur.fetchall()))
        for i in order:
            won[i] = (items[i].series_id, items[i].step) in done

    def _clean_step_rows(self, cur, clean: Sequence[CleanSteps], now: float) -> None:
        """INSERT the step rows of ``clean`` (:meth:`record_verdicts`), in key order: one
        binary ``COPY`` (PostgreSQL) or one multi-row ``VALUES`` statement per
        :data:`_SQLITE_CHUNK_SIZES` chunk (SQLite, ``ON CONFLICT DO NOTHING``). Raises
        :class:`StepRowExists` if any of them existed; the caller rolls the transaction back
        (on PostgreSQL the unique violation has aborted it already).

        Why ``COPY`` and not ``INSERT ... SELECT FROM unnest(...) ON CONFLICT DO NOTHING``:
        no array literals to build and parse, and a plain insert instead of a speculative
        one per row: 6.5-11.7 -> 3.1-4.4 µs per step row (5,000-row statements,
        docs/performance.md). A clean step's row cannot exist but in the cases
        ``Service._fresh_steps`` names, so a failed COPY is as rare as a short INSERT count."""
        rep = itertools.repeat
        rows = list(itertools.chain.from_iterable(
            zip(rep(c.series_id), c.steps, c.expected, c.expected, rep(now), rep("consistent"), rep(True),
                c.cp_sigma, c.err_sigma, c.tol_sigma, rep(None), c.groups, rep(now))
            for c in clean))
        if self.dialect == "postgresql":
            import psycopg

            try:
                with cur.copy(self._step_sql_of["copy"]) as copy:
                    copy.set_types(_PG_STEP_COPY_TYPES)
                    for row in rows:
                        copy.write_row(row)
            except psycopg.errors.UniqueViolation:
                raise StepRowExists() from None
        elif self._sqlite_step_inserts(cur, rows) != len(rows):
            raise StepRowExists()

    def _sqlite_step_inserts(self, cur, ps: Sequence[tuple]) -> int:
        """SQLite: INSERT fresh step rows (``ps``: the ``insert`` statement's parameters per
        row) in multi-row ``VALUES`` statements (half the cost per row of an
        ``executemany``); the number inserted (``ON CONFLICT DO NOTHING``)."""
        sql, n = self._step_sql_of, 0
        for k, start, end in _size_runs(len(ps), _SQLITE_CHUNK_SIZES):
            text = sql["insert_rows"].format(values=", ".join([sql["row"]] * k))
            for j in range(start, end, k):
                cur.execute(text, list(itertools.chain.from_iterable(ps[j:j + k])))
                n += cur.rowcount
        return n

    def _sqlite_step_rows(self, conn: sa.Connection, cur, items: Sequence[VerdictItem], order: list[int],
                          values: dict[int, tuple], now: float, won: list[bool]) -> None:
        """SQLite: the step rows of :meth:`record_verdicts`, an ``executemany`` per kind
        (insert, first audit, re-audit) inside a savepoint; if their change count falls
        short (another transaction recorded some steps first) the savepoint is rolled back
        and the steps are written one by one to find which."""
        sql = self._step_sql_of

        def params(i: int) -> tuple[str, tuple]:
            it, v = items[i], values[i]
            if it.fresh:
                return "insert", (it.series_id, it.step, it.expected, it.received, now, *v, now)
            if it.previous is None:
                return "first", (*v, now, it.series_id, it.step)
            return "again", (*v, now, it.previous, now, it.series_id, it.step, it.previous)

        if len(order) == 1:  # the rowcount of one statement says whether it won
            kind, p = params(order[0])
            cur.execute(sql[kind], p)
            won[order[0]] = cur.rowcount == 1
            return
        by_kind: dict[str, list[tuple]] = defaultdict(list)
        for i in order:
            kind, p = params(i)
            by_kind[kind].append(p)
        savepoint = conn.begin_nested()
        n = 0
        for kind, ps in by_kind.items():
            if kind == "insert":
                n += self._sqlite_step_inserts(cur, ps)
            else:
                cur.executemany(sql[kind], ps)
                n += cur.rowcount
        if n == len(order):
            savepoint.commit()
            for i in order:
                won[i] = True
            return
        savepoint.rollback()  # another transaction recorded some of them: find which, one by one
        for i in order:
            kind, p = params(i)
            cur.execute(sql[kind], p)
            won[i] = cur.rowcount == 1

    @staticmethod
    def _verdict_values(it: "VerdictItem") -> tuple:
        """The :data:`_VERDICT_COLUMNS` of one item: the σ figures as floats or None, the
        fault kinds as text, the groups as JSON text (``[[key, mb, count, mean, var], ...]``,
        NaN/Inf as strings: :func:`json_safe`)."""
        v = it.verdict
        groups = [[list(g.key), g.microbatch, g.count, g.mean, g.var] for g in v.groups]
        try:  # plain ints and floats: only non-finite floats need json_safe (one C-level check)
            finite = math.isfinite(math.fsum([x for g in v.groups for x in (g.count, g.mean, g.var)]))
        except (OverflowError, ValueError):
            finite = False
        try:
            text = _json_encode(groups if finite else json_safe(groups))
        except TypeError:  # numpy values
            text = _json_encode(json_safe(groups))
        return (v.verdict, bool(it.complete), _float_or_none(v.cp_disagreement_sigma),
                _float_or_none(v.applied_error_sigma), _float_or_none(v.tolerance_sigma),
                ",".join(map(str, v.fault_kinds)) or None, text.decode())

    def rank_progress(self, conn: sa.Connection, series_id: int, window: int,
                      unstored: Iterable[int] = ()) -> tuple[int, dict[int, int]]:
        """Hang localisation: the first of the series' newest ``window`` steps, and each rank's
        newest step among them (ranks that sent nothing in the window are absent). Bounded:
        one index range of ``window`` steps. ``unstored``: steps whose reports are stored but
        whose step row this transaction has not inserted yet (they count as steps)."""
        steps = conn.execute(
            sa.select(step_audits.c.step).where(step_audits.c.series_id == series_id)
            .order_by(step_audits.c.step.desc()).limit(window)
        ).scalars().all()
        lo = min(sorted(set(steps).union(unstored), reverse=True)[:window])
        last = dict(conn.execute(
            sa.select(reports.c.rank, sa.func.max(reports.c.step))
            .where(reports.c.series_id == series_id, reports.c.step >= lo).group_by(reports.c.rank)
        ).all())
        return lo, last

    def ranks_reported_before(self, conn: sa.Connection, series_id: int, before: int, ranks: Iterable[int],
                              max_steps: int) -> set[int] | None:
        """Which of ``ranks`` sent a report of the series at a step < ``before``; None (not
        looked at) when the series has more than ``max_steps`` steps before it, so that the
        cost stays bounded (one index range of at most ``max_steps`` steps' reports)."""
        ranks = sorted(set(ranks))
        earlier = conn.execute(sa.select(sa.func.count()).select_from(
            sa.select(step_audits.c.step).where(step_audits.c.series_id == series_id, step_audits.c.step < before)
            .limit(max_steps + 1).subquery())).scalar_one()
        if earlier > max_steps:
            return None
        if not earlier or not ranks:
            return set()
        return set(conn.execute(
            sa.select(reports.c.rank).distinct()
            .where(reports.c.series_id == series_id, reports.c.step < before, reports.c.rank.in_(ranks))
        ).scalars().all())

    def due_steps(self, conn: sa.Connection, before: float, limit: int) -> list[tuple[int, int, int]]:
        """Open steps first seen at or before ``before``: ``(series_id, step, expected)``, in key order."""
        return [tuple(r) for r in conn.execute(
            sa.select(step_audits.c.series_id, step_audits.c.step, step_audits.c.expected)
            .where(step_audits.c.verdict.is_(None), step_audits.c.first_seen <= before)
            .order_by(step_audits.c.series_id, step_audits.c.step).limit(limit)
        ).all()]

    def reaudit_steps(self, conn: sa.Connection, limit: int) -> list[tuple[int, int, int, str]]:
        """Steps audited while incomplete that have all their reports now:
        ``(series_id, step, expected, verdict)``, in key order (the ingest that completed them
        normally re-audits them; these are left from before revision 0003)."""
        sa_ = step_audits.c
        return [tuple(r) for r in conn.execute(
            sa.select(sa_.series_id, sa_.step, sa_.expected, sa_.verdict)
            .where(sa_.complete_at_audit.is_(False), sa_.received >= sa_.expected, sa_.verdict.in_(REPLACEABLE))
            .order_by(sa_.series_id, sa_.step).limit(limit)
        ).all()]

    # ---------------------------------------------------------------------- lifecycle
    def first_steps(self, conn: sa.Connection, series_id: int, limit: int) -> list[tuple[int, int, int]]:
        """The first ``limit`` steps of a series: ``(step, received, expected)``."""
        sa_ = step_audits.c
        return [tuple(r) for r in conn.execute(
            sa.select(sa_.step, sa_.received, sa_.expected).where(sa_.series_id == series_id)
            .order_by(sa_.step).limit(limit)
        ).all()]

    def delete_steps(self, conn: sa.Connection, series_id: int, first: int, last: int) -> tuple[int, int]:
        """Delete the reports, faults and step rows of steps ``first..last`` of a series:
        ``(reports deleted, steps deleted)``."""
        n = conn.execute(reports.delete().where(reports.c.series_id == series_id,
                                                reports.c.step.between(first, last))).rowcount
        conn.execute(faults.delete().where(faults.c.series_id == series_id, faults.c.step.between(first, last)))
        m = conn.execute(step_audits.delete().where(step_audits.c.series_id == series_id,
                                                    step_audits.c.step.between(first, last))).rowcount
        return n, m

    def delete_rank_range(self, conn: sa.Connection, series_id: int, step: int, span: int) -> int | None:
        """Delete the reports of one step from its lowest stored rank up to ``span`` ranks
        on; the number deleted, or None when the step holds no report any more."""
        c = reports.c
        lo = conn.execute(sa.select(sa.func.min(c.rank)).where(c.series_id == series_id, c.step == step)).scalar_one()
        if lo is None:
            return None
        return conn.execute(reports.delete().where(c.series_id == series_id, c.step == step,
                                                   c.rank < lo + span)).rowcount

    def delete_run_rows(self, conn: sa.Connection, run_id: str, series_ids: Sequence[int]) -> None:
        """Delete a run: its series_faults, reports, step rows, faults, series and run row,
        whatever arrived meanwhile included.

        Lock order, the one every ingest follows (:meth:`lock_series`): the run row first
        (``FOR UPDATE``: an ingest making a new series of the run waits, then finds the run
        gone), then its series rows (``FOR UPDATE``: waits for every ingest holding one
        ``FOR KEY SHARE`` to commit), and only then, in statements that see what those
        ingests committed, the rows below them. On PostgreSQL ``reports`` and
        ``step_audits`` have no foreign key (migration 0006), so they are deleted here, not
        by ``ON DELETE CASCADE``; ``series_ids`` (read before the chunked deletion) is
        widened by the series the run has now."""
        conn.execute(sa.select(runs.c.run_id).where(runs.c.run_id == run_id).with_for_update())
        ids = sorted(set(series_ids).union(conn.execute(
            sa.select(series.c.id).where(series.c.run_id == run_id).order_by(series.c.id).with_for_update()
        ).scalars()))
        if ids:
            conn.execute(series_faults.delete().where(series_faults.c.series_id.in_(ids)))
            conn.execute(reports.delete().where(reports.c.series_id.in_(ids)))
            conn.execute(step_audits.delete().where(step_audits.c.series_id.in_(ids)))
        conn.execute(runs.delete().where(runs.c.run_id == run_id))

    def lock_series(self, conn: sa.Connection, series_ids: Iterable[int]) -> int:
        """Hold the rows of ``series_ids`` ``FOR KEY SHARE`` until the transaction ends
        (PostgreSQL; SQLite's write transaction holds the whole database) and return how
        many exist. An ingest takes them, in id order, before it writes any report or step
        row: what the foreign keys of ``reports`` and ``step_audits`` did per row on
        PostgreSQL (migration 0006), once per batch. A deletion (:meth:`delete_run_rows`)
        waits for the lock; a series deleted before it is missing from the count, and the
        caller retries the batch (``Service._ingest``: a stale cache)."""
        ids = sorted(set(series_ids))
        if not ids:
            return 0
        lock = " ORDER BY id FOR KEY SHARE" if self.dialect == "postgresql" else ""
        return len(self._fetch_in(conn, "SELECT id FROM series WHERE id {}" + lock, ids))

    def idle_runs(self, conn: sa.Connection, before: float, limit: int) -> list[str]:
        """Runs with no activity since ``before`` (newest series update, else creation), oldest first."""
        last = sa.func.coalesce(sa.func.max(series.c.updated_at), runs.c.created_at)
        return conn.execute(
            sa.select(runs.c.run_id).select_from(runs.outerjoin(series, series.c.run_id == runs.c.run_id))
            .group_by(runs.c.run_id, runs.c.created_at).having(last < before).order_by(last).limit(limit)
        ).scalars().all()

    # -------------------------------------------------------------------------- reads
    def runs(self, conn: sa.Connection, limit: int | None = None, after: tuple[float, str] | None = None,
             status: str | None = None) -> list[Mapping]:
        """Run rows, newest first (``created_at``, then ``run_id``), from the keyset position
        ``after`` (the last run of the previous page), at most ``limit``; served from
        ``ix_runs_created_at_run_id`` and the per-series aggregates. ``status`` filters by
        the status :mod:`auditor.status` defines, in SQL over those aggregates:
        ``inconsistent`` (some series has an inconsistent or audit_error step),
        ``unverified`` (none, but some step audited unverified), ``incomplete`` (neither,
        but some step audited incomplete), ``consistent`` (none of these, and some step
        audited) or ``pending`` (no step audited). Raises ``ValueError`` for
        any other ``status``."""
        q = sa.select(runs).order_by(runs.c.created_at.desc(), runs.c.run_id.desc())
        if status is not None:
            if status not in STATUSES:
                raise ValueError(f"status must be one of {', '.join(STATUSES)}; got {status!r}")
            c = series.c

            def some(cond):
                return sa.exists().where(c.run_id == runs.c.run_id, cond)

            bad = some(sa.or_(c.steps_inconsistent > 0, c.steps_audit_error > 0))
            unverified = some(c.steps_unverified > 0)
            incomplete = some(c.steps_incomplete > 0)
            ok = some(c.steps_consistent > 0)
            q = q.where({"inconsistent": bad, "unverified": sa.and_(~bad, unverified),
                         "incomplete": sa.and_(~bad, ~unverified, incomplete),
                         "consistent": sa.and_(~bad, ~unverified, ~incomplete, ok),
                         "pending": sa.and_(~bad, ~unverified, ~incomplete, ~ok)}[status])
        if after is not None:
            q = q.where(sa.or_(runs.c.created_at < after[0],
                               sa.and_(runs.c.created_at == after[0], runs.c.run_id < after[1])))
        if limit is not None:
            q = q.limit(limit)
        return conn.execute(q).mappings().all()

    def record_refused(self, conn: sa.Connection, refused: Sequence[tuple[str, str, int, int, int, str]],
                       now: float) -> int:
        """Count reports a 409 refused against the series they contradicted: per
        ``(run_id, statistic, n, first_step, last_step, kind)`` add ``n`` to
        ``refused_reports``, widen ``refused_first_step``/``refused_last_step`` to the
        steps, set ``refused_at`` to ``now`` (Unix seconds) and ``refused_kind``. A series
        that does not exist is skipped (nothing of a refused batch is stored, so a new
        run's series never is). Returns the number of series updated. One UPDATE per
        series, in series id order (the order :meth:`record_verdicts` locks them in)."""
        c = series.c
        keys = {(r[0], r[1]) for r in refused}
        ids = {(row.run_id, row.statistic): row.id for row in conn.execute(
            sa.select(c.id, c.run_id, c.statistic).where(c.run_id.in_(sorted({k[0] for k in keys}))))
            if (row.run_id, row.statistic) in keys}
        done = 0
        for sid, (_, _, n, lo, hi, kind) in sorted((ids[(r[0], r[1])], r) for r in refused if (r[0], r[1]) in ids):
            done += conn.execute(series.update().where(c.id == sid).values(
                refused_reports=c.refused_reports + n,
                refused_first_step=sa.case((c.refused_first_step.is_(None), lo), (c.refused_first_step > lo, lo),
                                           else_=c.refused_first_step),
                refused_last_step=sa.case((c.refused_last_step.is_(None), hi), (c.refused_last_step < hi, hi),
                                          else_=c.refused_last_step),
                refused_at=now, refused_kind=kind[:32],
            )).rowcount
        return done

    def run(self, conn: sa.Connection, run_id: str) -> Mapping | None:
        """The run row of ``run_id``, or None."""
        return conn.execute(sa.select(runs).where(runs.c.run_id == run_id)).mappings().one_or_none()

    def series_rows(self, conn: sa.Connection, run_id: str | Sequence[str] | None = None,
                    statistic: str | None = None, ordered: bool = False) -> list[Mapping]:
        """``series`` rows (all, of one run or of several, or one statistic of a run); by
        statistic if ``ordered``."""
        q = sa.select(series)
        if isinstance(run_id, str):
            q = q.where(series.c.run_id == run_id)
        elif run_id is not None:
            q = q.where(series.c.run_id.in_(list(run_id)))
        if statistic is not None:
            q = q.where(series.c.statistic == statistic)
        if ordered:
            q = q.order_by(series.c.statistic)
        return conn.execute(q).mappings().all()

    def fault_counts(self, conn: sa.Connection, series_id: int) -> dict[str, int]:
        """Faults found so far in a series, by kind (sorted)."""
        return dict(conn.execute(
            sa.select(series_faults.c.kind, series_faults.c.count)
            .where(series_faults.c.series_id == series_id, series_faults.c.count > 0).order_by(series_faults.c.kind)
        ).all())

    def pending_steps(self, conn: sa.Connection, series_id: int) -> int:
        """Steps of a series with no verdict yet."""
        return conn.execute(
            sa.select(sa.func.count()).select_from(step_audits)
            .where(step_audits.c.series_id == series_id, step_audits.c.verdict.is_(None))
        ).scalar_one()

    def bad_steps(self, conn: sa.Connection, series_id: int, limit: int) -> list[Mapping]:
        """Up to ``limit`` step rows of a series judged inconsistent or audit_error (first) or
        audited with reports missing (incomplete, or unverified while incomplete), by step."""
        v = step_audits.c.verdict
        return conn.execute(
            sa.select(step_audits)
            .where(step_audits.c.series_id == series_id,
                   sa.or_(v.in_(("inconsistent", "audit_error", "incomplete")),
                          sa.and_(v == "unverified", step_audits.c.complete_at_audit.is_(False))))
            .order_by(v.in_(("incomplete", "unverified")), step_audits.c.step).limit(limit)
        ).mappings().all()

    def step_rows(self, conn: sa.Connection, series_id: int, *, start: int | None = None, stop: int | None = None,
                  verdict: str | None = None, limit: int = 1000) -> list[Mapping]:
        """The stored per-step rows of a series in step order (never re-audited): step,
        verdict (None while open), received, expected, σ figures, tolerance, fault kinds,
        audited_at; steps in [``start``, ``stop``], of one ``verdict`` (``pending``: open),
        at most ``limit``. Keyset reads over the primary key (series_id, step), or over
        ``ix_step_audits_series_verdict_step`` when filtered by verdict."""
        a = step_audits.c
        q = (sa.select(a.step, a.verdict, a.received, a.expected, a.cp_disagreement_sigma, a.applied_error_sigma,
                       a.tolerance_sigma, a.fault_kinds, a.audited_at)
             .where(a.series_id == series_id).order_by(a.step).limit(limit))
        if verdict == "pending":
            q = q.where(a.verdict.is_(None))
        elif verdict is not None:
            q = q.where(a.verdict == verdict)
        if start is not None:
            q = q.where(a.step >= start)
        if stop is not None:
            q = q.where(a.step <= stop)
        return conn.execute(q).mappings().all()

    def step_row(self, conn: sa.Connection, series_id: int, step: int) -> Mapping | None:
        """The ``step_audits`` row of one step, or None."""
        return conn.execute(
            sa.select(step_audits).where(step_audits.c.series_id == series_id, step_audits.c.step == step)
        ).mappings().one_or_none()

    def step_faults(self, conn: sa.Connection, series_id: int, step: int) -> list[Mapping]:
        """The fault rows of one step (kind, ranks as stored text, message, evidence), in recorded order."""
        return conn.execute(
            sa.select(faults.c.kind, faults.c.ranks, faults.c.message, faults.c.evidence)
            .where(faults.c.series_id == series_id, faults.c.step == step).order_by(faults.c.id)
        ).mappings().all()

    def metric_series(self, since: float, max_series: int | None = None) -> list[dict]:
        """Per-series figures for /metrics, for series active after ``since`` (Unix s).

        Each dict: ``run_id``, ``statistic``, ``steps`` (verdict → verdicts ever recorded:
        current + superseded by re-audits, so the exported counters never go down),
        ``faults`` (kind → findings ever recorded), ``cp_disagreement_sigma``,
        ``applied_error_sigma``, ``last_audited_step``, ``ranks_behind``. At most ``max_series`` series (the
        most recently active) get their own dict; the others are summed into one with
        ``run_id`` and ``statistic`` ``"_other"`` (gauges: their maximum), so a scrape is
        bounded however many runs exist.
        """
        s = series.c
        verdict_cols = [(v, s[f"steps_{v}"] + (s[f"superseded_{v}"] if v in REPLACEABLE else 0)) for v in VERDICTS]
        fsum = series_faults.c.count + series_faults.c.superseded
        with self.read() as conn:
            q = (sa.select(s.id, s.run_id, s.statistic, s.cp_disagreement_sigma, s.applied_error_sigma,
                           s.last_audited_step, s.ranks_behind, *[c.label(v) for v, c in verdict_cols])
                 .where(s.updated_at >= since).order_by(s.updated_at.desc(), s.id))
            if max_series is not None:
                q = q.limit(max_series)
            rows = conn.execute(q).mappings().all()
            ids = [r["id"] for r in rows]
            fcounts: dict[int, dict[str, int]] = defaultdict(dict)
            if ids:
                for sid, kind, n in conn.execute(
                    sa.select(series_faults.c.series_id, series_faults.c.kind, fsum)
                    .where(series_faults.c.series_id.in_(ids))
                ):
                    fcounts[sid][kind] = n
            out = [{"run_id": r["run_id"], "statistic": r["statistic"], "steps": {v: r[v] for v in VERDICTS},
                    "faults": fcounts.get(r["id"], {}),
                    **{k: r[k] for k in ("cp_disagreement_sigma", "applied_error_sigma", "last_audited_step",
                                         "ranks_behind")}}
                   for r in rows]
            if max_series is None or len(rows) < max_series:
                return out
            rest = sa.and_(s.updated_at >= since, s.id.not_in(ids)) if ids else (s.updated_at >= since)
            agg = conn.execute(
                sa.select(sa.func.count(), *[sa.func.coalesce(sa.func.sum(c), 0) for _, c in verdict_cols],
                          sa.func.max(s.cp_disagreement_sigma), sa.func.max(s.applied_error_sigma),
                          sa.func.max(s.last_audited_step), sa.func.max(s.ranks_behind)).where(rest)
            ).one()
            if not agg[0]:
                return out
            kinds = dict(conn.execute(
                sa.select(series_faults.c.kind, sa.func.sum(fsum))
                .join(series, series.c.id == series_faults.c.series_id).where(rest).group_by(series_faults.c.kind)
            ).all())
            n_v = len(VERDICTS)
            out.append({"run_id": "_other", "statistic": "_other",
                        "steps": {v: int(agg[1 + i]) for i, v in enumerate(VERDICTS)},
                        "faults": {k: int(n) for k, n in kinds.items()},
                        "cp_disagreement_sigma": agg[1 + n_v], "applied_error_sigma": agg[2 + n_v],
                        "last_audited_step": agg[3 + n_v], "ranks_behind": agg[4 + n_v]})
        return out
