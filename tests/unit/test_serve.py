"""The deployments are declared once (``ckptflow.flows.serve.DEPLOYMENTS``); the work-pool
file ``deployments/prefect.yaml`` must say the same, field by field."""

from __future__ import annotations

import os

import yaml

from ckptflow.flows.serve import DEPLOYMENTS
from tests.helpers import REPO


def test_prefect_yaml_declares_exactly_the_served_deployments():
    with open(os.path.join(REPO, "deployments", "prefect.yaml")) as f:
        doc = yaml.safe_load(f)
    got = {d["name"]: d for d in doc["deployments"]}
    assert sorted(got) == sorted(d.name for d in DEPLOYMENTS)
    for d in DEPLOYMENTS:
        y = got[d.name]
        assert y["entrypoint"] == d.entrypoint, d.name
        assert y.get("concurrency_limit") == d.concurrency_limit, d.name
        assert y["description"] == d.description, d.name
        assert y["work_pool"]["name"] == "ckptflow-pool"
        if d.trigger is not None:
            (t,) = y["triggers"]
            assert (t["type"], t["expect"], t["match"], t["parameters"]) == (
                "event",
                d.trigger["expect"],
                d.trigger["match"],
                d.trigger["parameters"],
            ), d.name
        else:
            assert "triggers" not in y
        sched = y.get("schedules", [])
        if d.interval_s is not None:
            assert sched == [{"interval": d.interval_s}], d.name
        elif d.cron_from_config:
            assert sched == [{"cron": "0 3 * * *", "timezone": "UTC"}], d.name  # the config's default
        else:
            assert sched == []


def test_entrypoints_name_the_flows_by_module():
    """A file-path entrypoint would load the flow's module under a second name."""
    for d in DEPLOYMENTS:
        assert ".py" not in d.entrypoint and d.flow().name.startswith("ckptflow-")
