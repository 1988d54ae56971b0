"""Alembic migrations on a real database of each backend, and the start-up schema gate."""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa

from auditor.db.engine import (
    SchemaError, current_revision, downgrade, ensure_schema, head_revision, make_engine, upgrade,
)
from auditor.db.tables import metadata

TABLES = {"runs", "series", "reports", "report_drops", "step_audits", "faults", "series_faults"}


def tables(engine) -> set[str]:
    with engine.connect() as conn:
        return set(sa.inspect(conn).get_table_names()) - {"alembic_version"}


def _where(text) -> str | None:
    """An index predicate as text, comparable across reflection and compilation:
    ``(complete_at_audit IS FALSE)`` -> ``complete_at_audit is false``."""
    if text is None:
        return None
    text = " ".join(str(text).split()).lower()
    while text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    return text


def indexes(engine, table: str) -> dict[str, tuple]:
    """The indexes of a migrated table (not those of its constraints): ``{name: (columns,
    unique, predicate)}``."""
    with engine.connect() as conn:
        dialect = conn.dialect.name
        return {ix["name"]: (tuple(ix["column_names"]), bool(ix["unique"]),
                             _where(ix.get("dialect_options", {}).get(f"{dialect}_where")))
                for ix in sa.inspect(conn).get_indexes(table)
                if "duplicates_constraint" not in ix}  # PostgreSQL: a UNIQUE constraint's own index


def declared_indexes(engine, table: str) -> dict[str, tuple]:
    """The indexes ``auditor.db.tables`` declares, their predicates as the engine's dialect
    writes them in ``CREATE INDEX``."""
    out = {}
    for ix in metadata.tables[table].indexes:
        ddl = str(sa.schema.CreateIndex(ix).compile(dialect=engine.dialect))
        out[ix.name] = (tuple(c.name for c in ix.columns), bool(ix.unique),
                        _where(ddl.split(" WHERE ", 1)[1]) if " WHERE " in ddl else None)
    return out


def test_upgrade_from_empty_then_downgrade_to_base(fresh_database_url):
    """`auditor db upgrade` creates exactly the tables the code declares, with its columns
    and indexes (partial ones with its predicates, as each dialect renders them); alembic
    finds nothing else to change but, on PostgreSQL, the two foreign keys revision 0006
    dropped; `downgrade base` removes them all."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    engine = make_engine(fresh_database_url)
    assert current_revision(engine) is None
    out = subprocess.run([sys.executable, "-m", "auditor", "db", "upgrade", "--database-url", fresh_database_url],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert current_revision(engine) == head_revision()
    assert tables(engine) == TABLES == set(metadata.tables)
    with engine.connect() as conn:  # the migrated columns are the declared ones
        insp = sa.inspect(conn)
        for name, table in metadata.tables.items():
            assert {c["name"] for c in insp.get_columns(name)} == set(table.columns.keys()), name
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    for name in metadata.tables:
        assert indexes(engine, name) == declared_indexes(engine, name), name
    assert indexes(engine, "step_audits")["ix_step_audits_open"][2] == "verdict is null"
    assert [(d[0], d[1].name) for d in diff] == (
        [] if engine.dialect.name == "sqlite" else
        [("add_fk", "fk_reports_series_id_series"), ("add_fk", "fk_step_audits_series_id_series")]), diff
    downgrade(fresh_database_url, "base")
    assert tables(engine) == set()
    upgrade(fresh_database_url)
    assert tables(engine) == TABLES
    engine.dispose()


def test_serve_gate_migrates_empty_and_refuses_newer(fresh_database_url):
    engine = make_engine(fresh_database_url)
    ensure_schema(engine, fresh_database_url)  # empty → head
    assert current_revision(engine) == head_revision()
    ensure_schema(engine, fresh_database_url)  # at head → fine
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    with pytest.raises(SchemaError, match="newer than this auditor"):
        ensure_schema(engine, fresh_database_url)
    engine.dispose()


def test_serve_refuses_newer_database_with_exit_code(fresh_database_url):
    upgrade(fresh_database_url)
    engine = make_engine(fresh_database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    engine.dispose()
    out = subprocess.run([sys.executable, "-m", "auditor", "serve", "--database-url", fresh_database_url,
                          "--port", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "newer than this auditor" in out.stderr


def test_step_history_revision_backfills_worst_sigma(fresh_database_url):
    """Revision 0002 fills the worst σ figures (and their steps) of series audited before it
    from their stored per-step rows; the tolerance of those old steps stays unknown (NULL)."""
    upgrade(fresh_database_url, "0001")
    engine = make_engine(fresh_database_url)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO runs (run_id, world_size, dp, cp, tp, pp, created_at) "
                             "VALUES ('r', 2, 1, 2, 1, 1, 0)"))
        conn.execute(sa.text("INSERT INTO series (id, run_id, statistic, kind, spec, created_at, updated_at) "
                             "VALUES (1, 'r', 'advantages', 'moments', '{}', 0, 0)"))
        for step, cp, err in ((0, 0.0, 1e-9), (1, 0.433154, 0.267869), (2, 0.1, 0.3), (3, None, None)):
            conn.execute(sa.text("INSERT INTO step_audits (series_id, step, expected, received, first_seen, "
                                 "verdict, cp_disagreement_sigma, applied_error_sigma) "
                                 "VALUES (1, :s, 2, 2, 0, 'consistent', :c, :e)"), {"s": step, "c": cp, "e": err})
    upgrade(fresh_database_url)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT worst_cp_disagreement_sigma, worst_cp_disagreement_step, "
                                   "worst_applied_error_sigma, worst_applied_error_step FROM series")).one()
        tol = conn.execute(sa.text("SELECT count(*) FROM step_audits WHERE tolerance_sigma IS NULL")).scalar_one()
    engine.dispose()
    assert tuple(row) == (0.433154, 1, 0.3, 2) and tol == 4


def test_0003_backfill_lets_old_late_completed_steps_be_re_audited(fresh_database_url):
    """A database written by revision 0001 holds a step audited incomplete whose late report
    was stored but never audited (the issue-9 bug). After `db upgrade` the sweep re-audits it
    once (complete_at_audit was backfilled false): the run reads inconsistent, not consistent."""
    import time

    from auditor.db.store import COLUMNS, report_row
    from auditor.contract.models import Report
    from auditor.service import Service
    from factory import reference_reports

    upgrade(fresh_database_url, "0001")
    engine = make_engine(fresh_database_url)
    now = time.time()
    spec = ('{"reduce_over": ["dp", "cp"], "replicas": ["tp"], "variance": "sample", '
            '"over_microbatches": false}')
    rows = [report_row(Report.model_validate(r), 1, now) for r in reference_reports("old-run", buggy=True)]
    with engine.begin() as conn:  # what 0001-era code left behind, written as it wrote it
        conn.execute(sa.text("INSERT INTO runs VALUES ('old-run', 2, 1, 2, 1, 1, :t)"), {"t": now})
        conn.execute(sa.text("INSERT INTO series (run_id, statistic, kind, spec, created_at, updated_at, "
                             "steps_incomplete) VALUES ('old-run', 'advantages', 'moments', :spec, :t, :t, 1)"),
                     {"t": now, "spec": spec})
        conn.execute(sa.text("INSERT INTO step_audits (series_id, step, expected, received, first_seen, verdict, "
                             "audited_at, fault_kinds) VALUES (1, 0, 2, 2, :t, 'incomplete', :t, 'missing_report')"),
                     {"t": now})
        conn.execute(sa.text("INSERT INTO faults (series_id, step, kind, ranks, message, evidence) VALUES "
                             "(1, 0, 'missing_report', '1', 'm', '{}')"))
        conn.execute(sa.text("INSERT INTO series_faults VALUES (1, 'missing_report', 1)"))
        for row in rows:  # (without the expert coordinates of revision 0004, the fingerprint and host of 0011)
            conn.execute(metadata.tables["reports"].insert().values(
                {k: v for k, v in zip(COLUMNS, row) if k not in ("edp", "ep", "etp", "fingerprint", "host")}))
    engine.dispose()
    upgrade(fresh_database_url)
    engine = make_engine(fresh_database_url)
    service = Service.from_engine(engine)
    old = service.report("old-run")  # audited incomplete: never "consistent" (auditor.status)
    assert (old.status, old.consistent) == ("incomplete", False)
    assert service.sweep(grace_seconds=60.0) == 1 and service.sweep(grace_seconds=60.0) == 0
    rep = service.report("old-run")
    (s,) = rep.statistics
    assert rep.consistent is False and (s.steps_inconsistent, s.steps_incomplete) == (1, 0)
    assert s.bad_steps[0].previous_verdict == "incomplete" and "missing_report" not in s.faults
    engine.dispose()


def test_0007_partial_sweep_indexes_and_back(fresh_database_url):
    """Revision 0007 makes the sweep's two step indexes partial (open steps; steps audited
    while reports were missing, in key order) and its downgrade restores the full ones."""
    upgrade(fresh_database_url, "0006")
    engine = make_engine(fresh_database_url)
    full = {"ix_step_audits_open": (("verdict", "first_seen"), False, None),
            "ix_step_audits_complete_at_audit": (("complete_at_audit",), False, None),
            "ix_step_audits_series_verdict_step": (("series_id", "verdict", "step"), False, None)}
    false = "complete_at_audit is 0" if engine.dialect.name == "sqlite" else "complete_at_audit is false"
    partial = {**full, "ix_step_audits_open": (("verdict", "first_seen"), False, "verdict is null"),
               "ix_step_audits_complete_at_audit": (("series_id", "step"), False, false)}
    assert indexes(engine, "step_audits") == full
    upgrade(fresh_database_url, "0007")
    assert indexes(engine, "step_audits") == partial
    downgrade(fresh_database_url, "0006")
    assert indexes(engine, "step_audits") == full
    engine.dispose()
