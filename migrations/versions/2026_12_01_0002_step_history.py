"""step history: per-step rounding tolerance, worst sigma per series, listing indexes

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 10:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('step_audits') as b:
        b.add_column(sa.Column('tolerance_sigma', sa.Float(), nullable=True))
    op.create_index('ix_step_audits_series_verdict_step', 'step_audits', ['series_id', 'verdict', 'step'])
    with op.batch_alter_table('series') as b:
        b.add_column(sa.Column('worst_cp_disagreement_sigma', sa.Float(), nullable=True))
        b.add_column(sa.Column('worst_cp_disagreement_step', _BIG, nullable=True))
        b.add_column(sa.Column('worst_applied_error_sigma', sa.Float(), nullable=True))
        b.add_column(sa.Column('worst_applied_error_step', _BIG, nullable=True))
    op.create_index('ix_runs_created_at_run_id', 'runs', ['created_at', 'run_id'])
    # Steps audited before this revision: the worst figures from their stored per-step rows
    # (their tolerance stays NULL: it needs the reports re-audited).
    for col in ('cp_disagreement_sigma', 'applied_error_sigma'):
        op.execute(
            f"UPDATE series SET worst_{col} = (SELECT max(a.{col}) FROM step_audits a WHERE a.series_id = series.id), "
            f"worst_{col.replace('_sigma', '_step')} = (SELECT a.step FROM step_audits a WHERE a.series_id = series.id "
            f"AND a.{col} IS NOT NULL ORDER BY a.{col} DESC, a.step LIMIT 1)")


def downgrade() -> None:
    op.drop_index('ix_runs_created_at_run_id', 'runs')
    with op.batch_alter_table('series') as b:
        for name in ('worst_applied_error_step', 'worst_applied_error_sigma', 'worst_cp_disagreement_step',
                     'worst_cp_disagreement_sigma'):
            b.drop_column(name)
    op.drop_index('ix_step_audits_series_verdict_step', 'step_audits')
    with op.batch_alter_table('step_audits') as b:
        b.drop_column('tolerance_sigma')
