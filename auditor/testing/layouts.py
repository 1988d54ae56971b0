"""Run one workload at several parallel layouts and require the same statistics (issue 26).

What the seed's maintainer wrote by hand (slime PR #2235: the whitened advantage of each
sample must be the same for every (dp, cp) factorisation and equal to the single-rank
baseline), as one helper::

    from auditor.testing.layouts import assert_layout_invariant

    def whiten(r, samples):                          # on every rank of every layout
        values, mask = my_shard(samples, r.dp_rank, r.dp, r.cp_rank, r.cp)
        return distributed_masked_whiten(values, mask, process_group=r.group(), client=r.client,
                                         run_id=r.run_id)

    assert_layout_invariant(whiten, [(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1)],
                            url=auditor_url, workload="advantages", args=(SAMPLES,))

Each layout is a real gloo world of dp·cp ranks with Megatron-core's ``parallel_state``
groups (``initialize_model_parallel(context_parallel_size=cp)``), forked from a server that
imported torch and Megatron once (:func:`auditor.testing.world.spawn_world` ``preload``);
every rank gets a :class:`LayoutRank` — its coordinates and an
:class:`~auditor.trainer.client.AuditorClient` labelled with the workload — and reports
through the real hooks. The layout is one run ``{prefix}-{layout.name}`` of the workload.
:func:`check_layouts` then requires (a) every run consistent (``auditor check``'s status)
and (b) the workload invariant (``GET /v1/workloads/{workload}``: no ``layout_variance``
finding); its failure text names the layout and the step.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable, Sequence

from auditor.testing.world import MEGATRON_PRELOAD, spawn_world

#: Modules the fork server imports once for every rank of every layout (the fork server of a
#: process is started once, by whichever world asks first: one list for all of them).
PRELOAD = (*MEGATRON_PRELOAD, "auditor.testing.layouts")
#: Bound on one layout's world, seconds (a rank stuck in a collective fails the call).
DEFAULT_TIMEOUT = 120.0
#: The seed's six factorisations of (dp, cp).
SEED_LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (4, 1))


@dataclass(frozen=True, order=True)
class Layout:
    """A parallel layout: ``dp`` × ``cp`` ranks (tp = pp = 1), ``microbatches`` per step."""

    dp: int = 1
    cp: int = 1
    microbatches: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.cp, self.microbatches) < 1:
            raise ValueError(f"layout sizes must be ≥ 1, got dp={self.dp}, cp={self.cp}, "
                             f"microbatches={self.microbatches}")

    @property
    def world(self) -> int:
        """Ranks of the layout's world: dp·cp."""
        return self.dp * self.cp

    @property
    def name(self) -> str:
        """``2x1`` (dp × cp), ``1x1-mb4`` with 4 micro-batches: the run id's suffix."""
        return f"{self.dp}x{self.cp}" + (f"-mb{self.microbatches}" if self.microbatches > 1 else "")

    def run_id(self, prefix: str) -> str:
        """The run id of this layout's run: ``{prefix}-{name}``."""
        return f"{prefix}-{self.name}"

    def text(self) -> str:
        """``dp=2, cp=1`` (``, 4 micro-batches`` when more than one), for messages."""
        mb = f", {self.microbatches} micro-batches" if self.microbatches > 1 else ""
        return f"dp={self.dp}, cp={self.cp}{mb}"

    @classmethod
    def of(cls, value: "Layout | Sequence[int] | str") -> "Layout":
        """A :class:`Layout` from itself, ``(dp, cp)``, ``(dp, cp, microbatches)`` or
        ``"DPxCP"`` (``"2x1"``). Raises ValueError naming the value otherwise."""
        if isinstance(value, Layout):
            return value
        if isinstance(value, str):
            m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", value)
            if not m:
                raise ValueError(f"layout {value!r} is not DPxCP (e.g. 2x1)")
            return cls(int(m[1]), int(m[2]))
        sizes = tuple(value)
        if not 2 <= len(sizes) <= 3 or not all(isinstance(s, int) for s in sizes):
            raise ValueError(f"layout {value!r} is not (dp, cp) or (dp, cp, microbatches)")
        return cls(*sizes)


def parse_layouts(text: str) -> list[Layout]:
    """``"1x1,2x1,1x2"`` → layouts, in order, duplicates refused (ValueError naming them)."""
    layouts = [Layout.of(part) for part in text.split(",") if part.strip()]
    if not layouts:
        raise ValueError("no layout given (e.g. 1x1,2x1,1x2,2x2)")
    seen = [x.name for x in layouts]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    if dup:
        raise ValueError(f"layout {dup[0]} given twice")
    return layouts


@dataclass
class LayoutRank:
    """What the per-rank function gets: its layout, coordinates, the run id of the layout and
    a client labelled with the workload (pass it as ``client=`` to the audited hooks)."""

    layout: Layout
    rank: int
    dp_rank: int
    cp_rank: int
    run_id: str
    workload: str
    client: Any

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    def group(self, with_context_parallel: bool = True):
        """Megatron-core's data-parallel group, with CP by default (the group a statistic over
        the whole batch reduces over)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group(with_context_parallel=with_context_parallel)


@dataclass
class LayoutRun:
    """One layout's run: its id, what each rank's function returned (rank order), and
    whether every rank delivered its reports (``stats``: each rank's client counters)."""

    layout: Layout
    run_id: str
    results: list
    delivered: bool
    stats: list[dict] = field(default_factory=list)


def _layout_rank(rank, world, port, body, layout, run_id, workload, url, args, timeout):
    """One rank of a layout's world: gloo, Megatron-core groups, a client, ``body``."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core import parallel_state as ps

    from auditor.trainer.client import AuditorClient

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    client = None
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=layout.cp)
        client = AuditorClient(url, workload=workload, flush_interval=0.05, spool=False, rank=rank)
        me = LayoutRank(layout, rank, ps.get_data_parallel_rank(), ps.get_context_parallel_rank(), run_id,
                        workload, client)
        out = body(me, *args)
        delivered = client.flush(timeout)
        return out, delivered, dict(client.stats)
    finally:
        if client is not None:
            client.close()
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def run_layouts(body: Callable[..., Any], layouts: Iterable, *, url: str, workload: str, args: tuple = (),
                prefix: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> list[LayoutRun]:
    """Run ``body(rank: LayoutRank, *args)`` on every rank of every layout, one gloo world
    per layout, each a run ``{prefix}-{layout.name}`` of ``workload`` reporting to ``url``.

    ``body`` must be a module-level function (it is pickled); what it returns comes back per
    rank. ``layouts``: :class:`Layout`, ``(dp, cp)``, ``(dp, cp, microbatches)`` or ``"DPxCP"``;
    ``prefix`` defaults to ``workload``. Raises as :func:`spawn_world` (a rank raised, died, or
    did not finish within ``timeout`` seconds) and ValueError for a bad or repeated layout.
    """
    todo = [Layout.of(x) for x in layouts]
    names = [x.name for x in todo]
    if len(set(names)) != len(names):
        raise ValueError(f"a layout is given twice: {names}")
    prefix = prefix or workload
    runs = []
    for layout in todo:
        run_id = layout.run_id(prefix)
        out = spawn_world(_layout_rank, layout.world, (body, layout, run_id, workload, url, args, timeout),
                          timeout, preload=PRELOAD)
        runs.append(LayoutRun(layout, run_id, [o[0] for o in out], all(o[1] for o in out), [o[2] for o in out]))
    return runs


def check_layouts(reader, workload: str, runs: Sequence[LayoutRun], *,
                  expect_inconsistent: Iterable[str] = ()) -> list[str]:
    """What is wrong with ``runs`` of ``workload``, one text per problem (empty: all is well).

    (a) Every run must have delivered its reports and be consistent (``auditor check``'s
    status, :meth:`auditor.reader.Report.check`) — except the run ids in
    ``expect_inconsistent`` (a known bug reproduced on purpose), which must be inconsistent;
    (b) the workload must be ``invariant`` (``GET /v1/workloads/{workload}``,
    :meth:`auditor.reader.Reader.workload_json`): no ``layout_variance`` finding, and
    something compared — ``not_comparable`` (one layout, no shared step) is a problem too,
    never a pass. Every text names the layout (and the run) and the first step concerned.
    ``reader``: an :class:`auditor.reader.Reader` of the service the runs reported to, called
    after their steps were audited (the ranks have exited and flushed; the pytest plugin's
    in-process service is settled first).
    """
    from auditor.pytest_plugin import diagnosis

    bad = set(expect_inconsistent)
    problems = [p for run in runs for p in _run_problems(reader, run, run.run_id in bad, diagnosis)]
    doc = reader.workload_json(workload)
    by_run = {r.run_id: r for r in runs}
    for f in workload_findings(doc):
        run, ref = by_run.get(f["run"]), by_run.get(f["reference"])
        name = f"layout {run.layout.text()}" if run else "a layout not run here"
        against = f"layout {ref.layout.text()}" if ref else f"run {f['reference']!r}"
        problems.append(f"{name} (run {f['run']!r}) differs from {against} at step {f['first_step']} "
                        f"({f['statistic']}, {f['moment']}: {f['diagnosis']}): {f['message']}")
    if doc["verdict"] == "not_comparable":
        problems.append(f"workload {workload!r} is not comparable: {doc['reason']}")
    return problems


def _run_problems(reader, run: LayoutRun, bad: bool, diagnosis) -> list[str]:
    """What is wrong with one run: reports not delivered; not consistent (or, ``bad``: not
    inconsistent)."""
    where = f"layout {run.layout.text()} (run {run.run_id!r})"
    out = [] if run.delivered else [f"{where}: reports not all delivered: {run.stats}"]
    report = reader.report(run.run_id)
    if bad:
        if report.status != "inconsistent":
            out.append(f"{where}: expected INCONSISTENT (a known bug), but the run is {report.status}")
        return out
    passed, lines = report.check()
    if not passed:
        out.append(f"{where}: " + (diagnosis(report) if report.status in ("inconsistent", "incomplete")
                                   else "; ".join(lines)))
    return out


def workload_findings(doc: dict) -> list[dict]:
    """The ``layout_variance`` findings of a comparison document (``GET /v1/workloads/…``
    as JSON: :meth:`auditor.reader.Reader.workload_json`), over its statistics (each a
    JSON object: ``run``, ``reference``, ``statistic``, ``moment``, ``first_step``,
    ``diagnosis``, ``message``, ``evidence``, ...)."""
    return [f for s in doc.get("statistics", []) for f in s.get("findings", [])]


def assert_layout_invariant(body: Callable[..., Any], layouts: Iterable, *, url: str, workload: str,
                            args: tuple = (), prefix: str | None = None, reader=None,
                            expect_inconsistent: Iterable[str] = (), settle: Callable[[], Any] | None = None,
                            timeout: float = DEFAULT_TIMEOUT) -> list[LayoutRun]:
    """:func:`run_layouts`, then :func:`check_layouts`; raises AssertionError with every
    problem (each naming its layout and step) and returns the runs otherwise.
    ``expect_inconsistent``: layouts (as ``layouts``) whose run must be inconsistent;
    ``settle``: called after the ranks exit and before the check (the pytest plugin's
    ``auditor_service.settle``: audit what is still open); ``reader``: an
    :class:`auditor.reader.Reader` (default: one on ``url``)."""
    from auditor.reader import Reader

    runs = run_layouts(body, layouts, url=url, workload=workload, args=args, prefix=prefix, timeout=timeout)
    bad = {Layout.of(x).run_id(prefix or workload) for x in expect_inconsistent}
    if settle is not None:
        settle()
    own = reader is None
    reader = reader or Reader(url)
    try:
        problems = check_layouts(reader, workload, runs, expect_inconsistent=bad)
    finally:
        if own:
            reader.close()
    if problems:
        raise AssertionError(f"workload {workload!r} at {len(runs)} layouts:\n" + "\n".join(problems))
    return runs
