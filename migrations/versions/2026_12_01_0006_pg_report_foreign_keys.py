"""PostgreSQL: reports and step_audits without their foreign keys to series

PostgreSQL checks a foreign key with one ``SELECT ... FOR KEY SHARE`` of the referenced
row per inserted row (its RI trigger): 3.3 us of backend time per report and per step row,
half of what inserting them costs (docs/performance.md "Third round"). What the two keys
guaranteed is now kept once per batch instead (``Store.lock_series``: every ingest holds
its series rows ``FOR KEY SHARE`` until it commits, so a run deleted meanwhile is seen and
the batch retried) and by ``Store.delete_run_rows`` (deletes the run's reports and step
rows explicitly, after taking its series rows). SQLite keeps both keys: there they cost
0.08 us per row and every write transaction holds the database lock.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 20:00:00
"""
from alembic import op


revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None

_KEYS = (('reports', 'fk_reports_series_id_series'), ('step_audits', 'fk_step_audits_series_id_series'))


def upgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    for table, name in _KEYS:
        op.drop_constraint(name, table, type_='foreignkey')


def downgrade() -> None:
    if op.get_bind().dialect.name != 'postgresql':
        return
    # rows a deletion raced past (none, if the code above held) would make the key invalid
    for table, _ in _KEYS:
        op.execute(f'DELETE FROM {table} t WHERE NOT EXISTS (SELECT 1 FROM series s WHERE s.id = t.series_id)')
    for table, name in _KEYS:
        op.create_foreign_key(name, table, 'series', ['series_id'], ['id'], ondelete='CASCADE')
