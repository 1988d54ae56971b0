"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-29 16:05:57.460662
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('runs',
    sa.Column('run_id', sa.String(length=128), nullable=False),
    sa.Column('world_size', sa.Integer(), nullable=False),
    sa.Column('dp', sa.Integer(), nullable=False),
    sa.Column('cp', sa.Integer(), nullable=False),
    sa.Column('tp', sa.Integer(), nullable=False),
    sa.Column('pp', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('run_id', name=op.f('pk_runs'))
    )
    op.create_table('series',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=128), nullable=False),
    sa.Column('statistic', sa.String(length=128), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('steps_consistent', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('steps_inconsistent', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('steps_incomplete', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), server_default='0', nullable=False),
    sa.Column('first_bad_step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('last_bad_step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('last_audited_step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=True),
    sa.Column('cp_disagreement_sigma', sa.Float(), nullable=True),
    sa.Column('applied_error_sigma', sa.Float(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['runs.run_id'], name=op.f('fk_series_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_series')),
    sa.UniqueConstraint('run_id', 'statistic', name=op.f('uq_series_run_id_statistic'))
    )
    op.create_table('faults',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('series_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('ranks', sa.Text(), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('evidence', sa.JSON(), nullable=False),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_faults_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_faults'))
    )
    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.create_index('ix_faults_series_step', ['series_id', 'step'], unique=False)

    op.create_table('reports',
    sa.Column('series_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=False, nullable=False),
    sa.Column('microbatch', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('rank', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('dp', sa.Integer(), nullable=False),
    sa.Column('cp', sa.Integer(), nullable=False),
    sa.Column('tp', sa.Integer(), nullable=False),
    sa.Column('pp', sa.Integer(), nullable=False),
    sa.Column('dtype', sa.String(length=16), nullable=False),
    sa.Column('local_count', sa.Float(), nullable=True),
    sa.Column('local_sum', sa.Float(), nullable=True),
    sa.Column('local_sum_sq', sa.Float(), nullable=True),
    sa.Column('local_min', sa.Float(), nullable=True),
    sa.Column('local_max', sa.Float(), nullable=True),
    sa.Column('local_replicated_sum_sq', sa.Float(), nullable=True),
    sa.Column('applied', sa.Boolean(), nullable=False),
    sa.Column('applied_count', sa.Float(), nullable=True),
    sa.Column('applied_sum', sa.Float(), nullable=True),
    sa.Column('applied_sum_sq', sa.Float(), nullable=True),
    sa.Column('applied_mean', sa.Float(), nullable=True),
    sa.Column('applied_var', sa.Float(), nullable=True),
    sa.Column('non_finite', sa.String(length=256), nullable=True),
    sa.Column('group_ranks', sa.Text(), nullable=True),
    sa.Column('received_at', sa.Float(), nullable=False),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_reports_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'step', 'microbatch', 'rank', name=op.f('pk_reports'))
    )
    op.create_table('series_faults',
    sa.Column('series_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('kind', sa.String(length=32), nullable=False),
    sa.Column('count', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_series_faults_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'kind', name=op.f('pk_series_faults'))
    )
    op.create_table('step_audits',
    sa.Column('series_id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('step', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=False, nullable=False),
    sa.Column('expected', sa.Integer(), nullable=False),
    sa.Column('received', sa.Integer(), nullable=False),
    sa.Column('first_seen', sa.Float(), nullable=False),
    sa.Column('verdict', sa.String(length=16), nullable=True),
    sa.Column('audited_at', sa.Float(), nullable=True),
    sa.Column('cp_disagreement_sigma', sa.Float(), nullable=True),
    sa.Column('applied_error_sigma', sa.Float(), nullable=True),
    sa.Column('fault_kinds', sa.String(length=256), nullable=True),
    sa.Column('groups', sa.JSON(), nullable=True),
    sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_step_audits_series_id_series'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('series_id', 'step', name=op.f('pk_step_audits'))
    )
    with op.batch_alter_table('step_audits', schema=None) as batch_op:
        batch_op.create_index('ix_step_audits_open', ['verdict', 'first_seen'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('step_audits', schema=None) as batch_op:
        batch_op.drop_index('ix_step_audits_open')

    op.drop_table('step_audits')
    op.drop_table('series_faults')
    op.drop_table('reports')
    with op.batch_alter_table('faults', schema=None) as batch_op:
        batch_op.drop_index('ix_faults_series_step')

    op.drop_table('faults')
    op.drop_table('series')
    op.drop_table('runs')
