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


def test_only_a_verdict_on_the_checkpoint_quarantines_it():
    """The verify stage's classification of a sanity step's result: what says nothing about the checkpoint (its
    bytes verified first) leaves it unproven; a mismatch, damaged bytes or a failed parse is a verdict."""
    from ckptflow.tasks.verify import could_not_check

    for error in ("sanity-crashed", "timeout", "ConfigError", "load", "resources", "no-sanity-spec", "no-replay"):
        assert could_not_check({"ok": False, "error": error, "problems": ["why"]}), error
    for verdict in (
        {"ok": False, "error": "integrity", "problems": ["checksum differs"]},
        {"ok": False, "probe_match": "mismatch"},  # the probe loss or the learning rate differs: no error key
        {"ok": False, "check": "every_item", "problems": ["ranks loaded different values for w"]},
        {"ok": True, "error": "timeout"},
    ):
        assert could_not_check(verdict) is None, verdict


def test_an_unproven_checkpoint_is_not_what_the_next_one_s_norm_change_is_measured_against(tmp_path):
    """A step the verify stage carried on unproven has a record but no statistics: the next step compares with
    the newest one that has them, not with nothing (which would turn the norm-change expectation off)."""
    from ckptflow.tasks import records
    from ckptflow.tasks.verify import _previous_verified
    from ckptflow.trainer.format import layout

    run = str(tmp_path / "run")
    records.write_record(run, 2, "verified", {"ok": True})
    records.write_side_file(run, 2, layout.STATS, [{"name": "w", "norm": 1.0}])
    records.write_record(run, 4, "verified", {"ok": True, "proven": False, "not_proven": "timeout"})
    assert _previous_verified(run, 6) == (2, [{"name": "w", "norm": 1.0}])
