"""The run id of a training job, agreed by all its ranks (DESIGN.md §3.1, "Run ids from hooks").

Order: an explicit id (a hook's ``run_id=``), ``AUDITOR_RUN_ID``, ``TORCHELASTIC_RUN_ID``
unless it is empty or ``none`` (torchrun's default whenever a fixed ``--master-port`` or a
multi-node static rendezvous is used, so every such job would share it), else an id derived
once per job: the first rank that needs one proposes ``auditor-<UTC yyyymmdd-HHMMSS>-<8 hex>``
with ``compare_set`` on the default process group's store, and every rank uses what the
store holds. The store lives as long as the job, so all ranks agree and a second job gets a
new id. Rank 0 logs the id once. ``none`` and the empty string are never used.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from auditor.trainer.settings import read_settings, usable_run_id

log = logging.getLogger("auditor.runid")

#: Store key under which the derived run id is agreed.
STORE_KEY = "auditor/run_id"

_lock = threading.Lock()
_derived: str | None = None
_logged = False


def resolve_run_id(explicit: str | None = None) -> str | None:
    """The run id this rank reports under (see the module docstring), or None when none can
    be had (no id configured and no initialised default process group): the hooks then send
    nothing and log why, once. Never raises."""
    conf = read_settings()
    for candidate in (usable_run_id(explicit), conf.run_id, conf.elastic_run_id):
        if candidate is not None:
            return candidate
    return _derive()


def _derive() -> str | None:
    import torch.distributed as dist  # here: `auditor check` imports this module without torch

    global _derived, _logged
    with _lock:
        if _derived is not None:
            return _derived
        if not (dist.is_available() and dist.is_initialized()):
            return None
        try:
            store = dist.distributed_c10d._get_default_store()
            proposal = f"auditor-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"
            agreed = store.compare_set(STORE_KEY, "", proposal)
            _derived = (agreed.decode() if isinstance(agreed, bytes) else str(agreed)) or proposal
        except Exception:  # noqa: BLE001 - no store: no id, never a guess
            log.exception("auditor: no AUDITOR_RUN_ID and the process group's store cannot agree on one; "
                          "not reporting (set AUDITOR_RUN_ID to the same value on every rank)")
            return None
        if dist.get_rank() == 0 and not _logged:
            _logged = True
            log.warning("auditor: run id %s (no AUDITOR_RUN_ID given; derived once for this job, "
                        "check it with `auditor check %s`)", _derived, _derived)
        return _derived


def reset() -> None:
    """Forget the derived id (tests, or a process that starts a second job)."""
    global _derived, _logged
    with _lock:
        _derived, _logged = None, False
