"""The races a store statement can lose, raised for the caller to retry its transaction.

Each is answered by one row of the ingest's retry table (``auditor.service.ingest.RETRY``):
the caller rolls its transaction back and tries the batch again in another mode. Not
driver errors (their translation is another module's): these are the store's own verdicts
on what a statement found.
"""

from __future__ import annotations


class RowDeleted(Exception):
    """A run or series row an ``INSERT ... ON CONFLICT DO NOTHING`` found was gone by the
    next statement: a concurrent ``DELETE /v1/runs/{run_id}`` committed in between. The
    caller's transaction is rolled back and tried again (``auditor.service.ingest.RETRY``)."""


class ReportsExist(Exception):
    """:meth:`Store.insert_all_new` met a stored report (its key, or its coordinates in its
    step): the caller's transaction is rolled back (part of the batch may be inserted; on
    PostgreSQL the unique violation aborted it) and the batch ingested again with
    :meth:`Store.insert_returning`, which finds out report by report (``Service.ingest``)."""


class StepRowExists(Exception):
    """A step row :meth:`Store.record_verdicts` was to INSERT with its verdict (a ``fresh``
    item, :class:`CleanSteps`) existed after all: the caller's transaction is rolled back
    and the batch ingested again the general way (``auditor.service.ingest.RETRY``)."""
