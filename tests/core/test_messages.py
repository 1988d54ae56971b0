"""The words of the findings: rank nouns agree with the count ("rank 5", "ranks 0-3") and a
cp_disagreement names the CP peer groups it found, not one range across them."""

from __future__ import annotations

import numpy as np

from auditor import core


def _rep(rank, dp, cp, values, applied_sums=True, **applied):
    x = np.asarray(values, dtype=np.float64)
    sums = dict(applied_count=float(x.size), applied_sum=float(x.sum()), applied_sum_sq=float((x * x).sum()))
    return core.RankReport(rank=rank, microbatch=0, dp=dp, cp=cp, tp=0, pp=0, dtype="float32",
                           local_count=float(x.size), local_sum=float(x.sum()), local_sum_sq=float((x * x).sum()),
                           **({**sums, **applied} if applied_sums else applied))


def _kinds(v):
    return {f.kind: f for f in v.faults}


def test_cp_disagreement_names_each_peer_group():
    """dp=2 × cp=2, every rank reduced alone: the CP peer groups are {0,1} (dp 0) and {2,3}
    (dp 1); the message names both, not "CP peers 0-3"."""
    reports = [_rep(cp + 2 * dp, dp, cp, np.arange(4.0 + cp + 2 * dp) * (cp + 2 * dp + 1))
               for dp in range(2) for cp in range(2)]
    f = _kinds(core.audit_step(reports, (2, 2, 1, 1), core.Spec()))["cp_disagreement"]
    assert f.ranks == [0, 1, 2, 3]
    assert f.message == ("CP peers {0-1} and {2-3} (each: same dp/tp/pp) whitened one sequence's parts with "
                         "different statistics: the reduction does not span the context-parallel group the same "
                         "way on every CP rank")


def test_cp_disagreement_of_one_peer_group():
    """cp=2 alone (the reference shape): one group, named as a range."""
    reports = [_rep(cp, 0, cp, np.arange(4.0 + cp) * (cp + 1)) for cp in range(2)]
    f = _kinds(core.audit_step(reports, (1, 2, 1, 1), core.Spec()))["cp_disagreement"]
    assert f.message.startswith("CP peers 0-1 (same dp/tp/pp) whitened one sequence's parts")


def test_one_rank_is_rank_not_ranks():
    """dp=6 over 0..5 on every rank (correct mean 2.5, sample var 3.0 of 36 values): rank 5
    whitened with mean 11.5: "rank 5 whitened with …"; the same step without rank 4's
    report: "… never arrived (rank 4)"."""
    x = np.arange(6.0)
    reports = [_rep(r, r, 0, x, applied_sums=False, applied_count=36.0, applied_var=3.0,
                    applied_mean=2.5 + (9.0 if r == 5 else 0.0)) for r in range(6)]
    v = core.audit_step(reports, (6, 1, 1, 1), core.Spec(reduce_over=("dp",), replicas=()))
    f = _kinds(v)["group_mismatch"]
    assert (v.verdict, f.ranks) == ("inconsistent", [5])
    assert f.message == ("rank 5 whitened with a statistic that is not their expected group's (the reduction over "
                         "['dp']) beyond what float32 rounding explains. Attribution: only rank 5 is out of line "
                         "while ranks 0-4 of its group are right, along no dim: suspect that rank — its device or "
                         "host, or a code path only it takes — not the reduction every rank runs.")
    v = core.audit_step(reports[:4] + reports[5:], (6, 1, 1, 1), core.Spec(reduce_over=("dp",), replicas=()))
    f = _kinds(v)["missing_report"]
    assert (v.verdict, f.ranks) == ("incomplete", [4])
    assert f.message.startswith("1 of 6 expected reports never arrived (rank 4): ")
    assert core.ranks_text([5]) == "rank 5" and core.ranks_text([0, 1, 2, 3]) == "ranks 0-3"


# ------------------------------------------------------------ wrong_group: the fix, per framework
from auditor.core.diagnose import group_hint  # noqa: E402
from auditor.core.types import DIMS, EXPERT_DIMS  # noqa: E402

_SIZES = {"dp": 2, "cp": 2, "tp": 2, "pp": 2, "mb": 1}


def test_megatron_hint_names_the_accessor_of_the_expected_dims():
    """Megatron runs (topology_source megatron, megatron.core.mpu, or not known): the
    parallel_state accessor of the dims the spec reduces over — the two hints of before
    keep their words (CP left out of ['dp', 'cp']; a norm over ['tp', 'pp'])."""
    g = [0, 1, 2, 3]
    for source in (None, "megatron", "megatron.core.mpu"):
        assert group_hint("moments", ("dp", "cp"), ["cp"], _SIZES, DIMS, g, 0, source) == (
            " — under context parallelism use get_data_parallel_group(with_context_parallel=True)")
        assert group_hint("norm", ("tp", "pp"), ["pp"], _SIZES, DIMS, g, 0, source) == (
            " — reduce the squared norm over the model-parallel group (get_model_parallel_group())")
    assert group_hint("moments", ("dp", "cp"), ["dp"], _SIZES, DIMS, g, 0) == (
        " — reduce over ['dp', 'cp'] with get_data_parallel_group(with_context_parallel=True)")
    assert group_hint("sum", ("dp", "cp", "tp"), ["cp"], _SIZES, DIMS, g, 0) == (
        " — reduce over ['dp', 'cp', 'tp'] with get_tensor_and_data_parallel_group(with_context_parallel=True)")
    assert group_hint("norm", ("dp", "tp"), ["tp"], _SIZES, DIMS, g, 0) == (
        " — reduce over ['dp', 'tp'] with get_tensor_and_data_parallel_group()")
    assert group_hint("moments", ("cp", "tp"), ["cp"], _SIZES, DIMS, g, 0) == (
        " — reduce over ['cp', 'tp'] with get_tensor_and_context_parallel_group()")
    assert group_hint("sum", DIMS, ["pp"], _SIZES, DIMS, list(range(16)), 0) == (
        " — reduce over every rank (the default group, dist.group.WORLD)")
    # a set with dims of size 1: the accessor of the others (the same ranks in this run)
    assert group_hint("moments", ("dp", "cp", "pp"), ["cp"], {**_SIZES, "pp": 1}, DIMS, g, 0) == (
        " — reduce over ['dp', 'cp', 'pp'] with get_data_parallel_group(with_context_parallel=True) (the same "
        "ranks here: ['pp'] of size 1)")
    # no accessor spans it: the ranks
    assert group_hint("moments", ("dp", "pp"), ["pp"], _SIZES, DIMS, [0, 2, 8, 10], 2) == (
        " — no Megatron accessor spans ['dp', 'pp']: build the group with torch.distributed.new_group(ranks=[0, 2, "
        "8, 10]) (the group of rank 2; every rank creates one group per set of ranks equal outside ['dp', 'pp'], "
        "in the same order)")


def test_megatron_hint_for_expert_dims_is_megatrons_expert_accessor():
    """Expert dims get Megatron's expert groups, never get_model_parallel_group() (which
    spans tp × pp of the dense layout)."""
    sizes = {"edp": 2, "ep": 2, "etp": 2, "pp": 2, "mb": 1}
    hint = group_hint("norm", ("etp", "ep", "pp"), ["ep"], sizes, EXPERT_DIMS, [0, 1], 0)
    assert hint == " — reduce over ['ep', 'etp', 'pp'] with get_expert_tensor_model_pipeline_parallel_group()"
    assert group_hint("moments", ("edp",), ["edp"], sizes, EXPERT_DIMS, [0, 1], 0) == (
        " — reduce over ['edp'] with get_expert_data_parallel_group()")
    assert group_hint("norm", ("etp", "ep"), ["ep"], sizes, EXPERT_DIMS, [0, 1], 0) == (
        " — reduce over ['ep', 'etp'] with get_expert_tensor_and_model_parallel_group()")
    assert group_hint("sum", ("ep",), ["ep"], sizes, EXPERT_DIMS, [0, 1], 0) == (
        " — reduce over ['ep'] with get_expert_model_parallel_group()")


def test_device_mesh_hint_names_the_mesh_slice_to_flatten():
    assert group_hint("moments", ("dp", "cp"), ["cp"], _SIZES, DIMS, [0, 1], 0, "device_mesh") == (
        ' — reduce over the DeviceMesh slice of [\'dp\', \'cp\']: mesh["dp", "cp"]._flatten().get_group() '
        "(with the mesh's own names for these dims)")
    assert group_hint("norm", ("tp",), ["tp"], _SIZES, DIMS, [0, 1], 0, "device_mesh") == (
        " — reduce over the DeviceMesh slice of ['tp']: mesh[\"tp\"].get_group() (with the mesh's own names for "
        "these dims)")


def test_plain_torch_hint_names_the_ranks_the_group_must_hold():
    """AUDITOR_TOPOLOGY, set_topology or anything else: the members of the example rank's
    expected group, as the new_group call that makes it (ranges past 16 members)."""
    for source in ("AUDITOR_TOPOLOGY", "set_topology", "unknown"):
        assert group_hint("moments", ("dp", "cp"), ["cp"], _SIZES, DIMS, [0, 1, 4, 5], 1, source) == (
            " — the group must hold ranks 0-1,4-5: torch.distributed.new_group(ranks=[0, 1, 4, 5]) (the group of "
            "rank 1; every rank creates one group per set of ranks equal outside ['dp', 'cp'], in the same order)")
    big = list(range(0, 64, 2))
    assert "new_group(ranks=<the 32 ranks 0,2,4," in group_hint("sum", ("dp",), ["dp"], _SIZES, DIMS, big, 0, "x")


def test_an_audited_expert_norm_not_reduced_over_ep_gets_the_expert_accessor():
    """Through audit_step (a Megatron run: the default wording): an expert norm reduced over
    pp only, where ['etp', 'ep', 'pp'] was expected, names the expert group's accessor."""
    from auditor import layout

    sizes = {"dp": 2, "cp": 1, "tp": 1, "pp": 2, "edp": 1, "ep": 2, "etp": 1}
    coords = {r: layout.coords_of(r, sizes, "tp-cp-ep-dp-pp") for r in range(4)}
    s = [1.5, 2.25, 3.0, 4.5]
    by_ep = {e: sum(s[r] for r in range(4) if coords[r]["ep"] == e) for e in (0, 1)}
    reports = [core.RankReport(rank=r, microbatch=0, dtype="float64", local_count=None, local_sum=None,
                               local_sum_sq=s[r], applied_sum_sq=by_ep[coords[r]["ep"]], **coords[r]) for r in range(4)]
    v = core.audit_step(reports, (2, 1, 1, 2), core.Spec(("etp", "ep", "pp"), ("edp",)), kind="norm",
                        expert_sizes=(1, 2, 1, 2), order="tp-cp-ep-dp-pp")
    msg = _kinds(v)["wrong_group"].message
    assert msg.endswith(" — reduce over ['ep', 'etp', 'pp'] with get_expert_tensor_model_pipeline_parallel_group()")
    assert "get_model_parallel_group" not in msg
