"""The trainer side: imported inside training ranks; the standard library, httpx and torch only.

:mod:`~auditor.trainer.settings` (every ``AUDITOR_*`` variable a rank reads),
:mod:`~auditor.trainer.client` (queue, sender and spill threads),
:mod:`~auditor.trainer.handover` (the training thread's side of the client: ring and queue),
:mod:`~auditor.trainer.destination` (the service or the spool only: URL and token checks),
:mod:`~auditor.trainer.delivery` (the one POST/retry loop), :mod:`~auditor.trainer.spool`
(the JSONL spool file format), :mod:`~auditor.trainer.report` (the one wire-dict builder),
:mod:`~auditor.trainer.hooks` (masked moments, slime's mean/variance, audited collectives),
:mod:`~auditor.trainer.deferred` (a report's numbers handed over on the device, read on the
sender thread),
:mod:`~auditor.trainer.wrap` (audit an existing whitening function),
:mod:`~auditor.trainer.megatron` (this rank's coordinates), :mod:`~auditor.trainer.slime`
(one-import activation for slime). Nothing here imports the service side
(``auditor.core``, ``db``, ``service``, ``server``); the import-linter contracts in
``pyproject.toml`` check it.
"""
