"""topologies: expert dims, rank order, unknown topology, hang localisation

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 10:30:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('runs') as b:
        for name in ('edp', 'ep', 'etp'):
            b.add_column(sa.Column(name, sa.Integer()))
        b.add_column(sa.Column('rank_order', sa.String(32)))
        b.add_column(sa.Column('topology', sa.String(16), nullable=False, server_default='known'))
    with op.batch_alter_table('reports') as b:
        for name in ('edp', 'ep', 'etp'):
            b.add_column(sa.Column(name, sa.Integer(), nullable=False, server_default='0'))
    with op.batch_alter_table('series') as b:
        b.add_column(sa.Column('ranks_behind', sa.Integer()))
        b.add_column(sa.Column('progress', sa.JSON()))


def downgrade() -> None:
    with op.batch_alter_table('series') as b:
        b.drop_column('progress')
        b.drop_column('ranks_behind')
    with op.batch_alter_table('reports') as b:
        for name in ('etp', 'ep', 'edp'):
            b.drop_column(name)
    with op.batch_alter_table('runs') as b:
        for name in ('topology', 'rank_order', 'etp', 'ep', 'edp'):
            b.drop_column(name)
