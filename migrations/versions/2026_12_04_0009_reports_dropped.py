"""reports a client dropped at hand-over, per series (issue 24)

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-04 18:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('series') as b:
        b.add_column(sa.Column('reports_dropped', _BIG, nullable=False, server_default='0'))
        b.add_column(sa.Column('dropped_first_step', _BIG))
        b.add_column(sa.Column('dropped_last_step', _BIG))


def downgrade() -> None:
    with op.batch_alter_table('series') as b:
        for name in ('dropped_last_step', 'dropped_first_step', 'reports_dropped'):
            b.drop_column(name)
