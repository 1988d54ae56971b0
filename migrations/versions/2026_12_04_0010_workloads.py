"""runs: workload (the label of the workload a run belongs to)

Runs of one workload see the same data per step at different parallel layouts and are
compared step by step (GET /v1/workloads/{workload}, auditor.core.invariance). The label is
optional (NULL before this revision and for runs that give none); it is fixed by the first
report or registration that gives one. Indexed with run_id: a workload's runs are read by
it, in run-id order.

Revision ID: 0010
Revises: 0008
Create Date: 2026-12-04 17:30:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0010'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('workload', sa.String(128)))
        batch.create_index('ix_runs_workload_run_id', ['workload', 'run_id'])


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_index('ix_runs_workload_run_id')
        batch.drop_column('workload')
