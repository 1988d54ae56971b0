"""report_drops: the dropped tally each stored report carried (issue 24, re-sends)

A report's ``dropped`` block (reports its client dropped at hand-over before it) was
counted on its series when the report was first stored and then forgotten, so a re-send
that told of more drops was taken for a duplicate and its drops were lost. The tally is
kept per report key: a re-send with the same tally is a duplicate, a higher one counts the
difference, any other is a 409 (auditor.service.dropped). Rows stored before carry no
tally (their re-sends with one count it whole).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06 03:30:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    op.create_table(
        'report_drops',
        sa.Column('series_id', _BIG, nullable=False),
        sa.Column('step', _BIG, nullable=False, autoincrement=False),
        sa.Column('microbatch', sa.Integer, nullable=False, autoincrement=False),
        sa.Column('rank', sa.Integer, nullable=False, autoincrement=False),
        sa.Column('count', _BIG, nullable=False),
        sa.Column('first_step', _BIG, nullable=False),
        sa.Column('last_step', _BIG, nullable=False),
        sa.ForeignKeyConstraint(['series_id'], ['series.id'], name=op.f('fk_report_drops_series_id_series'),
                                ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('series_id', 'step', 'microbatch', 'rank', name=op.f('pk_report_drops')),
    )


def downgrade() -> None:
    op.drop_table('report_drops')
