"""Fault injection: real gloo ranks with Megatron-core groups inject every fault of DESIGN.md §5.

:func:`run_injection` spawns ``dp·cp·tp`` worker processes (default 2·2·2 = 8) that join one
gloo world, build Megatron-core's parallel groups (``initialize_model_parallel`` with
tensor and context parallelism) and then run every :data:`SCENARIOS` entry in turn, each as
its own run ``{prefix}-{scenario}``: a correct reduction, or one with a fault injected the
way trainers get it wrong (the DP group without CP, summing TP replicas, a missing Bessel
correction, a cached statistic, an ``if numel() > 0`` guard, …). Every rank reports through
the real :class:`auditor.trainer.client.AuditorClient` and the trainer-side hooks of
:mod:`auditor.trainer.hooks` to a live service. :func:`evaluate` then reads each run's
consistency report and returns the fault matrix: fault × detected × diagnosis correct.

One spawned world serves all scenarios (start-up dominates the cost); the join is bounded,
so a rank stuck in a collective fails the run instead of hanging it.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import numpy as np
from auditor.testing.world import MEGATRON_PRELOAD, spawn_world

#: Topology of the injection world: dp=2, cp=2, tp=2 (pp=1), 8 ranks.
DP, CP, TP = 2, 2, 2
#: Tokens per step of the large correct runs (all shards together; TP replicas hold copies).
BIG_TOKENS = 10_000_000
#: Bound on the whole multi-process run, seconds.
DEFAULT_TIMEOUT = 240.0


@dataclass(frozen=True)
class Scenario:
    """One injected case: ``name`` (also the run-id suffix), statistic ``kind``, the fault
    it injects (``None`` = a correct run), and a one-line description."""

    name: str
    kind: str
    fault: str | None
    description: str


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("correct-1e7", "moments", None, "float32, 1e7 tokens/step, |mean|/std = 1e2, DP group with CP"),
    Scenario("correct-edge", "moments", None, "step 0: N = 1 group (one token, other shards empty); "
                                               "step 1: one empty shard"),
    Scenario("precision-1e3", "moments", "precision_loss", "correct group, 1e7 tokens, |mean|/std = 1e3"),
    Scenario("wrong-group", "moments", "wrong_group", "whiten over get_data_parallel_group() (CP excluded)"),
    Scenario("replica-overcount", "moments", "replica_overcount", "reduce over WORLD: TP replicas summed"),
    Scenario("variance-convention", "moments", "variance_convention", "population variance (no Bessel)"),
    Scenario("stale-statistic", "moments", "stale_statistic", "step 1 applies step 0's cached statistic"),
    Scenario("skipped-collective", "moments", "skipped_collective",
             "ranks with an empty mask skip the all-reduce (peers use a group without them)"),
    Scenario("missing-report", "moments", "missing_report", "rank 5 never reports"),
    Scenario("replica-divergence", "moments", "replica_divergence", "TP rank 1 of shard (dp0, cp0) gets other data"),
    Scenario("non-finite", "moments", "non_finite", "a NaN advantage on shard (dp0, cp0) (ranks 0, 1)"),
    Scenario("empty-global", "moments", "empty_global", "every response token masked out"),
    Scenario("sum-correct", "sum", None, "token-count denominator, 2 microbatches, over dp+cp and microbatches"),
    Scenario("sum-local-count", "sum", "wrong_group", "each rank divides by its local token count"),
    Scenario("norm-correct", "norm", None, "grad norm² over the model-parallel group, replicated part once"),
    Scenario("norm-replicated-overcount", "norm", "replica_overcount",
             "replicated layer-norm grads added before the TP all-reduce"),
    Scenario("norm-wrong-group", "norm", "wrong_group", "grad norm² not reduced over the model-parallel group"),
)


# ------------------------------------------------------------------------------- data


def shard_data(scenario: int, step: int, dp: int, cp: int, tp: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Values (float32) and mask (float32 0/1) of one rank; replicated along tp except where a
    scenario says otherwise. Shapes (n,), same n."""
    seed_tp = tp if name == "replica-divergence" and (dp, cp) == (0, 0) else 0
    rng = np.random.default_rng([scenario, step, dp, cp, seed_tp])
    if name in ("correct-1e7", "precision-1e3"):
        n = BIG_TOKENS // (DP * CP)
        loc = 1e2 if name == "correct-1e7" else 1e3
        return (loc + rng.standard_normal(n)).astype(np.float32), np.ones(n, dtype=np.float32)
    if name == "correct-edge":
        if step == 0:
            n = 1 if (dp, cp) == (0, 0) else 0
            return np.full(n, 0.75, dtype=np.float32), np.ones(n, dtype=np.float32)
        n = 0 if (dp, cp) == (1, 1) else 500
        return (0.3 + rng.standard_normal(n)).astype(np.float32), np.ones(n, dtype=np.float32)
    if name == "skipped-collective" and (dp, cp) == (1, 1):
        return np.zeros(0, dtype=np.float32), np.zeros(0, dtype=np.float32)
    n = 1000 + 137 * (2 * dp + cp)
    values = rng.standard_normal(n).astype(np.float32) + np.float32(0.2 * cp - 0.1 * dp)
    mask = (rng.random(n) < 0.8).astype(np.float32)
    if name == "empty-global":
        mask[:] = 0
    if name == "non-finite" and (dp, cp) == (0, 0):
        values[3], mask[3] = np.nan, 1.0
    return values, mask


# ----------------------------------------------------------------------------- workers


def _inject_all(rank: int, world: int, port: int, url: str, prefix: str, timeout: float) -> dict:
    """Body of one worker: join gloo, build Megatron groups, run every scenario."""
    import torch.distributed as dist

    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=CP)
        rk = _Rank(rank, world, url)
        for idx, sc in enumerate(SCENARIOS):
            run = f"{prefix}-{sc.name}"
            if sc.kind == "moments":
                _moments_scenario(rk, idx, sc.name, run, timeout)
            elif sc.kind == "sum":
                _sum_scenario(rk, idx, sc.name, run)
            else:
                _norm_scenario(rk, idx, sc.name, run)
        delivered = rk.client.flush(timeout)
        rk.client.close()
        dist.barrier()
        return {"rank": rank, "coords": (rk.dp, rk.cp, rk.tp), "delivered": delivered, "stats": dict(rk.client.stats)}
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


class _Rank:
    """One worker in the joined world: its coordinates (``dp``, ``cp``, ``tp``), the groups
    the scenarios reduce over, its client, and the two ways it whitens (slime's, or a faulty
    one by hand)."""

    def __init__(self, rank: int, world: int, url: str):
        """Read the Megatron coordinates and build the extra groups (every rank builds the same
        groups in the same order), then open the client to ``url``."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from auditor.trainer.client import AuditorClient

        self.rank = rank
        self.dp, self.cp, self.tp = (ps.get_data_parallel_rank(), ps.get_context_parallel_rank(),
                                     ps.get_tensor_model_parallel_rank())
        self.dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        # groups of the skipped-collective scenario: each TP slice's DP×CP group minus (dp1, cp1)
        all_coords = [None] * world
        dist.all_gather_object(all_coords, (self.dp, self.cp, self.tp))
        self.partial = {}
        for t in range(TP):
            members = [r for r, c in enumerate(all_coords) if c[2] == t and c[:2] != (1, 1)]
            self.partial[t] = dist.new_group(members)
        self.solo = [dist.new_group([r]) for r in range(world)]  # "no reduction" (collective creation)
        self.client = AuditorClient(url, flush_interval=0.05)
        self.stale_cache: dict = {}

    def data(self, idx: int, name: str, step: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """This rank's values and mask in scenario ``idx`` (:func:`shard_data`)."""
        return shard_data(idx, step, self.dp, self.cp, self.tp, name)

    def whiten(self, run, values, mask, group, step=0):
        """slime's whitening over ``group`` (``None``: the world), reported by the hook."""
        import torch

        from auditor.trainer.hooks import distributed_masked_whiten

        v, m = torch.from_numpy(values), torch.from_numpy(mask)
        try:
            return distributed_masked_whiten(v, m, process_group=group, run_id=run, step=step, client=self.client)
        except ValueError:
            return None  # empty_global: slime raises after the (reported) all-reduce

    def manual(self, run, values, mask, group, applied_fn, step=0, skip=False):
        """A faulty whitening: same local moments and reduction as slime, applied_fn
        turns the reduced float32 (S, SS, N) into the (mean, var) the rank uses."""
        import torch
        import torch.distributed as dist

        from auditor.trainer.hooks import masked_moments, report_statistic

        v, m = torch.from_numpy(values), torch.from_numpy(mask)
        local = masked_moments(v, m)
        applied = None
        if not skip:
            t = torch.tensor([(v * m).sum(), (v * v * m).sum(), m.sum()], dtype=torch.float32)
            dist.all_reduce(t, group=group)
            s, ss, n = (float(x) for x in t)
            mean, var = applied_fn(t)
            applied = {"count": n, "sum": s, "sum_sq": ss, "mean": mean, "var": var}
        report_statistic(self.client, run_id=run, statistic="advantages", step=step, kind="moments", local=local,
                         applied=applied, process_group=group)

    def stale(self, t):
        """The sample (mean, var) of the first reduction this rank made, whatever ``t`` is now."""
        s, ss, n = t
        mean = s / n
        var = (ss / n - mean * mean) * n / (n - 1)
        if "v" not in self.stale_cache:
            self.stale_cache["v"] = (float(mean), float(var))
        return self.stale_cache["v"]


def _population(t):
    """The (mean, var) of a reduced (S, SS, N) with no Bessel correction."""
    s, ss, n = t
    mean = s / n
    return float(mean), float(ss / n - mean * mean)


def _moments_scenario(rk: _Rank, idx: int, name: str, run: str, timeout: float) -> None:
    """One ``moments`` scenario: slime's whitening over the right group or a wrong one, or a
    faulty whitening by hand; ``timeout`` bounds a flush between steps."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    data = lambda step=0: rk.data(idx, name, step)  # noqa: E731
    if name == "correct-edge":
        for step in (0, 1):
            rk.whiten(run, *data(step), rk.dp_cp, step)
    elif name == "wrong-group":
        rk.whiten(run, *data(), ps.get_data_parallel_group())
    elif name == "replica-overcount":
        rk.whiten(run, *data(), None)
    elif name == "variance-convention":
        rk.manual(run, *data(), rk.dp_cp, _population)
    elif name == "stale-statistic":
        for step in (0, 1):
            rk.manual(run, *data(step), rk.dp_cp, rk.stale, step=step)
            rk.client.flush(timeout)
    elif name == "skipped-collective":
        skip = (rk.dp, rk.cp) == (1, 1)
        if skip:
            rk.manual(run, *data(), rk.partial[rk.tp], None, skip=True)
        else:
            rk.whiten(run, *data(), rk.partial[rk.tp])
    elif name == "missing-report":
        values, mask = data()
        if rk.rank == 5:
            v, m = torch.from_numpy(values), torch.from_numpy(mask)
            t = torch.tensor([(v * m).sum(), (v * v * m).sum(), m.sum()], dtype=torch.float32)
            dist.all_reduce(t, group=rk.dp_cp)  # takes part, never reports
        else:
            rk.whiten(run, values, mask, rk.dp_cp)
    else:  # correct-1e7, precision-1e3, replica-divergence, non-finite, empty-global
        rk.whiten(run, *data(), rk.dp_cp)


def _sum_scenario(rk: _Rank, idx: int, name: str, run: str) -> None:
    """One ``sum`` scenario: token counts of 2 microbatches summed over dp+cp by the hook, or
    each rank's local count applied with no all-reduce at all."""
    from auditor.trainer.hooks import audited_sum, report_statistic

    rng = np.random.default_rng([idx, rk.dp, rk.cp])
    counts = [float(x) for x in rng.integers(0, 400, size=2)]
    if name == "sum-correct":
        audited_sum(counts, rk.dp_cp, run_id=run, statistic="loss_tokens", client=rk.client)
    else:  # local count: no all-reduce at all
        spec = {"reduce_over": ["dp", "cp"], "replicas": ["tp"], "over_microbatches": True}
        for mb, c in enumerate(counts):
            report_statistic(rk.client, run_id=run, statistic="loss_tokens", step=0, kind="sum",
                             local={"sum": c}, applied={"sum": float(sum(counts))},
                             process_group=rk.solo[rk.rank],
                             microbatch=mb, num_microbatches=2, spec=spec)


def _norm_scenario(rk: _Rank, idx: int, name: str, run: str) -> None:
    """One ``norm`` scenario: grad norm² over the model-parallel group by the hook, the
    replicated part added on every TP rank, or no reduction. Shards differ along tp (model
    parallel), equal along dp/cp (replicas)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from auditor.trainer.hooks import audited_norm_sq, report_statistic

    rng = np.random.default_rng([idx, rk.tp])
    sum_sq = float(np.float32(rng.random() * 10))
    rep = 0.25
    mp = ps.get_model_parallel_group()
    if name == "norm-correct":
        audited_norm_sq(sum_sq, rep, mp, run_id=run, client=rk.client)
    elif name == "norm-replicated-overcount":
        t = torch.tensor(sum_sq + rep, dtype=torch.float32)
        dist.all_reduce(t, group=mp)
        report_statistic(rk.client, run_id=run, statistic="grad_norm_sq", step=0, kind="norm",
                         local={"sum_sq": sum_sq, "replicated_sum_sq": rep},
                         applied={"sum_sq": float(t)}, process_group=mp)
    else:
        audited_norm_sq(sum_sq, rep, rk.solo[rk.rank], run_id=run, client=rk.client)


def run_injection(url: str, prefix: str, timeout: float = DEFAULT_TIMEOUT) -> list[dict]:
    """Spawn the 8-rank world, inject every scenario, report to ``url``.

    Returns per-rank dicts (``rank``, ``coords`` (dp, cp, tp), ``delivered``, ``stats``).
    Raises ``RuntimeError`` if a worker failed and ``TimeoutError`` if the world did not
    finish within ``timeout`` seconds (all workers are killed first).
    """
    return spawn_world(_inject_all, DP * CP * TP, (url, prefix, timeout), timeout, preload=MEGATRON_PRELOAD)


# ---------------------------------------------------------------------------- evaluation


@dataclass
class MatrixRow:
    """One line of the fault matrix."""

    scenario: str
    fault: str
    detected: bool
    diagnosis_correct: bool
    found: list[str]
    diagnosis: str


def _step_faults(stat: dict) -> dict[tuple[int, str], dict]:
    return {(st["step"], f["kind"]): f for st in stat.get("bad_steps", []) for f in st["faults"]}


def _wrong(stat, found, expected) -> bool:
    return any(f["kind"] == "wrong_group" and f["evidence"].get("found") == found
               and f["evidence"].get("expected") == expected for f in _step_faults(stat).values())


#: Per scenario: (the fault kinds the run must show — exactly, a diagnosis check on its
#: statistic JSON). ``frozenset()`` means zero faults.
EXPECTED: dict[str, tuple[frozenset, Callable[[dict], bool]]] = {
    "correct-1e7": (frozenset(), lambda s: s["steps_consistent"] == 1),
    "correct-edge": (frozenset(), lambda s: s["steps_consistent"] == 2),
    "precision-1e3": (frozenset({"precision_loss"}), lambda s: all(
        f["evidence"]["max_predicted_relative_var_error"] > 0.5 for (_, k), f in _step_faults(s).items()
        if k == "precision_loss")),
    "wrong-group": (frozenset({"wrong_group", "group_mismatch", "cp_disagreement"}),
                    lambda s: _wrong(s, ["dp"], ["dp", "cp"])
                    and _step_faults(s)[(0, "wrong_group")]["ranks"] == list(range(8))),
    "replica-overcount": (frozenset({"replica_overcount", "group_mismatch"}),
                          lambda s: _step_faults(s)[(0, "replica_overcount")]["evidence"]["factor"] == 2.0),
    "variance-convention": (frozenset({"variance_convention", "group_mismatch"}),
                            lambda s: _step_faults(s)[(0, "variance_convention")]["evidence"]["found"] == "population"),
    "stale-statistic": (frozenset({"stale_statistic", "group_mismatch"}),
                        lambda s: _step_faults(s)[(1, "stale_statistic")]["evidence"]["stale_step"] == 0
                        and s["first_bad_step"] == 1),
    "skipped-collective": (frozenset({"skipped_collective", "wrong_group"}),
                           lambda s: _step_faults(s)[(0, "skipped_collective")]["ranks"] == [6, 7]
                           and _step_faults(s)[(0, "skipped_collective")]["evidence"]["empty_local_mask"] is True),
    "missing-report": (frozenset({"missing_report"}),
                       lambda s: _step_faults(s)[(0, "missing_report")]["ranks"] == [5]
                       and s["steps_incomplete"] == 1),
    "replica-divergence": (frozenset({"replica_divergence"}),
                           lambda s: _step_faults(s)[(0, "replica_divergence")]["ranks"] == [1]),
    "non-finite": (frozenset({"non_finite"}), lambda s: _step_faults(s)[(0, "non_finite")]["ranks"] == list(range(8))),
    "empty-global": (frozenset({"empty_global"}), lambda s: _step_faults(s)[(0, "empty_global")]["ranks"] == list(range(8))),
    "sum-correct": (frozenset(), lambda s: s["steps_consistent"] == 1),
    "sum-local-count": (frozenset({"wrong_group", "group_mismatch", "cp_disagreement"}),
                        lambda s: _wrong(s, [], ["dp", "cp"])
                        and "local count" in _step_faults(s)[(0, "wrong_group")]["message"]),
    "norm-correct": (frozenset(), lambda s: s["steps_consistent"] == 1),
    "norm-replicated-overcount": (frozenset({"replica_overcount", "group_mismatch"}),
                                  lambda s: _step_faults(s)[(0, "replica_overcount")]["evidence"].get(
                                      "replicated_counted") == 2.0),
    "norm-wrong-group": (frozenset({"wrong_group", "group_mismatch"}),
                         lambda s: "tp" not in _step_faults(s)[(0, "wrong_group")]["evidence"]["found"]
                         and _step_faults(s)[(0, "wrong_group")]["evidence"]["expected"] == ["tp", "pp"]),
}


def evaluate(reports: dict[str, dict]) -> list[MatrixRow]:
    """The fault matrix from each scenario's consistency report (scenario name → report
    JSON). ``detected``: the run shows the injected fault (for correct runs: the run shows
    no fault). ``diagnosis_correct``: the run shows exactly the expected fault kinds and the
    evidence names the right cause (group dims, factor, step, ranks)."""
    rows = []
    for sc in SCENARIOS:
        rep = reports.get(sc.name)
        stat = (rep or {}).get("statistics", [{}])[0] if rep else {}
        found = sorted((stat.get("faults") or {}).keys())
        want, check = EXPECTED[sc.name]
        detected = (not found) if sc.fault is None else sc.fault in found
        try:
            diag_ok = set(found) == set(want) and bool(check(stat))
        except (KeyError, IndexError, TypeError):
            diag_ok = False
        main = [f for st in stat.get("bad_steps", []) for f in st["faults"] if f["kind"] == sc.fault]
        rows.append(MatrixRow(sc.name, sc.fault or "— (correct run)", detected, diag_ok, found,
                              main[0]["message"] if main else ""))
    return rows


def fetch_reports(url: str, prefix: str, wait_for_missing: float = 20.0) -> dict[str, dict]:
    """Each scenario's consistency report; waits (bounded) until every step has a verdict
    (the missing-report step needs the service's grace period)."""
    import httpx

    out: dict[str, dict] = {}
    deadline = time.monotonic() + wait_for_missing
    with httpx.Client(base_url=url, timeout=30) as http:
        for sc in SCENARIOS:
            while True:
                r = http.get(f"/v1/runs/{prefix}-{sc.name}/report")
                body = r.json() if r.status_code == 200 else None
                pending = body and any(s["steps_pending"] for s in body["statistics"])
                if body and not pending or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            out[sc.name] = body
    return out


def format_matrix(rows: list[MatrixRow]) -> str:
    """Plain-text table: scenario, fault, detected, diagnosis correct, fault kinds found."""
    head = f"{'scenario':<27} {'fault':<20} {'detected':<9} {'diagnosis':<10} faults found"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.scenario:<27} {r.fault:<20} {'yes' if r.detected else 'NO':<9} "
                     f"{'correct' if r.diagnosis_correct else 'WRONG':<10} {', '.join(r.found) or '—'}")
    return "\n".join(lines)


def run_matrix(url: str, prefix: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> tuple[list[MatrixRow], list[dict], Any]:
    """Inject, fetch and evaluate; returns (matrix rows, per-rank results, reports)."""
    import uuid

    prefix = prefix or f"inject-{uuid.uuid4().hex[:8]}"
    ranks = run_injection(url, prefix, timeout)
    reports = fetch_reports(url, prefix)
    return evaluate(reports), ranks, reports
