"""Audit a trainer's *own* distributed whitening function without changing its code.

:func:`wrap_distributed_whiten` wraps any function with slime's signature
``fn(values, mask, process_group=None, shift_mean=True, epsilon=1e-8)`` that all-reduces
masked moments and returns whitened values. Each call enqueues one report (wire contract v1,
DESIGN.md §3) with:

* ``local``: this rank's masked moments of ``values`` (float64, :func:`auditor.trainer.hooks.moments_payload`);
* ``applied.count/sum/sum_sq``: what the function's all-reduce *returned*. While ``fn``
  runs, ``torch.distributed.all_reduce`` (the module attribute) is observed on this thread;
  a 3-element all-reduce is read in slime's order ``[Σv·m, Σv²·m, Σm]``, and its ``group``
  gives ``group_ranks`` — the group the function really reduced over, whatever it was
  passed. If ``fn`` reached ``all_reduce`` through a name bound before the wrapper was
  installed (``from torch.distributed import all_reduce``), nothing is observed: the
  wrapper then re-reduces float64 ``[Σm, Σv·m, Σv²·m]`` over ``process_group`` (one extra
  3-element all-reduce, same participants as ``fn``'s; ``reduce_fallback=False`` skips it
  and reports no sums);
* ``applied.mean/var``: what the function *whitened with*, read off its output. With
  ``w = (v − μ)·rsqrt(var + ε)`` (``+ μ`` if not ``shift_mean``) the masked elements with the
  smallest and largest value give the slope ``r = Δw/Δv`` and then ``μ`` and
  ``var = 1/r² − ε`` in float64. Exactness: the outputs are float32, so ``r`` carries a
  relative error of ≈2⁻²³ (one rounding of each output, over Δw ≥ |w| at the extremes) and
  ``μ`` an error of ≈2⁻²³·σ — far inside the auditor's float32 tolerance. When the observed
  float32 sums reproduce the output under slime's formula (agreement within 1e-6 relative
  on r and on μ/σ), the exact float32 values of that formula are reported instead. With
  fewer than two distinct masked values on this rank the slope is undefined and mean/var
  come from the observed sums (slime's formula, float32).
  The agreement allowed grows with the output's rounding where it is coarser than that:
  2·eps·(|w₀| + |w₁|)/|w₁ − w₀| relative on r (eps of the output dtype; a bfloat16 output
  resolves r to ~2⁻⁷, not 1e-6).
* ``dtype``: unless given, the coarsest of ``values``' dtype and the observed all-reduce's
  (:func:`auditor.trainer.hooks.wire_dtype`), and the output's when mean/var were read off
  it: slime's function forms its sums in the values' dtype, so with bfloat16 values the
  statistics have bfloat16 precision whatever dtype the 3-element vector is reduced in
  (float32 values: ``float32``, as before). A function that widens its inputs before
  summing (as :func:`auditor.trainer.hooks.distributed_masked_whiten` does) reduces in
  float32: pass ``dtype="float32"``.

The step comes from :func:`set_step` / :func:`step_context` if the trainer sets it, else
from a per-statistic call counter (the k-th call is step k). Configuration by environment,
read like every trainer entry point does (:mod:`auditor.trainer.settings`): ``AUDITOR_URL``
(service URL or ``file:///dir``), ``AUDITOR_TOKEN``, ``AUDITOR_STATISTIC`` (default
``advantages``); the run id is :func:`auditor.trainer.runid.resolve_run_id`'s
(``AUDITOR_RUN_ID``, else ``TORCHELASTIC_RUN_ID`` unless ``none``, else one agreed per job).
Without ``AUDITOR_URL`` or a run id the wrapper just calls ``fn``.
Nothing the wrapper does can raise into training: every failure is logged and ``fn``'s
result (or exception) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from auditor.trainer.client import AuditorClient, client_from_env
from auditor.trainer.hooks import MOMENTS, moments_block, moments_payload, slime_mean_var, submit, wire_dtype
from auditor.trainer.report import build_report
from auditor.trainer.runid import resolve_run_id
from auditor.trainer.settings import read_settings

log = logging.getLogger("auditor.integrations")

_state = threading.local()
_step_lock = threading.Lock()
_explicit_step: dict[str, Any] = {}
_call_counts: dict[str, int] = {}
_env_client: AuditorClient | None = None
_env_client_ready = False


# ------------------------------------------------------------------------------ step
def set_step(step: int, microbatch: int = 0, num_microbatches: int = 1) -> None:
    """Set the (step, microbatch) the next wrapped calls report, for every statistic.
    Call it once per training step (e.g. next to ``optimizer.step()``)."""
    with _step_lock:
        _explicit_step.update(step=int(step), microbatch=int(microbatch), num_microbatches=int(num_microbatches))


@contextlib.contextmanager
def step_context(step: int, microbatch: int = 0, num_microbatches: int = 1) -> Iterator[None]:
    """``with step_context(step):`` — :func:`set_step` for the block, restored afterwards."""
    with _step_lock:
        saved = dict(_explicit_step)
    set_step(step, microbatch, num_microbatches)
    try:
        yield
    finally:
        with _step_lock:
            _explicit_step.clear()
            _explicit_step.update(saved)


def _next_step(statistic: str) -> tuple[int, int, int]:
    with _step_lock:
        if _explicit_step:
            return _explicit_step["step"], _explicit_step["microbatch"], _explicit_step["num_microbatches"]
        n = _call_counts.get(statistic, 0)
        _call_counts[statistic] = n + 1
        return n, 0, 1


def step_for(key: str) -> int:
    """The step a report of ``key`` (a statistic, or a hook's own key) belongs to now:
    :func:`set_step`'s, else the number of earlier calls for ``key`` (counted)."""
    return _next_step(key)[0]


def reset() -> None:
    """Forget the step set with :func:`set_step` and the call counters (tests)."""
    with _step_lock:
        _explicit_step.clear()
        _call_counts.clear()


def env_client() -> AuditorClient | None:
    """The process-wide client configured by ``AUDITOR_*`` variables (created on first use)."""
    global _env_client, _env_client_ready
    if not _env_client_ready:
        with _step_lock:
            if not _env_client_ready:
                try:
                    _env_client = client_from_env()
                except Exception:  # noqa: BLE001
                    log.exception("auditor: could not create the client from the environment")
                _env_client_ready = True
    return _env_client


def env_run_id() -> str | None:
    """The job's run id (:func:`auditor.trainer.runid.resolve_run_id`; never ``none``)."""
    return resolve_run_id()


# ------------------------------------------------------------------- all_reduce observer
_original_all_reduce = None
_install_lock = threading.Lock()


def _observing_all_reduce(tensor, *args, **kwargs):
    work = _original_all_reduce(tensor, *args, **kwargs)
    seen = getattr(_state, "seen", None)
    if seen is not None:
        try:
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
            snapshot = tensor if async_op else tensor.detach().clone()
            seen.append((snapshot, group, work if async_op else None))
        except Exception:  # noqa: BLE001
            pass
    return work


def install_observer() -> None:
    """Route ``torch.distributed.all_reduce`` through a pass-through that records, on threads
    inside a wrapped call only, each reduced tensor and its group. Idempotent."""
    global _original_all_reduce
    with _install_lock:
        if _original_all_reduce is None:
            _original_all_reduce = dist.all_reduce
            dist.all_reduce = functools.wraps(_original_all_reduce)(_observing_all_reduce)


# ------------------------------------------------------------------------------ wrapper
def wrap_distributed_whiten(
    fn: Callable[..., torch.Tensor],
    *,
    client: AuditorClient | None = None,
    run_id: str | None = None,
    statistic: str | None = None,
    dtype: str | None = None,
    reduce_fallback: bool = True,
) -> Callable[..., torch.Tensor]:
    """``fn`` with the same signature and results, each call audited (see the module docstring).

    Parameters
    ----------
    fn:
        ``fn(values, mask, process_group=None, shift_mean=True, epsilon=1e-8) -> Tensor``;
        ``values`` any shape, floating; ``mask`` same shape, bool or floating.
    client, run_id, statistic:
        Default to :func:`env_client`, :func:`env_run_id`, ``$AUDITOR_STATISTIC`` or
        ``"advantages"``.
    dtype:
        Precision of the statistics ``fn`` reduces and whitens with (wire ``dtype``); None
        (default): per call, the coarsest of ``values``', the output's and the observed
        all-reduce's dtype (see the module docstring).
    reduce_fallback:
        Re-reduce over ``process_group`` when ``fn``'s all-reduce cannot be observed.

    Examples
    --------
    Wrap a trainer's own whitening (here auditor's copy of slime's) and audit each call;
    the report says what the function's all-reduce returned and what it whitened with.

    >>> import json, pathlib, tempfile, torch, torch.distributed as dist
    >>> from auditor import AuditorClient, distributed_masked_whiten, set_step, wrap_distributed_whiten
    >>> spool = tempfile.mkdtemp()
    >>> client = AuditorClient("file://" + spool, rank=0)
    >>> whiten = wrap_distributed_whiten(distributed_masked_whiten, client=client, run_id="doc")
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> set_step(7)
    >>> w = whiten(torch.tensor([1.5, -0.5, -1.0]), torch.ones(3))
    >>> client.close(); dist.destroy_process_group()
    >>> (line,) = next(pathlib.Path(spool).glob("*.jsonl")).read_text().splitlines()
    >>> report = json.loads(line)
    >>> report["step"], report["applied"]["count"], round(report["applied"]["var"], 6), report["group_ranks"]
    (7, 3.0, 1.75, [0])
    """
    if getattr(fn, "__auditor_wrapped__", False):
        return fn
    install_observer()
    return _audited(fn, client, run_id, statistic, dtype, reduce_fallback)


def _audited(fn, client, run_id, statistic, dtype, reduce_fallback) -> Callable[..., torch.Tensor]:
    """The audited ``fn``: each call observed and reported when a client, a run id and a
    process group are there (and not inside another audited call), else ``fn`` itself."""
    @functools.wraps(fn)
    def audited(values, mask, process_group=None, shift_mean=True, epsilon=1e-8, *args, **kwargs):
        cl = client or env_client()
        rid = run_id or env_run_id()
        if cl is None or rid is None or not (dist.is_available() and dist.is_initialized()) \
                or getattr(_state, "seen", None) is not None:
            return fn(values, mask, process_group, shift_mean, epsilon, *args, **kwargs)
        stat = statistic or read_settings().statistic
        _state.seen = []
        error: BaseException | None = None
        out = None
        try:
            out = fn(values, mask, process_group, shift_mean, epsilon, *args, **kwargs)
        except BaseException as e:  # reported, then re-raised unchanged
            error = e
        finally:
            seen, _state.seen = _state.seen, None
        try:
            _report(cl, rid, stat, dtype, values, mask, process_group, shift_mean, epsilon, out, seen,
                    reduce_fallback and error is None)
        except Exception:  # noqa: BLE001 - never into training
            log.exception("auditor: could not audit %s", stat)
        if error is not None:
            raise error
        return out

    audited.__auditor_wrapped__ = True  # type: ignore[attr-defined]
    audited.__wrapped__ = fn  # type: ignore[attr-defined]
    return audited


def _report(cl, run_id, statistic, dtype, values, mask, group, shift_mean, epsilon, out, seen, fallback) -> None:
    """Enqueue the report of one wrapped call. On this (the training) thread only device
    work: the moments, the observed (or re-reduced) sums and the output at the extreme
    masked values go into one float64 tensor; :func:`_blocks` reads it on the sender thread."""
    step, microbatch, num_microbatches = _next_step(statistic)
    triples = [(t, g, w) for t, g, w in seen if t.numel() == 3]
    observed, reduced_group, work = triples[-1] if triples else (None, group, None)
    body = build_report(run_id=run_id, statistic=statistic, step=step, microbatch=microbatch,
                        num_microbatches=num_microbatches, local=None, applied=None, group=reduced_group,
                        dtype="float32")
    if body is None:
        return
    local, at = moments_payload(values, mask, extremes_at=True)
    parts = [local]
    sums_dtype = None  # the observed all-reduce's dtype; None: not observed
    if observed is not None:
        if work is not None:
            work.wait()
        sums_dtype = observed.dtype
        parts.append(observed.detach().reshape(-1).to(torch.float64))  # slime's order: [Σv·m, Σv²·m, Σm]
    elif fallback:
        buf = torch.stack([local[1], local[2], local[0]])  # float64, slime's order
        (_original_all_reduce or dist.all_reduce)(buf, group=group)
        parts.append(buf)
    reduced = len(parts) > 1
    with_output = at is not None and out is not None and out.numel() == values.numel()
    if with_output:
        parts.append(out.detach().reshape(-1).take(at).to(torch.float64))
    meta = _Meta(reduced, sums_dtype, out is not None, with_output, shift_mean, epsilon, dtype, values.dtype,
                 out.dtype if isinstance(out, torch.Tensor) else None)
    submit(cl, body, torch.cat(parts), meta.blocks)


class _Meta:
    """What the sender thread needs besides the payload's numbers to finish a wrapped call's
    report: which parts the payload holds, and the dtypes and arguments of the call."""

    __slots__ = ("reduced", "sums_dtype", "has_out", "with_output", "shift_mean", "epsilon", "dtype",
                 "values_dtype", "out_dtype")

    def __init__(self, *args) -> None:
        for name, value in zip(self.__slots__, args, strict=True):
            setattr(self, name, value)

    def blocks(self, values: list[float]) -> dict:
        """``local``, ``applied`` and ``dtype`` of the report from the payload's ``values``."""
        local = moments_block(values)
        applied: dict[str, float | None] | None = None
        sums = None
        if self.reduced:
            total, total_sq, count = values[MOMENTS:MOMENTS + 3]
            applied = {"count": count, "sum": total, "sum_sq": total_sq, "mean": None, "var": None}
            if self.sums_dtype is not None:  # observed: slime's formula in the all-reduce's dtype
                sums = torch.tensor([total, total_sq, count], dtype=self.sums_dtype)
        from_output = False
        if self.has_out:
            applied = applied or {"count": None, "sum": None, "sum_sq": None}
            extremes = None
            if self.with_output and values[3]:  # some value masked in: min/max and the output there
                extremes = (values[4], values[5], *values[-2:])
            (applied["mean"], applied["var"]), from_output = _applied_mean_var(
                extremes, self.out_dtype, self.shift_mean, self.epsilon, sums)
        elif applied is not None and sums is not None and float(sums[2]) > 0:
            applied["mean"], applied["var"] = _slime_floats(sums)
        dtype = self.dtype
        if dtype is None:  # the precision the statistics really had (module docstring)
            dtype = wire_dtype(*(d for d in (self.values_dtype, self.sums_dtype,
                                             self.out_dtype if from_output else None) if d is not None))
        return {"local": local, "applied": applied, "dtype": dtype}


def _slime_floats(sums: torch.Tensor) -> tuple[float, float]:
    """slime's (mean, var) of observed ``[Σv·m, Σv²·m, Σm]`` sums (a CPU tensor), as floats."""
    mean, var = slime_mean_var(sums[0], sums[1], sums[2])
    return float(mean), float(var)


def _applied_mean_var(extremes, out_dtype, shift_mean, epsilon, sums
                      ) -> tuple[tuple[float | None, float | None], bool]:
    """((mean, var), read off the output) the function whitened with: slime's formula of the
    observed sums where the output agrees with it within the output's rounding, else what
    the output at the extreme masked values gives (``True``). ``extremes``: the smallest and
    largest masked value and the output there, ``(v0, v1, w0, w1)`` floats, or None."""
    formula = None
    if sums is not None and float(sums[2]) > 0:
        formula = _slime_floats(sums)
    fallback = (formula if formula else (None, None)), False
    if extremes is None:
        return fallback
    v0, v1, w0, w1 = extremes
    if v1 == v0 or w1 == w0 or not all(map(math.isfinite, (w0, w1))):
        return fallback
    r = (w1 - w0) / (v1 - v0)
    if shift_mean:
        mean = v0 - w0 / r
    else:
        if abs(1.0 - r) < 1e-6:
            return fallback
        # w = r·v + μ(1 − r)
        mean = (w0 - r * v0) / (1.0 - r)
    var = 1.0 / (r * r) - epsilon
    if formula is not None:
        f_mean, f_var = formula
        if f_var + epsilon > 0:
            f_r = 1.0 / math.sqrt(f_var + epsilon)
            sigma = math.sqrt(f_var) if f_var > 0 else 1.0 / r
            # each output is rounded once (relative eps/2): r is off by ≤ eps·(|w0| + |w1|)/|w1 − w0|
            eps = torch.finfo(out_dtype).eps if out_dtype.is_floating_point else 0.0
            rel = max(1e-6, 2.0 * eps * (abs(w0) + abs(w1)) / abs(w1 - w0))
            if abs(f_r - r) <= rel * abs(r) and abs(f_mean - mean) <= rel * (1.0 + abs(w0)) * sigma:
                return formula, False
    return (mean, var), True


def patch(target: str, **kwargs) -> bool:
    """Replace the function at dotted path ``target`` (``package.module.function``) with
    :func:`wrap_distributed_whiten` of it, in its module and in every
    already-imported module that bound the same function by name (``from m import f``).
    ``kwargs`` go to the wrapper. Returns False (and logs) if the module cannot be imported."""
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
