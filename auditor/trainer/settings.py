"""Every ``AUDITOR_*`` variable a training rank reads, in one place, parsed leniently.

A typo in a trainer's environment must never stop training, nor slow it: an invalid value
(not a number, zero or negative where a positive number is needed, an unknown dim) is
logged once per process, naming the variable, the value and what applies instead
(:func:`warn_once`), and the default applies. Read at the moment of use
(:func:`read_settings`), never at import, so a launcher may set the variables after
``import auditor``; what is derived from them per step (the topology) is cached.

==========================  ====================================================================
variable                    meaning
==========================  ====================================================================
``AUDITOR_URL``             service base URL (``http(s)://host:8000``) or ``file:///dir``
                            (write the spool only); unset or empty: no client, no auditing
``AUDITOR_TOKEN``           bearer token sent with every request
``AUDITOR_SPOOL_DIR``       spool directory (default ``~/.cache/auditor/spool``)
``AUDITOR_FLUSH_TIMEOUT``   seconds ``close`` waits for delivery at exit (float)
``AUDITOR_MAX_QUEUE``       most reports held in memory (integer)
``AUDITOR_RUN_ID``          run id of every report (``none``/empty count as unset); else
                            ``TORCHELASTIC_RUN_ID`` unless ``none``, else one agreed per job
                            (:mod:`auditor.trainer.runid`)
``TORCHELASTIC_RUN_ID``     torchrun's rendezvous id (``none`` unless ``--rdzv-id``/standalone)
``AUDITOR_WORKLOAD``        workload label put on every report (runs of one workload at other
                            layouts are compared: GET /v1/workloads/{workload}); a run id's
                            characters, else ignored (said once)
``AUDITOR_STATISTIC``       statistic name of the wrapped whitening (default ``advantages``)
``AUDITOR_TOPOLOGY``        explicit sizes, e.g. ``dp=4,cp=2,tp=2`` (:mod:`auditor.trainer.topology`)
``AUDITOR_RANK_ORDER``      rank order of that topology, fastest dim first (``tp-cp-ep-dp-pp``)
``AUDITOR_MESH_DIMS``       DeviceMesh dim names to contract dims, e.g. ``dp_shard=dp,sp=cp``
``RANK``                    torchrun's global rank, used in spool file names (unset: the
                            initialised process group's rank, else ``rank-unknown``)
==========================  ====================================================================
"""

from __future__ import annotations

import logging
import math
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

log = logging.getLogger("auditor.client")

#: Values that never name a run (torchrun's default ``--rdzv-id`` is ``none``).
RUN_ID_PLACEHOLDERS = frozenset({"", "none", "null"})
#: Megatron-core's default rank order (``initialize_model_parallel(order=...)``).
DEFAULT_RANK_ORDER = "tp-cp-ep-dp-pp"


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args) -> bool:
    """Log ``message % args`` as a warning the first time ``key`` is seen in this process
    (a bad setting is read on every step: it must be said once, not per step). Returns
    whether it was logged."""
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    log.warning(message, *args)
    return True


def usable_run_id(run_id: str | None) -> str | None:
    """``run_id`` stripped, or None if it is unset, empty or a placeholder such as ``none``."""
    if run_id is None:
        return None
    run_id = run_id.strip()
    return None if run_id.lower() in RUN_ID_PLACEHOLDERS else run_id


#: The wire contract's run id (DESIGN.md §3; auditor.contract.names.RUN_ID_PATTERN, 1..128 chars).
#: The service also refuses one made of dots only (``.``, ``..``: auditor.contract.names.addressable,
#: a URL path segment clients and proxies resolve away; no ``/``, so that is its only part).
_WIRE_RUN_ID = re.compile(r"(?=.*[^.])[A-Za-z0-9._:-]{1,128}")


def is_wire_run_id(run_id: str) -> bool:
    """Whether the service can store and address ``run_id`` (the wire contract's run id)."""
    return _WIRE_RUN_ID.fullmatch(run_id) is not None


def _run_id_setting(var: str, raw: str | None) -> str | None:
    """:func:`usable_run_id` of ``raw``, or None (said once) when the service would refuse it
    (every report dead-lettered as a 422): the run id is then agreed per job instead."""
    run_id = usable_run_id(raw)
    if run_id is None or _WIRE_RUN_ID.fullmatch(run_id):
        return run_id
    warn_once(f"{var}={raw}", "auditor: ignoring %s=%r (a run id is 1 to 128 of A-Z a-z 0-9 . _ : -, not only "
              "dots); the ranks agree on a run id instead", var, raw)
    return None


@dataclass(frozen=True)
class TrainerSettings:
    """The trainer side's configuration. ``None``: not set (or malformed).

    The numbers are parsed when read (:attr:`flush_timeout`, :attr:`max_queue`), so a
    malformed one is logged where it is used — once per client created — not on every
    wrapped call that reads the run id.
    """

    url: str | None
    token: str | None
    spool_dir: Path
    run_id: str | None
    statistic: str
    rank: str | None
    raw_flush_timeout: str | None = None
    raw_max_queue: str | None = None
    elastic_run_id: str | None = None
    topology: str | None = None
    rank_order: str = DEFAULT_RANK_ORDER
    mesh_dims: Mapping[str, str] | None = None
    workload: str | None = None

    @property
    def flush_timeout(self) -> float | None:
        """``AUDITOR_FLUSH_TIMEOUT`` in seconds (≥ 0); None when unset or invalid."""
        return _number("AUDITOR_FLUSH_TIMEOUT", self.raw_flush_timeout, float, minimum=0.0)

    @property
    def max_queue(self) -> int | None:
        """``AUDITOR_MAX_QUEUE`` (an integer ≥ 1; ``1e4`` is accepted); None when unset or invalid."""
        return _number("AUDITOR_MAX_QUEUE", self.raw_max_queue, lambda v: int(float(v)), minimum=1)


def _number(var: str, raw: str | None, cast, minimum: float):
    """``cast(raw)`` if it is a finite number ≥ ``minimum``; else None (the default applies),
    said once per process."""
    if raw is None or not raw.strip():
        return None
    try:
        value = cast(raw.strip())
        ok = math.isfinite(value) and value >= minimum
    except (ValueError, OverflowError):
        ok = False
    if ok:
        return value
    warn_once(f"{var}={raw}", "auditor: ignoring %s=%r (must be a number >= %g); using the default", var, raw,
              minimum)
    return None


def valid_number(name: str, value, default, minimum: float, integer: bool = False):
    """``value`` if it is a finite number ≥ ``minimum`` (an integer if ``integer``), else
    ``default`` with one warning naming ``name``: a client argument that cannot work
    (``max_queue=0`` would drop every report) falls back instead of raising in the trainer.
    A number that is not an integer is a duration in seconds: above ``threading.TIMEOUT_MAX``
    (~292 years) every wait on it raises OverflowError, so it falls back too."""
    try:
        ok = (not isinstance(value, bool) and math.isfinite(value) and value >= minimum
              and (not integer or float(value).is_integer()))
    except TypeError:
        ok = False
    if ok and not integer and value > threading.TIMEOUT_MAX:
        warn_once(f"{name}={value!r}", "auditor client: ignoring %s=%r (seconds, at most %g); using %r", name, value,
                  threading.TIMEOUT_MAX, default)
        return default
    if ok:
        return int(value) if integer else value
    warn_once(f"{name}={value!r}", "auditor client: ignoring %s=%r (must be %s >= %g); using %r", name, value,
              "an integer" if integer else "a number", minimum, default)
    return default


#: The variables :func:`read_settings` reads (``HOME``: the default spool directory).
_VARIABLES = ("AUDITOR_URL", "AUDITOR_TOKEN", "AUDITOR_SPOOL_DIR", "AUDITOR_RUN_ID", "AUDITOR_STATISTIC", "RANK",
              "AUDITOR_FLUSH_TIMEOUT", "AUDITOR_MAX_QUEUE", "TORCHELASTIC_RUN_ID", "AUDITOR_TOPOLOGY",
              "AUDITOR_RANK_ORDER", "AUDITOR_MESH_DIMS", "AUDITOR_WORKLOAD", "HOME")
_last: tuple[tuple, "TrainerSettings"] | None = None


def _environment_key() -> tuple:
    """The raw values of :data:`_VARIABLES` now (compared, never parsed): read from
    ``os.environ``'s own mapping with the keys encoded once (a dozen dict lookups, ~1 µs,
    instead of ``os.environ.get``'s encode and decode per variable, ~9 µs per call)."""
    data, keys = _RAW
    if data is None:
        return tuple([os.environ.get(v) for v in _VARIABLES])
    return tuple([data.get(k) for k in keys])


#: ``os.environ``'s underlying mapping (every change to ``os.environ`` lands in it) and the
#: encoded keys; (None, None) on an interpreter without them.
_RAW = ((os.environ._data, [os.environ.encodekey(v) for v in _VARIABLES])  # noqa: SLF001
        if hasattr(os.environ, "_data") and hasattr(os.environ, "encodekey") else (None, None))


def read_settings(env: Mapping[str, str] | None = None) -> TrainerSettings:
    """The settings in ``env`` (default ``os.environ``) now. Called on every step by the
    hooks: with ``os.environ`` the parsed settings are reused while the variables' values
    are unchanged (a dozen lookups, not a parse)."""
    global _last
    if env is None:
        key = _environment_key()
        last = _last
        if last is not None and last[0] == key:
            return last[1]
        settings = _parse(os.environ)
        _last = (key, settings)
        return settings
    return _parse(env)


def _parse(env: Mapping[str, str]) -> TrainerSettings:
    mesh = {}
    raw_mesh = env.get("AUDITOR_MESH_DIMS") or ""
    for part in filter(None, (p.strip() for p in raw_mesh.split(","))):
        name, eq, dim = part.partition("=")
        if not (eq and name.strip() and dim.strip()):
            warn_once(f"AUDITOR_MESH_DIMS={raw_mesh}", "auditor: ignoring %r of AUDITOR_MESH_DIMS=%r (expected "
                      "mesh_dim_name=dim, e.g. dp_shard=dp)", part, raw_mesh)
            continue
        mesh[name.strip()] = dim.strip()
    return TrainerSettings(
        url=(env.get("AUDITOR_URL") or "").strip() or None,
        token=env.get("AUDITOR_TOKEN") or None,
        spool_dir=Path(env.get("AUDITOR_SPOOL_DIR") or Path.home() / ".cache" / "auditor" / "spool"),
        run_id=_run_id_setting("AUDITOR_RUN_ID", env.get("AUDITOR_RUN_ID")),
        statistic=env.get("AUDITOR_STATISTIC") or "advantages",
        rank=(env.get("RANK") or "").strip() or None,
        raw_flush_timeout=env.get("AUDITOR_FLUSH_TIMEOUT"),
        raw_max_queue=env.get("AUDITOR_MAX_QUEUE"),
        elastic_run_id=_run_id_setting("TORCHELASTIC_RUN_ID", env.get("TORCHELASTIC_RUN_ID")),
        topology=(env.get("AUDITOR_TOPOLOGY") or "").strip() or None,
        rank_order=(env.get("AUDITOR_RANK_ORDER") or "").strip() or DEFAULT_RANK_ORDER,
        mesh_dims=mesh,
        workload=_workload_setting(env.get("AUDITOR_WORKLOAD")),
    )


def _workload_setting(raw: str | None) -> str | None:
    """``AUDITOR_WORKLOAD`` stripped (unset or empty: None); one the service would refuse
    (not a run id's characters, DESIGN.md §3) is ignored, said once, so that no report is
    refused for it."""
    label = (raw or "").strip() or None
    if label is None or _WIRE_RUN_ID.fullmatch(label):
        return label
    warn_once(f"AUDITOR_WORKLOAD={raw}", "auditor: ignoring AUDITOR_WORKLOAD=%r (a workload is 1 to 128 of A-Z a-z "
              "0-9 . _ : -, not only dots); reports carry no workload", raw)
    return None
