"""The reference case of slime PR #2235, run for real: GRPO advantage whitening under CP.

``run_demo`` spawns dp·cp gloo workers that build Megatron-core's process groups, shard
three sequences zigzag over the CP ranks (as Megatron's context parallelism and slime's
``compute_advantages_and_returns`` do), and whiten their advantages twice with
:func:`auditor.trainer.hooks.distributed_masked_whiten`:

* run ``{prefix}-buggy`` over ``get_data_parallel_group()`` (CP excluded; slime's bug),
* run ``{prefix}-fixed`` over ``get_data_parallel_group(with_context_parallel=True)``.

Every rank reports to the auditor service; the demo prints the whitened values next to the
service's verdict and metrics. Reference numbers: DESIGN.md §4.
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Sequence

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

from auditor.core import stats
from auditor.render import render_report
from auditor.testing.world import spawn_world

#: Default bound on the whole multi-process run, seconds: a rank stuck in a collective
#: another rank skipped turns into an error instead of a hang.
DEFAULT_TIMEOUT = 180.0


@dataclass(frozen=True)
class Sample:
    """One rollout: ``total`` tokens (prompt + response), the last ``response`` of them
    generated, each carrying the same ``advantage`` (outcome reward, GRPO)."""

    total: int
    response: int
    advantage: float

    @property
    def prompt(self) -> int:
        """Prompt length P = T − R."""
        return self.total - self.response


def grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """Group-centred GRPO advantages of one prompt group: rᵢ − mean(r)."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


#: Rewards of the reference prompt group; centred they give +1.5 / −0.5 / −1.0.
REFERENCE_REWARDS = (1.0, -1.0, -1.5)
#: (T, R) of the reference sequences.
REFERENCE_SHAPES = ((64, 48), (100, 90), (40, 12))
REFERENCE_SAMPLES: tuple[Sample, ...] = tuple(
    Sample(t, r, a) for (t, r), a in zip(REFERENCE_SHAPES, grpo_advantages(REFERENCE_REWARDS))
)


# ---------------------------------------------------------------------------- sharding


def step_advantages(samples: Sequence[Sample], step: int) -> np.ndarray:
    """Per-sample advantages of rollout ``step``, float32 of shape (len(samples),): step 0 is
    the reference case (each sample's own advantage); later steps draw fresh rewards
    (seeded by the step) and centre them as GRPO does, so every step has other statistics."""
    if step == 0:
        return np.array([s.advantage for s in samples], dtype=np.float32)
    rewards = np.random.default_rng(step).normal(size=len(samples))
    return np.array(grpo_advantages(rewards.tolist()), dtype=np.float32)


def dp_rank_of(sample_index: int, dp: int) -> int:
    """Data-parallel rank that holds sample ``sample_index``: i mod dp."""
    return sample_index % dp


def zigzag_chunks(total: int, cp: int, cp_rank: int) -> tuple[range, range]:
    """Token positions CP rank ``cp_rank`` owns under Megatron's zigzag (load-balanced) split.

    The sequence is cut into 2·cp chunks of ceil(T / (2·cp)) tokens; rank r owns chunks r
    and 2·cp − 1 − r (the last chunk may be short or empty).
    """
    chunk = math.ceil(total / (2 * cp))
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return (
        range(first * chunk, min((first + 1) * chunk, total)),
        range(second * chunk, min((second + 1) * chunk, total)),
    )


def cp_response_mask(total: int, response: int, cp: int, cp_rank: int) -> np.ndarray:
    """Which response tokens CP rank ``cp_rank`` holds, shape (R,), dtype bool.

    Response token j is predicted by the logit at position P − 1 + j (next-token shift),
    so response tokens occupy logit positions [P − 1, T − 1) with P = T − R.

    Raises
    ------
    ValueError
        Unless 0 ≤ R < T (a response needs at least one prompt token before it).
    """
    if not 0 <= response < total:
        raise ValueError(f"need 0 <= response < total, got response={response}, total={total}")
    positions = np.arange(response) + (total - response - 1)
    mask = np.zeros(response, dtype=bool)
    for owned in zigzag_chunks(total, cp, cp_rank):
        mask |= (positions >= owned.start) & (positions < owned.stop)
    return mask


def cp_response_token_counts(total: int, response: int, cp: int) -> list[int]:
    """Response tokens held by each CP rank, length cp (sums to R).

    E.g. (T, R) = (64, 48), cp = 2 → [16, 32]; P = 8000, R = 1000, cp = 2 → [1000, 0].
    """
    return [int(cp_response_mask(total, response, cp, r).sum()) for r in range(cp)]


@dataclass(frozen=True)
class LocalBatch:
    """What one (dp, cp) rank holds: its response tokens of every sample it was assigned.

    ``values`` (advantages), ``mask`` (loss mask, all ones) and ``sample_ids`` (index of the
    sample each token belongs to) are 1-D of equal length n ≥ 0; values/mask float32.
    """

    values: np.ndarray
    mask: np.ndarray
    sample_ids: np.ndarray


def local_batch(samples: Sequence[Sample], dp: int, cp: int, dp_rank: int, cp_rank: int) -> LocalBatch:
    """Concatenate this rank's CP slices of the samples ``dp_rank_of`` assigns it."""
    ids = [
        np.full(int(cp_response_mask(s.total, s.response, cp, cp_rank).sum()), i, dtype=np.int64)
        for i, s in enumerate(samples)
        if dp_rank_of(i, dp) == dp_rank
    ]
    sample_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    advantages = np.array([s.advantage for s in samples], dtype=np.float32)
    values = advantages[sample_ids] if len(sample_ids) else np.zeros(0, dtype=np.float32)
    return LocalBatch(values, np.ones_like(values), sample_ids)


def whiten_reference(samples: Sequence[Sample], dp: int, cp: int, dp_rank: int, cp_rank: int,
                     over_cp: bool = True) -> dict[int, float]:
    """Float64 whitened advantage of every sample the rank holds, from the group's moments.

    ``over_cp`` True reduces over all dp·cp ranks (the correct group); False over the ranks
    sharing ``cp_rank`` (slime's bug). Uses :mod:`auditor.core.stats` (slime's one-pass formula
    evaluated in float64). Returns {sample index: whitened value} for samples the rank holds
    at least one token of.
    """
    cps = range(cp) if over_cp else [cp_rank]
    parts = [local_batch(samples, dp, cp, d, c) for d in range(dp) for c in cps]
    v = np.concatenate([p.values for p in parts]).astype(np.float64)
    mean, var = stats.one_pass_mean_var(float(v.size), float(v.sum()), float((v * v).sum()))
    own = local_batch(samples, dp, cp, dp_rank, cp_rank)
    return {int(i): float(stats.whiten(np.array([samples[i].advantage]), mean, var)[0])
            for i in np.unique(own.sample_ids)}


# ---------------------------------------------------------------------------- workers


@dataclass(frozen=True)
class RankResult:
    """One worker's numbers: coordinates, local masked moments and whitened values.

    ``tokens``: response tokens held per sample index. ``whitened``: per run id, the mean
    (float64) of the whitened tokens of each held sample. ``client_stats``: the rank's
    :class:`~auditor.trainer.client.AuditorClient` counters (empty without a service).
    """

    rank: int
    dp: int
    cp: int
    local_count: float
    local_mean: float
    tokens: dict[int, int]
    whitened: dict[str, dict[int, float]]
    client_stats: dict[str, int] = field(default_factory=dict)
    delivered: bool = True


def _whiten_on_rank(rank, world, port, dp, cp, samples, url, run_ids, timeout, steps, workloads=None) -> RankResult:
    """Body of one worker process: join the gloo world, build Megatron groups, whiten twice
    per step (``whitened`` records step 0, the reference case). ``workloads``: the workload
    label of each run (one client per run), or None (one client, no label)."""
    import torch
    import torch.distributed as dist

    from auditor.trainer.client import AuditorClient
    from auditor.trainer.hooks import distributed_masked_whiten, masked_moments

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
        dp_rank, cp_rank = ps.get_data_parallel_rank(), ps.get_context_parallel_rank()
        batch = local_batch(samples, dp, cp, dp_rank, cp_rank)
        values, mask = torch.from_numpy(batch.values), torch.from_numpy(batch.mask)
        ids = torch.from_numpy(batch.sample_ids)
        held = sorted(set(batch.sample_ids.tolist()))
        groups = dict(zip(run_ids, (ps.get_data_parallel_group(),
                                    ps.get_data_parallel_group(with_context_parallel=True))))
        if not url:
            clients = dict.fromkeys(run_ids)
        elif workloads is None:
            clients = dict.fromkeys(run_ids, AuditorClient(url))
        else:
            clients = {r: AuditorClient(url, workload=w) for r, w in zip(run_ids, workloads)}
        whitened = {}
        for step in range(steps):
            step_values = values if step == 0 else torch.from_numpy(step_advantages(samples, step)[batch.sample_ids])
            for run_id, group in groups.items():
                w = distributed_masked_whiten(step_values, mask, process_group=group, client=clients[run_id],
                                              run_id=run_id, statistic="advantages", step=step).double()
                if step == 0:
                    whitened[run_id] = {i: float(w[ids == i].mean()) for i in held}
        distinct = list({id(c): c for c in clients.values() if c is not None}.values())
        delivered = all([c.flush(timeout) for c in distinct])
        client_stats: dict[str, int] = {}
        for c in distinct:
            c.close()
            client_stats = {k: client_stats.get(k, 0) + v for k, v in c.stats.items()}
        local = masked_moments(values, mask)
        return RankResult(
            rank=rank, dp=dp_rank, cp=cp_rank, local_count=local["count"],
            local_mean=local["sum"] / local["count"] if local["count"] else math.nan,
            tokens={i: int((ids == i).sum()) for i in held}, whitened=whitened,
            client_stats=client_stats, delivered=delivered,
        )
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


#: Largest dp·cp the demo spawns: every rank is a process importing torch and Megatron-core,
#: ~360 MiB resident each (measured, dp=2 cp=2), so 32 need ~11.5 GiB; `--dp 100000` started
#: 200,000 such processes.
MAX_DEMO_WORLD = 32


def check_world(dp: int, cp: int) -> None:
    """Raise ValueError, naming both sizes, when dp·cp is above :data:`MAX_DEMO_WORLD`."""
    if dp * cp > MAX_DEMO_WORLD:
        raise ValueError(f"--dp × --cp is {dp} × {cp} = {dp * cp:,} workers; the demo runs at most {MAX_DEMO_WORLD} "
                         f"(each is a process holding torch, ~0.36 GiB)")


def run_workers(
    samples: Sequence[Sample],
    dp: int,
    cp: int,
    run_ids: tuple[str, str],
    url: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    steps: int = 1,
    workloads: tuple[str, str] | None = None,
    preload: Sequence[str] | None = None,
) -> list[RankResult]:
    """Spawn dp·cp gloo workers that whiten ``samples`` for the (buggy, fixed) ``run_ids``,
    ``steps`` rollout steps each (:func:`step_advantages`).

    Each worker reports to ``url`` (none when ``None``) and flushes before exiting;
    ``workloads``: the workload label of each of the two runs. ``preload``: fork the workers
    from a server that imported these modules once (:func:`spawn_world`; the layout demo).
    Returns RankResults sorted by global rank; raises as :func:`auditor.testing.world.spawn_world`,
    and ValueError (nothing spawned) when dp·cp is above :data:`MAX_DEMO_WORLD`.
    """
    check_world(dp, cp)
    return spawn_world(_whiten_on_rank, dp * cp, (dp, cp, tuple(samples), url, run_ids, timeout, steps, workloads),
                       timeout, preload=preload)


# ---------------------------------------------------------------------------- demo


@dataclass
class DemoResult:
    """Everything ``run_demo`` measured and fetched.

    ``ranks``: per-rank numbers (global-rank order). ``reports``: run id → the service's
    consistency report JSON (``None`` if it could not be fetched). ``metric_lines``:
    ``auditor_*`` samples of ``/metrics`` labelled with one of the two runs.
    """

    dp: int
    cp: int
    samples: tuple[Sample, ...]
    buggy_run_id: str
    fixed_run_id: str
    ranks: list[RankResult]
    reports: dict[str, dict | None] = field(default_factory=dict)
    metric_lines: list[str] = field(default_factory=list)

    def whitened(self, run_id: str, sample: int, cp_rank: int) -> float | None:
        """Whitened advantage of ``sample`` on the CP rank ``cp_rank`` of the DP replica
        holding it (``None`` if that CP rank holds none of its tokens)."""
        dp_rank = dp_rank_of(sample, self.dp)
        rank = next(r for r in self.ranks if r.dp == dp_rank and r.cp == cp_rank)
        return rank.whitened[run_id].get(sample)


def run_demo(
    url: str,
    dp: int,
    cp: int,
    sequences: Sequence[Sample] | None = None,
    console: Console | None = None,
    *,
    prefix: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    steps: int = 1,
    preload: Sequence[str] | None = None,
) -> DemoResult:
    """Run the reference case on dp·cp real workers against the service at ``url``, print it.

    Parameters
    ----------
    url:
        Base URL of a running auditor service.
    dp, cp:
        Data- and context-parallel sizes (world = dp·cp, tp = pp = 1).
    sequences:
        The samples to whiten, sample i on DP rank i mod dp; default
        :data:`REFERENCE_SAMPLES`. Pass e.g. ``REFERENCE_SAMPLES + (Sample(9000, 1000, 0.75),)``
        to add a prompt-heavy sequence.
    console:
        Where to print (a new :class:`rich.console.Console` by default).
    prefix:
        Run ids are ``{prefix}-buggy`` and ``{prefix}-fixed``; default
        ``demo-{dp}x{cp}-{timestamp}``.
    timeout:
        Bound on the worker run, seconds (see :func:`run_workers`).
    steps:
        Rollout steps per run: step 0 is the reference case, later steps whiten fresh
        rewards (:func:`step_advantages`), so the run page has a history to plot.
    preload:
        Fork the workers from a server that imported these modules once (e.g.
        :data:`auditor.testing.world.MEGATRON_PRELOAD`: tests that run several worlds); default
        ``None``, a fresh interpreter per worker (``spawn``), as ``auditor demo`` runs them.
    """
    console = console or Console()
    samples = tuple(sequences or REFERENCE_SAMPLES)
    prefix = prefix or f"demo-{dp}x{cp}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_ids = (f"{prefix}-buggy", f"{prefix}-fixed")
    console.print(f"[bold]Whitening {len(samples)} sequences on dp={dp} × cp={cp} gloo workers[/] "
                  f"(runs {run_ids[0]}, {run_ids[1]})")
    ranks = run_workers(samples, dp, cp, run_ids, url=url, timeout=timeout, steps=steps, preload=preload)
    result = DemoResult(dp, cp, samples, *run_ids, ranks)
    _print_local(console, result)
    _print_whitened(console, result)
    _warn_undelivered(console, result)
    _fetch_service_view(url, result, console)
    return result


def _print_local(console: Console, result: DemoResult) -> None:
    table = Table(title="Local response tokens per rank (CP zigzag slices)")
    for col in ("rank", "dp", "cp", "tokens per sequence", "tokens", "local mean"):
        table.add_column(col, justify="right")
    for r in result.ranks:
        per_seq = ", ".join(f"{i}:{n}" for i, n in r.tokens.items()) or "—"
        table.add_row(str(r.rank), str(r.dp), str(r.cp), per_seq, f"{r.local_count:.0f}", _fmt(r.local_mean))
    count = sum(r.local_count for r in result.ranks)
    total = sum(r.local_count * r.local_mean for r in result.ranks if r.local_count)
    table.add_row("global", "", "", "", f"{count:.0f}", _fmt(total / count if count else math.nan), style="bold")
    console.print(table)


def _print_whitened(console: Console, result: DemoResult) -> None:
    table = Table(title="Whitened advantage per sequence (mean over its tokens on each CP rank)")
    table.add_column("seq", justify="right")
    table.add_column("(T, R)", justify="right")
    table.add_column("raw", justify="right")
    for label in ("buggy", "fixed"):
        for c in range(result.cp):
            table.add_column(f"{label} cp{c}", justify="right")
    for i, s in enumerate(result.samples):
        row = [str(i), f"({s.total}, {s.response})", f"{s.advantage:+.1f}"]
        for run_id in (result.buggy_run_id, result.fixed_run_id):
            row += [_fmt(result.whitened(run_id, i, c)) for c in range(result.cp)]
        table.add_row(*row)
    console.print(table)


def _warn_undelivered(console: Console, result: DemoResult) -> None:
    for r in result.ranks:
        if not r.delivered or r.client_stats.get("rejected") or r.client_stats.get("dropped"):
            console.print(f"[yellow]rank {r.rank}: reports not all delivered: {r.client_stats}[/]")


def _fetch_service_view(url: str, result: DemoResult, console: Console) -> None:
    """Fill ``result.reports``/``metric_lines`` from the service and print them."""
    runs = (result.buggy_run_id, result.fixed_run_id)
    with httpx.Client(base_url=url.rstrip("/"), timeout=10.0) as http:
        for run_id in runs:
            result.reports[run_id] = _get_json(http, f"/v1/runs/{run_id}/report", console)
            if result.reports[run_id] is not None:
                render_report(result.reports[run_id], console)
        try:
            text = http.get("/metrics").raise_for_status().text
        except httpx.HTTPError as exc:
            console.print(f"[red]GET /metrics failed: {exc}[/]")
            return
    labels = tuple(f'run="{r}"' for r in runs)
    result.metric_lines = [ln for ln in text.splitlines()
                           if ln.startswith("auditor_") and any(lab in ln for lab in labels)]
    console.print("[bold]Prometheus metrics of these runs[/]")
    for line in result.metric_lines:
        console.print(f"  {line}", markup=False, highlight=False, soft_wrap=True)


def _get_json(http: httpx.Client, path: str, console: Console) -> dict | None:
    try:
        return http.get(path).raise_for_status().json()
    except httpx.HTTPError as exc:
        console.print(f"[red]GET {path} failed: {exc}[/]")
        return None


def _fmt(x: float | None) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.6f}"
