"""re-audit of late-completed steps, audit_error verdicts, one rank per coordinate

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 09:40:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('series') as b:
        for name in ('steps_audit_error', 'superseded_incomplete', 'superseded_inconsistent',
                     'superseded_audit_error'):
            b.add_column(sa.Column(name, _BIG, nullable=False, server_default='0'))
    op.create_index('ix_series_updated_at', 'series', ['updated_at'])
    with op.batch_alter_table('step_audits') as b:
        b.add_column(sa.Column('complete_at_audit', sa.Boolean()))
        b.add_column(sa.Column('previous_verdict', sa.String(16)))
        b.add_column(sa.Column('verdict_changed_at', sa.Float()))
    # Steps audited before this revision: judged on missing reports iff their verdict is
    # incomplete or they carry missing_report. The sweep re-audits those that late reports
    # have completed since (they were never re-audited before).
    op.execute("UPDATE step_audits SET complete_at_audit = CASE WHEN verdict = 'incomplete' "
               "OR fault_kinds LIKE '%missing_report%' THEN false ELSE true END WHERE verdict IS NOT NULL")
    op.create_index('ix_step_audits_complete_at_audit', 'step_audits', ['complete_at_audit'])
    with op.batch_alter_table('series_faults') as b:
        b.add_column(sa.Column('superseded', _BIG, nullable=False, server_default='0'))
    # Fails if two ranks already claim one coordinate of a step (accepted before this
    # revision): find them with the query in migrations/README.md and delete one.
    op.create_index('uq_reports_coords', 'reports',
                    ['series_id', 'step', 'microbatch', 'dp', 'cp', 'tp', 'pp'], unique=True)


def downgrade() -> None:
    op.drop_index('uq_reports_coords', table_name='reports')
    with op.batch_alter_table('series_faults') as b:
        b.drop_column('superseded')
    op.drop_index('ix_step_audits_complete_at_audit', table_name='step_audits')
    with op.batch_alter_table('step_audits') as b:
        for name in ('verdict_changed_at', 'previous_verdict', 'complete_at_audit'):
            b.drop_column(name)
    op.drop_index('ix_series_updated_at', table_name='series')
    with op.batch_alter_table('series') as b:
        for name in ('superseded_audit_error', 'superseded_inconsistent', 'superseded_incomplete',
                     'steps_audit_error'):
            b.drop_column(name)
