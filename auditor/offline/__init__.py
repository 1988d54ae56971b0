"""Spools without a live service: ``auditor import`` (upload them) and ``auditor audit``
(audit them locally with the service's own flows).

Both stream the spool files through :class:`auditor.trainer.spool.SpoolReader`: the files
(one per rank, as trainers leave them, or one interleaved file) are merged line by line so
that the reports of a step travel together, and cut into batches between steps. A batch is
then what one ``POST /v1/reports`` carries: uploads go through the trainer side's one
delivery loop (:func:`auditor.trainer.delivery.deliver`), offline audits decode it as the
service decodes a request body (:func:`auditor.contract.parse.parse_report_batch`) and store it with
:meth:`auditor.service.Service.ingest` on a local database, which audits every step the batch
completes from the rows in hand. Memory is bounded by the batch size — one batch plus one
line per file; two with the reader process of ``audit``, three with the read-ahead thread
of ``import`` — whatever the size of the spools.

Modules: :mod:`~auditor.offline.spools` (vetting a spool, the longest line either command
takes), :mod:`~auditor.offline.skipped` (naming the lines skipped), :mod:`~auditor.offline.importer`
(``auditor import``) and :mod:`~auditor.offline.audit` (``auditor audit``); the reader process
of ``audit`` is :mod:`auditor.offline_reader`, which imports the spool format only.
"""

from auditor.offline.audit import GC_THRESHOLDS, READER_PROCESS_BYTES, audit_offline
from auditor.offline.importer import ServiceConfigError, Unreachable, read_ahead, upload
from auditor.offline.skipped import MAX_INVALID_LOGGED, invalid_reason
from auditor.offline.spools import MAX_REPORT_LINE_BYTES, SNIFF_BYTES, SNIFF_LINES, Progress, vet_spools
from auditor.offline_reader import SpoolError

__all__ = [
    "GC_THRESHOLDS", "MAX_INVALID_LOGGED", "MAX_REPORT_LINE_BYTES", "READER_PROCESS_BYTES", "SNIFF_BYTES",
    "SNIFF_LINES", "Progress", "ServiceConfigError", "SpoolError", "Unreachable", "audit_offline", "invalid_reason",
    "read_ahead", "upload", "vet_spools",
]
