"""step_audits: the sweep's two indexes partial

``ix_step_audits_open`` (``verdict, first_seen``) now holds open steps only (``WHERE
verdict IS NULL``) and ``ix_step_audits_complete_at_audit`` only steps audited while
reports were missing (``WHERE complete_at_audit IS FALSE``), keyed ``(series_id, step)``,
the order the sweep reads them in. A step row inserted with its verdict, the common case,
enters neither: 0.80-0.82 of its CPU cost on PostgreSQL (backend), 0.76-0.87 on SQLite
(docs/performance.md, "Fourth round"). The predicates are written as each dialect renders
the sweep's queries (SQLite: ``IS 0``), which SQLite needs to use them.

Both indexes are rebuilt: one scan of ``step_audits`` each, writes to it wait meanwhile.
The downgrade restores the full indexes.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 03:00:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def _where(dialect: str, column: str) -> dict:
    if column == 'verdict':
        sql = 'verdict IS NULL'
    else:
        sql = 'complete_at_audit IS 0' if dialect == 'sqlite' else 'complete_at_audit IS FALSE'
    return {f'{dialect}_where': sa.text(sql)}


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.drop_index('ix_step_audits_open', table_name='step_audits')
    op.drop_index('ix_step_audits_complete_at_audit', table_name='step_audits')
    op.create_index('ix_step_audits_open', 'step_audits', ['verdict', 'first_seen'],
                    **_where(dialect, 'verdict'))
    op.create_index('ix_step_audits_complete_at_audit', 'step_audits', ['series_id', 'step'],
                    **_where(dialect, 'complete_at_audit'))


def downgrade() -> None:
    op.drop_index('ix_step_audits_open', table_name='step_audits')
    op.drop_index('ix_step_audits_complete_at_audit', table_name='step_audits')
    op.create_index('ix_step_audits_open', 'step_audits', ['verdict', 'first_seen'])
    op.create_index('ix_step_audits_complete_at_audit', 'step_audits', ['complete_at_audit'])
