"""The process a kill trial SIGKILLs: one checkpoint's lifecycle stages, or a reconcile run.

    python -m ckptflow.chaos.worker stages --config C --run-id R --step N [--stages verify,...]
    python -m ckptflow.chaos.worker reconcile --config C

``stages`` runs the lifecycle's stage table in order (``ckptflow.tasks.stages``: record
check, storage action with its fault hook, write-once record) through ``run_stage``, the
very path the flow's Prefect tasks take, without an API server — so a trial costs seconds
and the kill lands inside ckptflow's code, not inside Prefect's. Prefect's own
orchestration is what the ``prefect`` kind exercises; ``reconcile`` runs the real flow
against the campaign's server.

Exit status: 0 done, 3 the checkpoint was quarantined, 4 a stage raised (the message is
printed); a fault kills the process with SIGKILL before it can say anything.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def run_stages(
    config: str, run_id: str, step: int, stages: tuple[str, ...] | None = None, sanity: bool | None = None
) -> dict[str, Any]:
    """The lifecycle of one step without the flow around it; returns each stage's result."""
    import dataclasses

    from ckptflow.tasks.checkpoint import CheckpointRef
    from ckptflow.tasks.config import load_config
    from ckptflow.tasks.stages import STAGES, run_stage

    cfg = load_config(config)
    if sanity is not None:
        cfg = dataclasses.replace(
            cfg, lifecycle=dataclasses.replace(cfg.lifecycle, sanity_step=sanity, expectations=sanity)
        )
    ref = CheckpointRef(cfg, run_id, step)
    out: dict[str, Any] = {}
    for stage in STAGES:
        if stages is not None and stage.name not in stages:
            continue
        rec = run_stage(stage, ref)
        if rec is None:
            continue
        out[stage.name] = rec.as_dict()
        if not rec.ok:
            out["status"] = "quarantined"
            return out
    out["status"] = "done"
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckptflow.chaos.worker")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stages")
    s.add_argument("--config", required=True)
    s.add_argument("--run-id", required=True)
    s.add_argument("--step", type=int, required=True)
    s.add_argument("--stages", default=None, help="comma-separated stage names (default: all)")
    r = sub.add_parser("reconcile")
    r.add_argument("--config", required=True)
    a = p.parse_args(argv)
    from ckptflow.trainer.errors import CkptflowError

    try:
        if a.cmd == "stages":
            res = run_stages(a.config, a.run_id, a.step, tuple(a.stages.split(",")) if a.stages else None)
        else:
            from ckptflow.flows.reconcile import reconcile

            res = reconcile(config=a.config)
    except (CkptflowError, OSError) as e:
        print(f"chaos-worker-error {type(e).__name__}: {e}", flush=True)
        return 4
    print("chaos-worker-result " + json.dumps(res, default=str), flush=True)
    return 3 if res.get("status") == "quarantined" else 0


if __name__ == "__main__":
    sys.exit(main())
