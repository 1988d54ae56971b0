"""auditor: audits the statistics distributed trainers all-reduce across parallel ranks.

The trainer API (imported inside training ranks; needs only the standard library, httpx
and torch) is importable from here: ``from auditor import AuditorClient,
distributed_masked_whiten``. Names are resolved on first use, so ``import auditor`` (and
the service side, ``auditor.core`` …) never imports torch.

==============================  ==============================================================
name                            what it is
==============================  ==============================================================
``AuditorClient``               background client: enqueue reports, batch, retry, spool
``client_from_env``             an ``AuditorClient`` from ``AUDITOR_*`` variables (or None)
``distributed_masked_whiten``   slime's whitening, audited (drop-in)
``wrap_distributed_whiten``     audit an existing whitening function without changing it
``set_step``, ``step_context``  the step the wrapped function reports
``audited_sum``                 all-reduce a token-count denominator, audited (``sum``)
``audited_norm_sq``             squared gradient norm over the model-parallel group (``norm``)
``report_statistic``            enqueue one report of any kind
``masked_moments``              a rank's masked moments (the wire ``local`` block)
``Reader``                      read client for notebooks and CI (not for ranks): typed runs,
                                reports, step history (:mod:`auditor.reader`)
``ReaderError``, ``NotFoundError``  what a ``Reader`` call raises instead of a document (404:
                                ``NotFoundError``), naming the URL and what was wrong
``set_topology``                declare the job's sizes and rank order (no Megatron, no mesh)
``set_device_mesh``             read coordinates from a torch ``DeviceMesh`` (torchtitan, FSDP2)
``watch_replicas``              fingerprint replicated parameters and gradients every N steps
                                (replica drift: docs/replica-drift.md)
==============================  ==============================================================
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_TRAINER_API = {
    "AuditorClient": "auditor.trainer.client",
    "client_from_env": "auditor.trainer.client",
    "distributed_masked_whiten": "auditor.trainer.hooks",
    "audited_sum": "auditor.trainer.hooks",
    "audited_norm_sq": "auditor.trainer.hooks",
    "report_statistic": "auditor.trainer.hooks",
    "masked_moments": "auditor.trainer.hooks",
    "wrap_distributed_whiten": "auditor.trainer.wrap",
    "set_step": "auditor.trainer.wrap",
    "step_context": "auditor.trainer.wrap",
    "set_topology": "auditor.trainer.topology",
    "set_device_mesh": "auditor.trainer.mesh",
    "watch_replicas": "auditor.trainer.replicas",
    # not run inside training ranks: the typed read client for notebooks and CI scripts
    "Reader": "auditor.reader",
    "ReaderError": "auditor.reader",
    "NotFoundError": "auditor.reader",
}

__all__ = sorted(_TRAINER_API)


def __getattr__(name: str):
    module = _TRAINER_API.get(name)
    if module is None:
        raise AttributeError(f"module 'auditor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
