"""Trainer side of DESIGN.md §3.1 without a distributed world: the one settings reader and the
explicit topology (coordinates from the rank under the order)."""

from __future__ import annotations

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
