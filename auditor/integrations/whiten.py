"""Old name of :mod:`auditor.trainer.wrap` (the audited wrapper of an existing whitening)."""

from auditor.trainer.wrap import (  # noqa: F401
    env_client, env_run_id, install_observer, patch, reset, set_step, step_context, wrap_distributed_whiten,
)
