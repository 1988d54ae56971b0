"""series: steps_unverified and superseded_unverified; runs: topology_source

A step of a run whose layout is unknown, with no fault found but no group established
either, is recorded ``unverified`` (auditor.core.layoutless), never ``consistent``. The
series keep its count like the other verdicts': ``steps_unverified`` (current verdicts) and
``superseded_unverified`` (replaced by a re-audit). Existing rows start at 0: steps audited
before this revision keep the verdict they were given (an unknown-layout step recorded
``consistent`` stays so until the run is audited again). ``runs.topology_source`` keeps where
the first report's layout came from (``Report.topology_source``; NULL before).

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 21:00:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None

_BIG = sa.BigInteger().with_variant(sa.Integer(), 'sqlite')


def upgrade() -> None:
    with op.batch_alter_table('series') as batch:
        batch.add_column(sa.Column('steps_unverified', _BIG, server_default='0', nullable=False))
        batch.add_column(sa.Column('superseded_unverified', _BIG, server_default='0', nullable=False))
    with op.batch_alter_table('runs') as batch:
        batch.add_column(sa.Column('topology_source', sa.String(96)))


def downgrade() -> None:
    with op.batch_alter_table('runs') as batch:
        batch.drop_column('topology_source')
    with op.batch_alter_table('series') as batch:
        batch.drop_column('superseded_unverified')
        batch.drop_column('steps_unverified')
