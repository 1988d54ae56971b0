"""The rows of the store: one result type per table and the row codec.

* ``runs`` → :class:`RunRow`; ``series`` → :class:`SeriesRow` (every column);
  ``step_audits`` → :class:`StepRow` (every column), :class:`StepLine` (a line of the steps
  page) and, after an ingest added to it, :class:`Arrival`; ``faults`` → :class:`FaultRow`;
  a verdict to record → :class:`VerdictItem` (or, for clean steps as columns, :class:`CleanSteps`).
  Every field of these is named after its table's column (checked at import).
* ``reports`` rows are plain tuples in :data:`COLUMNS` order: :func:`report_row` builds one
  from a wire report, :func:`rank_report` and :func:`elements` give the engine its inputs.
* JSON columns: :func:`json_safe` writes NaN/Inf as strings, :func:`as_float` reads them back.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, make_dataclass
from typing import Any, Iterator, Sequence

import msgspec
import numpy as np
import sqlalchemy as sa

from auditor.core import RankReport, StepVerdict, batch, compress_ranks_shared
from auditor.db.tables import faults, reports, series, step_audits

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
APPLIED_COLUMN = COLUMNS.index("applied")
#: Columns of a ``reports`` row that :func:`elements` reads.
_INT_INDEX = tuple(COLUMNS.index(c) for c in ("dp", "cp", "tp", "pp", "microbatch", "rank"))
_VALUE_INDEX = tuple(COLUMNS.index(c) for c in batch.VALUE_FIELDS)
_DTYPE, _NON_FINITE, _GROUP_RANKS_COLUMN = (COLUMNS.index(c) for c in ("dtype", "non_finite", "group_ranks"))
_json_encode = msgspec.json.Encoder().encode


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
    #: the workload label it was given first (``Report.workload``), if any
    workload: str | None = None

    @classmethod
    def of(cls, row: Any) -> "RunRow":
        """The run of a ``runs`` row (anything with its column attributes). The one place
        that reads the expert factorisation: (edp, ep, etp, pp) when ``edp`` is stored."""
        expert = (row.edp, row.ep, row.etp, row.pp) if row.edp is not None else None
        return cls(row.run_id, row.world_size, (row.dp, row.cp, row.tp, row.pp), row.created_at, expert,
                   row.rank_order, row.topology != "unknown", row.topology_source, getattr(row, "workload", None))


class _Row(Mapping):
    """A typed row that reads as a mapping too (``row["steps_consistent"]``, ``dict(row)``):
    what the read models and :mod:`auditor.status` (which takes mappings) index by name."""

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.__dataclass_fields__)

    def __len__(self) -> int:
        return len(self.__dataclass_fields__)


def _table_row(name: str, table: sa.Table, doc: str, names: Sequence[str] | None = None) -> type:
    """A frozen dataclass with one field per column of ``table`` (in table order, so
    ``cls(*row)`` reads a ``SELECT table`` row), or per column of ``names`` (in that order;
    ``cls(*row)`` reads a ``SELECT *cls.columns`` row), readable as a mapping
    (:class:`_Row`). ``cls.columns``: the columns, to select."""
    columns = tuple(table.columns) if names is None else tuple(table.c[n] for n in names)
    cls = make_dataclass(name, [(c.name, Any) for c in columns], bases=(_Row,), frozen=True, slots=True)
    cls.__module__, cls.__doc__, cls.columns = __name__, doc, columns
    return cls


#: A stored (run, statistic): its id, kind and spec (the JSON dict as stored), and the
#: aggregates of its verdicts (counts, bad steps, σ figures, hang localisation, refusals):
#: every column of ``series``, from every read of it.
SeriesRow = _table_row("SeriesRow", series, "A stored ``series`` row (every column; readable as a mapping).")
#: A stored step: its counts, verdict (None while open), σ figures, fault kinds and groups.
StepRow = _table_row("StepRow", step_audits, "A stored ``step_audits`` row (every column; readable as a mapping).")
#: A step as the steps page lists it (:meth:`Store.step_rows`): no groups, no previous verdict.
StepLine = _table_row("StepLine", step_audits, "A line of the steps page: the ``step_audits`` columns it shows.",
                      ("step", "verdict", "received", "expected", "cp_disagreement_sigma", "applied_error_sigma",
                       "tolerance_sigma", "fault_kinds", "audited_at"))
#: A fault of a step as a read shows it (:meth:`Store.step_faults`): ``ranks`` as stored
#: (compressed ranges), ``evidence`` the JSON dict as stored.
FaultRow = _table_row("FaultRow", faults, "A stored ``faults`` row as read: kind, ranks, message, evidence.",
                      ("kind", "ranks", "message", "evidence"))


@dataclass(slots=True)  # not frozen: one per step, and a frozen __init__ costs 5× (1.05 vs 0.21 µs)
class Arrival:
    """A step row after an ingest added to it (:meth:`Store.count_arrivals`): the
    ``step_audits`` columns the ingest reads back (the same names as :class:`StepRow`'s)."""

    series_id: int
    step: int
    received: int
    expected: int
    verdict: str | None
    #: False when ``verdict`` was recorded while reports were missing (the report that
    #: completes the step re-audits it); None while open.
    complete_at_audit: bool | None = None


assert set(Arrival.__dataclass_fields__) <= set(StepRow.__dataclass_fields__)


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
    #: hang localisation of a step audited with missing reports (``auditor.service.progress.localise``)
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
    of each was inserted by the recording transaction: ``auditor.service.judge.Judge.fresh_steps``), as
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
        """:func:`auditor.db.dialect.series_params` entries: (step, verdict, cp σ, applied error σ, previous, progress)."""
        return zip(self.steps, itertools.repeat("consistent"), self.cp_sigma, self.err_sigma,
                   itertools.repeat(None), itertools.repeat(None))


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


def json_scalar(x: Any) -> Any:
    """:func:`json_safe` of a scalar (no dict, list, tuple or array): a numpy scalar as its
    Python value, NaN/Inf as strings. The per-value path of the hot reads (rank rows)."""
    if isinstance(x, np.generic):
        x = x.item()
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def as_float(x: Any) -> float:
    """A number stored by :func:`json_safe` (``"inf"``/``"nan"`` strings included)."""
    return float(x) if x is not None else math.nan


def finite_or_none(x: float | None) -> float | None:
    """NaN/Inf stored as NULL (float columns of the σ figures)."""
    return x if x is None or math.isfinite(x) else None


def json_text(obj: Any) -> str:
    """JSON text of what :func:`json_safe` returned (msgspec; the json module for what
    msgspec does not take, e.g. integers beyond 64 bits)."""
    try:
        return _json_encode(obj).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(obj)


def figure_or_none(x: float | None) -> float | None:
    """A step figure that may be infinite (the applied-error slot, which holds a
    ``fingerprint`` step's replica gap: ∞ for a non-finite replica) as a plain float: NaN
    stored as NULL, ±Inf kept (a REAL/double precision column holds it on both databases)."""
    return None if x is None or math.isnan(x) else float(x)


def wire_figure(x: float | None) -> float | str | None:
    """A stored figure as the read documents carry it: ±Inf as the string ``"inf"``/``"-inf"``
    (JSON has no Infinity; :func:`json_safe`'s spelling), anything else unchanged."""
    return str(x) if x is not None and math.isinf(x) else x


def float_or_none(x: float | None) -> float | None:
    """:func:`finite_or_none` as a plain float (numpy scalars would not fit a typed array)."""
    return None if x is None or not math.isfinite(x) else float(x)


_LOCAL_VALUES = operator.attrgetter(*_LOCAL_FIELDS)
_APPLIED_VALUES = operator.attrgetter(*_APPLIED_FIELDS)
_COORDS = operator.attrgetter("dp", "cp", "tp", "pp", "edp", "ep", "etp")


def report_row(r, series_id: int, now: float) -> tuple:
    """Flatten one wire report (anything with the attributes of
    :class:`auditor.contract.models.Report`) into a ``reports`` row, a tuple in :data:`COLUMNS`
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
    fp = r.local.fingerprint
    if fp is not None:
        fp = json_text(fp if r.values_finite else json_safe(fp))
    if r.topology == "unknown":  # no coordinates: store the rank (the audit groups by group_ranks)
        return (series_id, r.step, r.microbatch, r.rank, r.rank, 0, 0, 0, 0, 0, 0, r.dtype, *loc,
                app is not None, *applied, non_finite, compress_ranks_shared(gr), fp, r.host, now)
    return (series_id, r.step, r.microbatch, r.rank, *_COORDS(r.coords), r.dtype, *loc,
            app is not None, *applied, non_finite, None if gr is None else compress_ranks_shared(gr), fp, r.host, now)


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
        applied=np.array(cols[APPLIED_COLUMN], dtype=bool).reshape(n),
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


#: The columns of a step row's verdict, in the order of :func:`verdict_values`.
VERDICT_COLUMNS = ("verdict", "complete_at_audit", "cp_disagreement_sigma", "applied_error_sigma", "tolerance_sigma",
                   "fault_kinds", "groups")


def verdict_values(it: VerdictItem) -> tuple:
    """The :data:`VERDICT_COLUMNS` of one item: the σ figures as floats or None (the
    applied-error figure keeps an infinite value: :func:`figure_or_none`), the
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
    return (v.verdict, bool(it.complete), float_or_none(v.cp_disagreement_sigma),
            figure_or_none(v.applied_error_sigma), float_or_none(v.tolerance_sigma),
            ",".join(map(str, v.fault_kinds)) or None, text.decode())
