"""Trainer side of DESIGN.md §3.1 without a distributed world: the one settings reader and the
explicit topology (coordinates from the rank under the order)."""

from __future__ import annotations

import sys

import pytest

from auditor.trainer.settings import read_settings


def test_trainer_settings_are_read_leniently_in_one_place():
    """One reader for every AUDITOR_* variable a rank reads: 'none' and empty run ids are
    unset, malformed numbers keep their defaults, the mesh map and topology are parsed."""
    s = read_settings({"AUDITOR_URL": " http://a:1 ", "AUDITOR_RUN_ID": "none", "TORCHELASTIC_RUN_ID": "",
                       "AUDITOR_FLUSH_TIMEOUT": "fast", "AUDITOR_MAX_QUEUE": "1e3",
                       "AUDITOR_MESH_DIMS": "dp_shard=dp, sp=cp", "AUDITOR_TOPOLOGY": "dp=4,cp=2"})
    assert s.url == "http://a:1" and s.run_id is None and s.elastic_run_id is None
    assert s.flush_timeout is None and s.max_queue == 1000
    assert s.mesh_dims == {"dp_shard": "dp", "sp": "cp"} and s.topology == "dp=4,cp=2"
    assert read_settings({"TORCHELASTIC_RUN_ID": "3f2a-job"}).elastic_run_id == "3f2a-job"
    assert read_settings({}).statistic == "advantages" and read_settings({}).rank_order == "tp-cp-ep-dp-pp"


def test_explicit_topology_from_the_environment(monkeypatch):
    """AUDITOR_TOPOLOGY (+ AUDITOR_RANK_ORDER): coordinates follow from the rank under the
    order; dp left out is the rest of the world; ep/etp add the expert factorisation with
    edp = world / (ep·etp·pp); a size product that does not fit the world is not guessed
    (the source fails and the report says 'unknown')."""
    from auditor.trainer import topology

    topology.clear()
    monkeypatch.setenv("AUDITOR_TOPOLOGY", "cp=2,tp=2")
    t = topology.wire_topology(rank=5, world=8)
    assert t["sizes"] == {"dp": 2, "cp": 2, "tp": 2, "pp": 1} and t["order"] == "tp-cp-ep-dp-pp"
    assert t["topology_source"] == "AUDITOR_TOPOLOGY"
    assert t["coords"] == {"dp": 1, "cp": 0, "tp": 1, "pp": 0}  # 5 = tp 1 + 2·(cp 0 + 2·dp 1)
    monkeypatch.setenv("AUDITOR_TOPOLOGY", "pp=2,ep=2")
    t = topology.wire_topology(rank=3, world=4)
    assert t["sizes"] == {"dp": 2, "cp": 1, "tp": 1, "pp": 2, "ep": 2, "etp": 1, "edp": 1}
    assert t["coords"] == {"dp": 1, "cp": 0, "tp": 0, "pp": 1, "etp": 0, "ep": 1, "edp": 0}
    monkeypatch.setenv("AUDITOR_TOPOLOGY", "cp=3")
    assert topology.wire_topology(rank=0, world=4) == {
        "topology": "unknown",
        "topology_source": "AUDITOR_TOPOLOGY=cp=3 refused: cp=3 has 3 ranks (dp*cp*tp*pp), the world has 4"}
    with pytest.raises(ValueError, match="unknown dim 'xp'"):
        topology.parse_topology("xp=2")
    topology.clear()
    monkeypatch.delenv("AUDITOR_TOPOLOGY")
    topology.set_topology(dp=2, tp=2, order="tp-cp-ep-dp-pp")
    t = topology.wire_topology(rank=2, world=4)
    assert t["coords"] == {"dp": 1, "cp": 0, "tp": 0, "pp": 0} and t["topology_source"] == "set_topology"
    topology.clear()
    assert topology.wire_topology(rank=0, world=4) == {"topology": "unknown", "topology_source": "none found"}


def test_a_stubbed_mpu_states_what_it_states_and_nothing_more(monkeypatch):
    """A megatron.core.mpu that is not an initialised parallel_state (a framework test's
    stub): the sizes its accessors give, the unstated dims 1 only when the stated ones fill
    the world; a stub stating less is a partial layout — unknown, its source naming what was
    stated — never a guess. No accessor at all: not a source. Megatron's parsed args give the
    sizes with dp the rest and Megatron's order."""
    import types

    from auditor.trainer import megatron, topology

    topology.clear()
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_world_size, mpu.get_context_parallel_rank = (lambda: 2), (lambda: 1)
    mpu.get_data_parallel_world_size, mpu.get_data_parallel_rank = (lambda: 2), (lambda: 1)
    monkeypatch.setitem(sys.modules, "megatron.core.mpu", mpu)
    monkeypatch.delitem(sys.modules, "megatron.core.parallel_state", raising=False)
    t = topology.wire_topology(rank=3, world=4)
    assert t == {"coords": {"dp": 1, "cp": 1, "tp": 0, "pp": 0}, "sizes": {"dp": 2, "cp": 2, "tp": 1, "pp": 1},
                 "topology_source": "megatron.core.mpu accessors (dp=2, cp=2; tp, pp = 1: the stated sizes fill the "
                                    "world)"}
    assert megatron.mpu_topology(3, 8) == {
        "topology": "unknown",
        "topology_source": "megatron.core.mpu (partial: dp=2, cp=2, world 8; tp, pp not stated)"}
    mpu.get_context_parallel_rank = lambda: 2  # a rank outside its size states nothing
    assert megatron.mpu_topology(3, 4)["topology_source"].startswith("megatron.core.mpu (partial: dp=2, world 4;")
    half = types.ModuleType("megatron.core.mpu")
    half.get_context_parallel_world_size = lambda: 2  # a size without its rank: partial, said so
    monkeypatch.setitem(sys.modules, "megatron.core.mpu", half)
    assert megatron.mpu_topology(0, 4)["topology_source"] == (
        "megatron.core.mpu (partial: none, world 4; dp, cp, tp, pp not stated; cp size 2, rank None)")
    monkeypatch.setitem(sys.modules, "megatron.core.mpu", types.ModuleType("megatron.core.mpu"))
    assert megatron.mpu_topology(0, 4) is None

    gv = types.ModuleType("megatron.training.global_vars")
    gv._GLOBAL_ARGS = types.SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
                                            context_parallel_size=2)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", gv)
    assert megatron.args_topology(5, 8) == {"coords": {"dp": 1, "cp": 0, "tp": 1, "pp": 0},
                                            "sizes": {"dp": 2, "cp": 2, "tp": 2, "pp": 1},
                                            "order": "tp-cp-ep-dp-pp", "topology_source": "megatron args"}
    assert megatron.args_topology(0, 6)["topology"] == "unknown"
    topology.clear()
