"""SQLAlchemy Core tables. The schema is created by Alembic (``migrations/``), never by
``create_all`` at start-up; keep this file and the newest revision in step.

Timestamps are float Unix seconds (portable across SQLite and PostgreSQL, cheap to compare).
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

BigInt = sa.BigInteger().with_variant(sa.Integer(), "sqlite")

runs = sa.Table(
    "runs",
    metadata,
    sa.Column("run_id", sa.String(128), primary_key=True),
    sa.Column("world_size", sa.Integer, nullable=False),
    sa.Column("dp", sa.Integer, nullable=False),
    sa.Column("cp", sa.Integer, nullable=False),
    sa.Column("tp", sa.Integer, nullable=False),
    sa.Column("pp", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Index("ix_runs_created_at_run_id", "created_at", "run_id"),  # GET /v1/runs keyset pages
    # expert factorisation (NULL: none), rank order and known/unknown topology (DESIGN.md §3.1)
    sa.Column("edp", sa.Integer),
    sa.Column("ep", sa.Integer),
    sa.Column("etp", sa.Integer),
    sa.Column("rank_order", sa.String(32)),
    # where the first report's layout came from (Report.topology_source), informational
    sa.Column("topology_source", sa.String(96)),
    sa.Column("topology", sa.String(16), nullable=False, server_default="known"),
    # the workload label (Report.workload / RunRegistration.workload; NULL: none), the first given
    sa.Column("workload", sa.String(128)),
    sa.Index("ix_runs_workload_run_id", "workload", "run_id"),  # GET /v1/workloads/{workload}
)

# One row per (run, statistic): its kind and spec, and the running aggregates that
# /metrics and the report read instead of scanning verdicts.
series = sa.Table(
    "series",
    metadata,
    sa.Column("id", BigInt, primary_key=True, autoincrement=True),
    sa.Column("run_id", sa.String(128), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
    sa.Column("statistic", sa.String(128), nullable=False),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("spec", sa.JSON, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("updated_at", sa.Float, nullable=False),
    sa.Column("steps_consistent", BigInt, nullable=False, server_default="0"),
    sa.Column("steps_inconsistent", BigInt, nullable=False, server_default="0"),
    sa.Column("steps_incomplete", BigInt, nullable=False, server_default="0"),
    sa.Column("steps_audit_error", BigInt, nullable=False, server_default="0"),
    sa.Column("steps_unverified", BigInt, nullable=False, server_default="0"),
    # Verdicts replaced by a re-audit (a late report completed a step audited while
    # incomplete). steps_<v> counts steps whose *current* verdict is v; steps_<v> +
    # superseded_<v> counts verdicts v ever recorded (monotonic: what /metrics exports).
    sa.Column("superseded_incomplete", BigInt, nullable=False, server_default="0"),
    sa.Column("superseded_inconsistent", BigInt, nullable=False, server_default="0"),
    sa.Column("superseded_audit_error", BigInt, nullable=False, server_default="0"),
    sa.Column("superseded_unverified", BigInt, nullable=False, server_default="0"),
    sa.Column("first_bad_step", BigInt),
    sa.Column("last_bad_step", BigInt),
    sa.Column("last_audited_step", BigInt),
    sa.Column("cp_disagreement_sigma", sa.Float),
    sa.Column("applied_error_sigma", sa.Float),
    # the largest sigma figures of any audited step, and the (first) step that had them
    sa.Column("worst_cp_disagreement_sigma", sa.Float),
    sa.Column("worst_cp_disagreement_step", BigInt),
    sa.Column("worst_applied_error_sigma", sa.Float),
    sa.Column("worst_applied_error_step", BigInt),
    # hang localisation: placed ranks behind the newest reported step, and which ranks
    # reached which step, as of the last step audited incomplete (NULL/0 once in step again)
    sa.Column("ranks_behind", sa.Integer),
    sa.Column("progress", sa.JSON),
    # reports refused with a 409 because they contradicted what this series stores (the run id
    # reused by another run, a rank re-sending different values): how many, their steps, when
    # the last was refused and its conflict kind (conflicting_report, coordinate_conflict, ...)
    sa.Column("refused_reports", BigInt, nullable=False, server_default="0"),
    sa.Column("refused_first_step", BigInt),
    sa.Column("refused_last_step", BigInt),
    sa.Column("refused_at", sa.Float),
    sa.Column("refused_kind", sa.String(32)),
    # reports the trainer's client dropped at hand-over (its ring or queue was full) and told
    # with a later report of this series (wire field ``dropped``, issue 24): how many, their
    # steps. Nonzero: the statistic's audit has gaps, never ``consistent`` (auditor.status)
    sa.Column("reports_dropped", BigInt, nullable=False, server_default="0"),
    sa.Column("dropped_first_step", BigInt),
    sa.Column("dropped_last_step", BigInt),
    sa.UniqueConstraint("run_id", "statistic"),
    sa.Index("ix_series_updated_at", "updated_at"),
)

# reports.series_id and step_audits.series_id: foreign keys on SQLite only; PostgreSQL drops
# them (migration 0006: its per-row check was half the cost of the insert) and the store
# keeps what they guaranteed (Store.lock_series, Store.delete_run_rows).
reports = sa.Table(
    "reports",
    metadata,
    sa.Column("series_id", BigInt, sa.ForeignKey("series.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("step", BigInt, primary_key=True, autoincrement=False),
    sa.Column("microbatch", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("dp", sa.Integer, nullable=False),
    sa.Column("cp", sa.Integer, nullable=False),
    sa.Column("tp", sa.Integer, nullable=False),
    sa.Column("pp", sa.Integer, nullable=False),
    sa.Column("edp", sa.Integer, nullable=False, server_default="0"),
    sa.Column("ep", sa.Integer, nullable=False, server_default="0"),
    sa.Column("etp", sa.Integer, nullable=False, server_default="0"),
    sa.Column("dtype", sa.String(16), nullable=False),
    sa.Column("local_count", sa.Float),
    sa.Column("local_sum", sa.Float),
    sa.Column("local_sum_sq", sa.Float),
    sa.Column("local_min", sa.Float),
    sa.Column("local_max", sa.Float),
    sa.Column("local_replicated_sum_sq", sa.Float),
    sa.Column("applied", sa.Boolean, nullable=False),
    sa.Column("applied_count", sa.Float),
    sa.Column("applied_sum", sa.Float),
    sa.Column("applied_sum_sq", sa.Float),
    sa.Column("applied_mean", sa.Float),
    sa.Column("applied_var", sa.Float),
    sa.Column("non_finite", sa.String(256)),  # fields that were NaN/Inf on the wire (NaN is stored as NULL)
    sa.Column("group_ranks", sa.Text),  # compressed ranges, e.g. "0-3,8-11" (audit.compress_ranks)
    # kind 'fingerprint' (replica drift): the fingerprint as JSON text ([numel, sum, sum_sq, p_0…], NaN/Inf as
    # strings), and the rank's host if it said (revision 0011)
    sa.Column("fingerprint", sa.Text),
    sa.Column("host", sa.String(128)),
    sa.Column("received_at", sa.Float, nullable=False),
    # One rank per coordinate: two ranks claiming the same place in the world are a 409.
    sa.Index("uq_reports_coords", "series_id", "step", "microbatch", "dp", "cp", "tp", "pp", unique=True),
)

# The ``dropped`` block (issue 24) of each stored report that carried one: the client's tally
# of reports it dropped before that report, by the report's key (revision 0012). A re-send
# is compared with it: the same tally is a duplicate, a higher one (more drops since, the
# steps widened) counts the difference, any other a 409 (auditor.service.dropped).
report_drops = sa.Table(
    "report_drops",
    metadata,
    sa.Column("series_id", BigInt, sa.ForeignKey("series.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("step", BigInt, primary_key=True, autoincrement=False),
    sa.Column("microbatch", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("rank", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("count", BigInt, nullable=False),
    sa.Column("first_step", BigInt, nullable=False),
    sa.Column("last_step", BigInt, nullable=False),
)

# One row per (series, step): created by the step's first report, counts arrivals, and
# holds the verdict once audited. The row lock on it makes "audit exactly once" hold
# across concurrent ingest transactions and replicas.
step_audits = sa.Table(
    "step_audits",
    metadata,
    sa.Column("series_id", BigInt, sa.ForeignKey("series.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("step", BigInt, primary_key=True, autoincrement=False),
    sa.Column("expected", sa.Integer, nullable=False),
    sa.Column("received", sa.Integer, nullable=False),
    sa.Column("first_seen", sa.Float, nullable=False),
    sa.Column("verdict", sa.String(16)),  # NULL while the step is open
    sa.Column("audited_at", sa.Float),
    # False when the verdict was recorded while reports were missing (sweep): the report
    # that completes the step re-audits it, once.
    sa.Column("complete_at_audit", sa.Boolean),
    sa.Column("previous_verdict", sa.String(16)),  # the verdict a re-audit replaced
    sa.Column("verdict_changed_at", sa.Float),
    sa.Column("cp_disagreement_sigma", sa.Float),
    sa.Column("applied_error_sigma", sa.Float),
    sa.Column("tolerance_sigma", sa.Float),  # audit.StepVerdict.tolerance_sigma
    sa.Column("fault_kinds", sa.String(256)),  # comma-separated, for listings
    sa.Column("groups", sa.JSON),  # correct statistic per expected group: [[key, mb, count, mean, var]]
    # step history filtered by verdict (GET .../steps?verdict=), keyset-paginated by step
    sa.Index("ix_step_audits_series_verdict_step", "series_id", "verdict", "step"),
)

# The sweep's two indexes are partial (revision 0007): a step row inserted with its verdict
# (complete in hand), or audited with every report, enters neither. Their predicates are the
# very expressions of the sweep's queries (Store.due_steps, Store.reaudit_steps), compiled
# per dialect (SQLite: ``complete_at_audit IS 0``, PostgreSQL: ``IS false``): SQLite uses a
# partial index only for a query whose WHERE contains its predicate term for term.
# ``verdict`` (always NULL here) stays the first column of ix_step_audits_open: SQLite,
# without statistics, takes ``verdict IS NULL`` for an equality on it and searches the
# index by first_seen; on ``(first_seen)`` alone it scanned the primary key in order
# instead, every step of every series. tests/db/test_store.py checks both plans on both
# databases.
_open = step_audits.c.verdict.is_(None)
_incomplete = step_audits.c.complete_at_audit.is_(False)
# open steps by first_seen (Store.due_steps: those past the grace period)
sa.Index("ix_step_audits_open", step_audits.c.verdict, step_audits.c.first_seen,
         sqlite_where=_open, postgresql_where=_open)
# steps audited while reports were missing, in key order (Store.reaudit_steps)
sa.Index("ix_step_audits_complete_at_audit", step_audits.c.series_id, step_audits.c.step,
         sqlite_where=_incomplete, postgresql_where=_incomplete)

faults = sa.Table(
    "faults",
    metadata,
    sa.Column("id", BigInt, primary_key=True, autoincrement=True),
    sa.Column("series_id", BigInt, sa.ForeignKey("series.id", ondelete="CASCADE"), nullable=False),
    sa.Column("step", BigInt, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("ranks", sa.Text, nullable=False),
    sa.Column("message", sa.Text, nullable=False),
    sa.Column("evidence", sa.JSON, nullable=False),
    sa.Index("ix_faults_series_step", "series_id", "step"),
)

series_faults = sa.Table(
    "series_faults",
    metadata,
    sa.Column("series_id", BigInt, sa.ForeignKey("series.id", ondelete="CASCADE"), primary_key=True),
    sa.Column("kind", sa.String(32), primary_key=True),
    sa.Column("count", BigInt, nullable=False),  # faults of the current verdicts
    sa.Column("superseded", BigInt, nullable=False, server_default="0"),  # removed by re-audits
)
