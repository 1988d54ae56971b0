"""``import auditor.trainer.slime`` audits slime's advantage whitening (also reachable as
``import auditor.integrations.slime``).

With ``AUDITOR_URL`` set (and ``AUDITOR_RUN_ID``), replaces
``slime.utils.distributed_utils.distributed_masked_whiten`` — in its module and wherever it
was imported by name — with the audited wrapper
(:func:`auditor.trainer.wrap.wrap_distributed_whiten`). Without ``AUDITOR_URL`` it does
nothing. Import it after slime's modules (e.g. at the top of ``train.py``, after the slime
imports). See docs/integrations/slime.md.
"""

from __future__ import annotations

from auditor.trainer.settings import read_settings
from auditor.trainer.wrap import patch, set_step, step_context  # noqa: F401 - re-exported

TARGET = "slime.utils.distributed_utils.distributed_masked_whiten"


PATCHED = read_settings().url is not None and patch(TARGET)
