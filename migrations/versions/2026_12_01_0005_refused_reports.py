"""refused conflicting reports per series

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 17:00:00
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('series') as b:
        b.add_column(sa.Column('refused_reports', _BIG, nullable=False, server_default='0'))
        b.add_column(sa.Column('refused_first_step', _BIG))
        b.add_column(sa.Column('refused_last_step', _BIG))
        b.add_column(sa.Column('refused_at', sa.Float()))
        b.add_column(sa.Column('refused_kind', sa.String(32)))


def downgrade() -> None:
    with op.batch_alter_table('series') as b:
        for name in ('refused_kind', 'refused_at', 'refused_last_step', 'refused_first_step', 'refused_reports'):
            b.drop_column(name)
