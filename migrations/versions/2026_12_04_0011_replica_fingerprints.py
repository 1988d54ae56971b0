"""reports: fingerprint and host (kind 'fingerprint', replica drift)

A ``fingerprint`` report (issue 27, docs/replica-drift.md) carries one tensor's fingerprint
per (series, step, rank): ``reports.fingerprint`` holds it as JSON text ([numel, sum,
sum_sq, p_0 … p_{k-1}] and two digests when exact; NaN/Inf as strings), ``reports.host``
the rank's host when the report names it (findings name the host of a rank out of line).
Both NULL for the reports of the other kinds and for every row stored before.

Revision ID: 0011
Revises: 0008
Create Date: 2026-12-04 17:30:00
"""
import sqlalchemy as sa
from alembic import op


revision = '0011'
down_revision = '0008'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('reports') as batch:
        batch.add_column(sa.Column('fingerprint', sa.Text))
        batch.add_column(sa.Column('host', sa.String(128)))


def downgrade() -> None:
    with op.batch_alter_table('reports') as batch:
        batch.drop_column('host')
        batch.drop_column('fingerprint')
