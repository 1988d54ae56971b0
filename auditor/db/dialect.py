"""SQL texts per dialect (SQLite, PostgreSQL) and the driver-level helpers that run them.

The store's hot statements run on the driver's cursor with positional parameters (``?`` on
SQLite, ``%s`` on PostgreSQL): their texts are built here once per store, by dialect.
:func:`verdict_sql` holds the step-row statements, :func:`series_statement` the series
UPDATE of a verdict, :func:`fetch_in` a membership read; array literals for PostgreSQL's
``unnest`` come from :func:`pg_array`.
"""

from __future__ import annotations

import itertools
import math
import operator
import sqlite3
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from auditor.core import REPLACEABLE, VERDICTS
from auditor.db.rows import COLUMNS, VERDICT_COLUMNS, figure_or_none, finite_or_none, json_safe
from auditor.db.tables import reports, series, step_audits

#: Rows per SQLite ``INSERT`` statement of :meth:`Store.insert_all_new` (27 parameters each).
_SQLITE_ROWS_PER_INSERT = 256
flatten = itertools.chain.from_iterable
#: Below this many rows a PostgreSQL batch is inserted with one ``INSERT ... RETURNING``.
PG_COPY_MIN_ROWS = 32
#: Step rows per multi-row ``VALUES`` statement on SQLite (:func:`size_runs`; up to 17
#: parameters a row, SQLite allows 32,766 per statement).
SQLITE_CHUNK_SIZES = (500, 32, 1)


def size_runs(n: int, sizes: Sequence[int]) -> list[tuple[int, int, int]]:
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


def _bind(name: str, type_: Any) -> Any:
    """A typed parameter that PostgreSQL can type even where it only meets IS NULL."""
    return sa.cast(sa.bindparam(name, type_=type_), type_)


_VERDICT_COLUMNS = VERDICT_COLUMNS
_ADD_RECEIVED = ("ON CONFLICT (series_id, step) DO UPDATE SET received = step_audits.received + excluded.received "
                 "RETURNING series_id, step, received, expected, verdict, complete_at_audit")
_SET_VERDICT = ", ".join(f"{c} = ?" for c in _VERDICT_COLUMNS) + ", audited_at = ?"


def verdict_sql(dialect: str) -> dict[str, str]:
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
    return _pg_verdict_sql() if dialect == "postgresql" else _sqlite_verdict_sql()


def _sqlite_verdict_sql() -> dict[str, str]:
    """SQLite's texts of :func:`verdict_sql`."""
    cols = ", ".join(_VERDICT_COLUMNS)
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


def _pg_verdict_sql() -> dict[str, str]:
    """PostgreSQL's texts of :func:`verdict_sql`."""
    cols = ", ".join(_VERDICT_COLUMNS)
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


def series_statement() -> Any:
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


def series_params(series_id: int, entries: Sequence[tuple], now: float) -> dict:
    """One parameter set of :func:`series_statement` for ``entries`` of one series (key
    order), each ``(step, verdict, cp σ, applied error σ, previous, progress)`` (see
    :class:`VerdictItem`), whose net effect is that of recording them one by one: verdict
    deltas summed, the lowest/highest inconsistent step, the largest σ with the first step
    that reached it (an infinite applied-error figure counts: a fingerprint's ∞ gap), the
    newest step's σ figures. Re-audits and progress come one entry at
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
        if ae is not None and (wae is None or wae < ae) and not math.isnan(ae):  # ∞: a non-finite replica
            wae, wae_step = ae, step
    d["bad_lo"], d["bad_hi"] = (min(bad), max(bad)) if bad else (None, None)
    d["wcp"], d["wcp_step"], d["wae"], d["wae_step"] = wcp, wcp_step, wae, wae_step
    last = max(entries, key=operator.itemgetter(0))
    d["lstep"] = last[0]
    d["cp"] = finite_or_none(last[2])
    d["ae"] = figure_or_none(last[3])
    return d


def pg_array(kind: str, xs: Sequence) -> str:
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


#: Wire types of the binary ``COPY`` of fresh step rows (``verdict_sql``'s ``copy``): the
#: ``groups`` JSON goes as text, which is also json's binary form (``json_recv`` parses it).
PG_STEP_COPY_TYPES = ("int8", "int8", "int4", "int4", "float8", "text", "bool", "float8", "float8", "float8",
                       "text", "text", "float8")

#: Element kinds of the arrays of the PostgreSQL step-row statements (``verdict_sql``).
PG_VERDICT_KINDS = ("int", "int", "text", "bool", "float", "float", "float", "text", "text")



def fetch_in(conn: sa.Connection, dialect: str, sql: str, values: list) -> list[tuple]:
    """Every row of driver SQL ``sql`` whose ``{}`` is made a membership test of
    ``values``: ``= ANY(%s)`` with one array parameter (PostgreSQL), ``IN (?, ...)`` per
    500 values (SQLite, whose statements bind at most 32,766 variables, 999 before 3.32).
    On the driver's cursor: the ingest reads this way once or twice per batch, and
    SQLAlchemy's statement building and expanding ``IN`` took 90-120 µs of a 2 µs read."""
    cur = conn.connection.driver_connection.cursor()
    try:
        if dialect == "postgresql":
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


def report_names() -> str:
    """The ``reports`` column list of the driver statements, quoted, in :data:`COLUMNS` order."""
    return ", ".join(f'"{c}"' for c in COLUMNS)


def copy_reports_sql() -> str:
    """PostgreSQL: the binary ``COPY`` of ``reports`` rows (:meth:`Store.insert_all_new`)."""
    return f"COPY reports ({report_names()}) FROM STDIN (FORMAT BINARY)"


def copy_report_types() -> list[str]:
    """PostgreSQL: the binary ``COPY`` wire types of the ``reports`` columns."""
    return [_PG_COPY_TYPES["TEXT" if isinstance(c.type, sa.String) else c.type.compile(postgresql.dialect())]
            for c in reports.columns]


def step_reports_sql(dialect: str) -> str:
    """Every ``reports`` row of one step (``series_id``, ``step`` parameters)."""
    mark = "%s" if dialect == "postgresql" else "?"
    return f"SELECT {report_names()} FROM reports WHERE series_id = {mark} AND step = {mark}"


def sqlite_insert_chunks(cur: Any) -> list[tuple[int, str]]:
    """SQLite: ``(rows per statement, INSERT text)`` of the multi-row report inserts,
    largest first (:data:`_SQLITE_ROWS_PER_INSERT`, 16, 1), each within the build's
    ``SQLITE_LIMIT_VARIABLE_NUMBER``."""
    limit = cur.connection.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) // len(COLUMNS)
    sizes = sorted({max(1, min(_SQLITE_ROWS_PER_INSERT, limit)), max(1, min(16, limit)), 1}, reverse=True)
    one = f"({', '.join('?' * len(COLUMNS))})"
    return [(k, f"INSERT INTO reports ({report_names()}) VALUES {', '.join([one] * k)} ON CONFLICT DO NOTHING")
            for k in sizes]


class Statements:
    """What every group of statements of :class:`auditor.db.store.Store` shares: the
    dialect's name and its ``INSERT`` construct (for ``ON CONFLICT``)."""

    dialect: str
    _insert: Any

    def _fetch_in(self, conn: sa.Connection, sql: str, values: list) -> list[tuple]:
        """:func:`fetch_in` in this store's dialect."""
        return fetch_in(conn, self.dialect, sql, values)
