"""``import auditor.integrations.slime`` audits slime's advantage whitening.

With ``AUDITOR_URL`` set (and ``AUDITOR_RUN_ID``), replaces
``slime.utils.distributed_utils.distributed_masked_whiten`` — in its module and wherever it
was imported by name — with the audited wrapper
(:func:`auditor.integrations.whiten.wrap_distributed_whiten`). Without ``AUDITOR_URL`` it
does nothing. Import it after slime's modules (e.g. at the top of ``train.py``, after the
slime imports). See docs/integrations/slime.md.
"""

from __future__ import annotations

import os

from auditor.integrations import patch
from auditor.integrations.whiten import set_step, step_context  # noqa: F401 - re-exported

TARGET = "slime.utils.distributed_utils.distributed_masked_whiten"

PATCHED = bool(os.environ.get("AUDITOR_URL")) and patch(TARGET)
