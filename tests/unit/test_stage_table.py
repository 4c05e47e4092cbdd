"""The lifecycle as a table of stages: one path (``run_stage``) with one set of rules,
whoever calls it — the flow, reconcile's age moves, the chaos worker."""

from __future__ import annotations

from ckptflow.tasks.stages import ARCHIVE, BY_NAME, RECORDS, STAGES


def test_the_table_names_each_stage_once_in_lifecycle_order():
    assert [s.name for s in STAGES] == ["verify", "compress", "promote", "export", "archive", "prune"]
    assert RECORDS == ("verified", "compressed", "promoted", "exported", "archived", "pruned")
    assert len({s.letter for s in STAGES}) == len(STAGES) and BY_NAME["archive"] is ARCHIVE
    assert all(s.event is None or s.event.startswith("ckptflow.checkpoint.") for s in STAGES)


def test_a_node_table_s_stage_is_never_taken_for_the_general_one_of_the_same_name():
    """The node-local table's verify and prune share every field with the general ones but their
    action: equal, they were routed as the general stage (a node checkpoint verified on a hot root
    that never held it)."""
    from ckptflow.flows.nodes import NODE_STAGES

    assert [s.name for s in NODE_STAGES] == ["promote", "verify", "export", "archive", "prune"]
    for node_stage in NODE_STAGES:
        general = BY_NAME[node_stage.name]
        assert (node_stage == general) is (node_stage.act is general.act), node_stage.name
        assert (node_stage in STAGES) is (node_stage is general)
