"""``group_ranks`` held as the stored text (``RankSpans``): the engine judges a step whose
reports carry the text exactly as it judges the same step with the member tuples, and never
expands the step's groups all at once (rank i naming ~world other ranks cost ranks × world
ints: 5.8 M, ~210 MiB, at 2,400 ranks)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
from factory import traced_peak

from auditor import core
from auditor.core.types import RankSpans, compress_ranks

MiB = 2**20


def test_rank_spans_behave_as_the_sorted_member_tuple():
    """len, iteration, ``in``, index, truth, equality, order and difference as the tuple's
    (its set's); a text not in canonical form is made canonical."""
    rng = random.Random(1)
    sets = [sorted({rng.randrange(16) for _ in range(rng.randint(0, 12))}) for _ in range(150)]
    sets += [[], [0], [1], [0, 1], [0, 2], [0, 1, 2], [0, 1, 3]]
    for a in sets:
        s = RankSpans(compress_ranks(a))
        assert (list(s), len(s), bool(s)) == (a, len(a), bool(a))
        for r in range(-1, 18):
            assert (r in s) == (r in a)
            if r in a:
                assert s.index(r) == a.index(r)
    for a, b in itertools.product(sets[:100], repeat=2):
        x, y = RankSpans(compress_ranks(a)), RankSpans(compress_ranks(b))
        assert ((x < y), (x == y), hash(x) == hash(y) or x != y) == ((tuple(a) < tuple(b)), a == b, True)
        assert x.minus(y).text == compress_ranks(set(a) - set(b)) and len(x.minus(y)) == len(set(a) - set(b))
    assert RankSpans("3,1-2").text == "1-3" and RankSpans("0-1,2").text == "0-2"
    with pytest.raises(ValueError):
        RankSpans("4").index(6)


def _report(rank, group, vals, *, dp=0, tp=0, shift=0.0, mb=0):
    """A moments report of ``rank`` whose applied statistic is that of ``group``'s values
    (+ ``shift`` on the mean)."""
    allv = np.concatenate([vals[m] for m in group]) if group else vals[rank]
    mine = vals[rank]
    return core.RankReport(rank=rank, microbatch=mb, dp=dp, cp=0, tp=tp, pp=0, dtype="float64",
                           local_count=float(mine.size), local_sum=float(mine.sum()),
                           local_sum_sq=float((mine ** 2).sum()), applied_count=float(allv.size),
                           applied_mean=float(allv.mean()) + shift, applied_var=float(allv.var(ddof=1)),
                           group_ranks=tuple(group))


def _as_text(reports):
    return [dataclasses.replace(r, group_ranks=compress_ranks(r.group_ranks)) for r in reports]


def test_text_groups_give_the_verdict_of_tuple_groups():
    """60 random steps of each: unknown topology (partitions with ranks naming other sets,
    missing ranks, wrong values) and known topology (dp × tp, reduce over dp; group_ranks
    that leave out or add ranks): the StepVerdict of the text reports is the tuple
    reports' one, and the steps cover both wrong_group checks."""
    seen: set[str] = set()
    for seed in range(60):
        _compare(seed, seen)
    assert {"wrong_group", "known wrong_group", "missing_report", "group_mismatch"} <= seen, seen


def _compare(seed: int, seen: set[str]) -> None:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    world = rng.randint(2, 12)
    vals = [nrng.standard_normal(5 + r) for r in range(world)]
    ranks = list(range(world))
    rng.shuffle(ranks)
    cut = sorted(rng.sample(range(1, world), rng.randint(0, world - 1))) if world > 1 else []
    parts = [sorted(p) for p in np.split(np.array(ranks), cut)]
    part_of = {r: [int(x) for x in p] for p in parts for r in p}
    reports = []
    for r in range(world):
        g = part_of[r]
        if rng.random() < 0.2:  # another set, still holding the rank
            g = sorted({r, *rng.sample(range(world), rng.randint(0, world - 1))})
        if rng.random() < 0.1:
            continue  # never arrived
        reports.append(_report(r, g, vals, shift=1.0 if rng.random() < 0.1 else 0.0))
    kw = dict(topology="unknown", world_size=world)
    a = core.audit_step(reports, (1, 1, 1, 1), core.Spec(), **kw)
    b = core.audit_step(_as_text(reports), (1, 1, 1, 1), core.Spec(), **kw)
    assert repr(b) == repr(a)
    seen.update(f.kind for f in a.faults)

    dp, tp = rng.randint(1, 4), rng.randint(1, 3)
    world = dp * tp
    vals = [nrng.standard_normal(5 + r) for r in range(world)]
    reports = []
    for r in range(world):
        d, t = divmod(r, tp)
        g = [x * tp + t for x in range(dp)]
        if rng.random() < 0.3:
            g = sorted(set(g) ^ set(rng.sample(range(world), rng.randint(1, world))))
        reports.append(dataclasses.replace(_report(r, [x * tp + t for x in range(dp)], vals, dp=d, tp=t),
                                           group_ranks=tuple(g)))
    spec = core.Spec(reduce_over=("dp",))
    a = core.audit_step(reports, (dp, 1, tp, 1), spec)
    b = core.audit_step(_as_text(reports), (dp, 1, tp, 1), spec)
    assert repr(b) == repr(a)
    seen.update(f"known {f.kind}" for f in a.faults)


def test_unknown_topology_ranks_naming_different_large_groups_stay_small():
    """Unknown topology, 1,600 ranks, rank i naming every rank but i + 1 (a short text, 1,599
    members each: 2.6 M ints, ~95 MiB expanded): judged from the texts under 16 MiB traced;
    every rank is wrong_group (its peers name other sets), the evidence names both texts."""
    n = 1600
    vals = [np.full(4, 1.0 + r % 3) for r in range(n)]
    reports = []
    for r in range(n):
        text = compress_ranks(x for x in range(n) if x != (r + 1) % n)
        mine = vals[r]
        reports.append(core.RankReport(rank=r, microbatch=0, dp=0, cp=0, tp=0, pp=0, dtype="float64",
                                       local_count=4.0, local_sum=float(mine.sum()),
                                       local_sum_sq=float((mine ** 2).sum()), applied_count=4.0,
                                       applied_mean=float(mine.mean()), applied_var=0.0, group_ranks=text))
    v, peak = traced_peak(lambda: core.audit_step(reports, (1, 1, 1, 1), core.Spec(), topology="unknown", world_size=n))
    assert peak < 16 * MiB, peak / MiB
    assert v.verdict == "inconsistent"
    wrong = [f for f in v.faults if f.kind == "wrong_group"]
    assert sorted(r for f in wrong for r in f.ranks) == list(range(n))
    assert wrong[0].evidence["group_ranks"] == "0,2-1599" and (wrong[0].evidence["peer"], wrong[0].evidence["peer_group_ranks"]) == (2, "0-2,4-1599")
