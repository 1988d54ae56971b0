"""Drop-in hooks for real trainers: Megatron-core coordinates (:mod:`.megatron`), an audited
wrapper for an existing ``distributed_masked_whiten`` (:mod:`.whiten`), and one-import
activation per framework (:mod:`.slime`). See docs/integrations/."""

from __future__ import annotations

import importlib
import logging
import sys

log = logging.getLogger("auditor.integrations")


def patch(target: str, **kwargs) -> bool:
    """Replace the function at dotted path ``target`` (``package.module.function``) with
    :func:`~auditor.integrations.whiten.wrap_distributed_whiten` of it, in its module and in
    every already-imported module that bound the same function by name (``from m import f``).
    ``kwargs`` go to the wrapper. Returns False (and logs) if the module cannot be imported."""
    from auditor.integrations.whiten import wrap_distributed_whiten

    module_name, _, attr = target.rpartition(".")
    try:
        module = importlib.import_module(module_name)
        original = getattr(module, attr)
    except (ImportError, AttributeError) as e:
        log.warning("auditor: cannot patch %s: %s", target, e)
        return False
    wrapped = wrap_distributed_whiten(original, **kwargs)
    for mod in list(sys.modules.values()):
        try:
            if getattr(mod, attr, None) is original:
                setattr(mod, attr, wrapped)
        except Exception:  # noqa: BLE001 - odd modules (lazy proxies) are skipped
            continue
    return True
