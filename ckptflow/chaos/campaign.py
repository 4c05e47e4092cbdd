"""The campaign's shared state: servers, the golden workspace, baselines — built lazily, once.

Everything lives under one work dir (a fresh temp dir unless ``--workdir``): the trials'
folders, server logs, the Prefect server's database. The process environment gets
throwaway S3 credentials for the campaign's moto server and, unless signing is turned
off, a random manifest signing key — so trials exercise authenticated manifests as a
hardened deployment would, and the user's real credentials are never sent anywhere.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptflow.chaos import procs
from ckptflow.chaos.model import DEFAULT_KINDS
from ckptflow.chaos.servers import HarnessError, MotoServer, PrefectServer
from ckptflow.chaos.workspace import RUN_ID, Scratch, Style, clone, committed_by_tier
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import layout
from ckptflow.trainer.format.manifest import KEY_BLOCK_ENV, KEY_ENV

TRAIN_STEPS, SAVE_EVERY = 10, 2
"""Trainer trials (kill, enospc): saves at 2, 4, 6, 8, 10."""


@dataclass(slots=True)
class Options:
    trials: int = 10
    kinds: tuple[str, ...] = DEFAULT_KINDS
    weights: dict[str, int] = field(default_factory=dict)
    """Trials of a kind per round of the round-robin (default 1): ``kill:4`` runs 4 kills a round."""
    seed: int = 0
    style: Style = field(default_factory=Style)
    workdir: str | None = None
    keep: bool = False
    sign: bool = True
    s3_share: float = 0.2
    """Share of S3 requests the proxy breaks in a normal trial (a storm trial breaks 0.6)."""
    prefect_share: float = 0.2
    """Share of Prefect API requests broken in the ``flow-flaky`` mode."""
    world2_share: float = 0.34
    """Share of trainer trials run at world size 2 under torchrun (the rest: one process)."""
    timeout_s: float = 300.0
    """Longest any one process of a trial may run before it counts as hung."""


@dataclass(slots=True)
class Golden:
    golden: Scratch
    final: Scratch
    before: dict[str, list[int]]
    """Committed steps per tier in ``golden``."""
    after: dict[str, list[int]]
    """Committed steps per tier once step 6's lifecycle has finished (``final``)."""


class Campaign:
    def __init__(self, opts: Options, say: Callable[[str], None]) -> None:
        self.opts = opts
        self.say = say
        self.owns_workdir = opts.workdir is None
        import tempfile

        self.workdir = os.path.abspath(opts.workdir or tempfile.mkdtemp(prefix="ckptflow-chaos-"))
        os.makedirs(os.path.join(self.workdir, "logs"), exist_ok=True)
        self._quiet = _LogsToFile(self.log("campaign.log"))
        creds = {
            "AWS_ACCESS_KEY_ID": "ckptflow-chaos",
            "AWS_SECRET_ACCESS_KEY": "ckptflow-chaos-" + secrets.token_hex(8),
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_SESSION_TOKEN": "",
            "PREFECT_HOME": os.path.join(self.workdir, "prefect-client"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
        for k in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_ENDPOINT_URL", KEY_BLOCK_ENV):
            creds[k] = ""  # the campaign decides credentials and signing, never the user's setup
        if opts.sign:
            creds[KEY_ENV] = secrets.token_hex(32)
        self._saved_env = {k: os.environ.get(k) for k in (*creds, "CKPTFLOW_FAULT", "PREFECT_API_URL")}
        for k, v in creds.items():
            if v:
                os.environ[k] = v
            else:
                os.environ.pop(k, None)
        if not opts.sign:
            os.environ.pop(KEY_ENV, None)
        os.environ.pop("CKPTFLOW_FAULT", None)
        os.environ.pop("PREFECT_API_URL", None)
        self.env = procs.base_env()
        self.moto = MotoServer(self.log("moto.log"), self.env)
        import boto3

        self.s3 = boto3.client("s3", endpoint_url=self.moto.url)
        self.bucket = "ckptflow-chaos"
        self.s3.create_bucket(Bucket=self.bucket)
        self._golden: Golden | None = None
        self._baselines: dict[int, dict[int, tuple[float, float]]] = {}
        self._prefect: PrefectServer | None = None
        self._train_baseline: dict | None = None
        self.cache: dict[str, Any] = {}
        """What a kind makes once per campaign (the ``net`` kind's clean run)."""

    def quiet_logs(self) -> None:
        self._quiet.refresh()

    def log(self, name: str) -> str:
        return os.path.join(self.workdir, "logs", name)

    def trial_dir(self, index: int, kind: str) -> str:
        return os.path.join(self.workdir, "trials", f"{index:04d}-{kind}")

    def scratch(self, index: int, kind: str, *, sanity: bool | None = None) -> Scratch:
        """Empty tiers for one trial."""
        return Scratch(
            self.trial_dir(index, kind),
            self.bucket,
            f"trials/{index:04d}",
            self.moto.url,
            self.opts.style,
            sanity=sanity,
        )

    def clone_golden(self, index: int, kind: str, *, final: bool = False) -> Scratch:
        g = self.golden()
        return clone(g.final if final else g.golden, self.trial_dir(index, kind), self.s3, prefix=f"trials/{index:04d}")

    # ---- built once -----------------------------------------------------------------

    def golden(self) -> Golden:
        if self._golden is None:
            t0 = time.monotonic()
            self.say("building the golden workspace (train steps 2,4,6; lifecycle of 2 and 4)")
            g = Scratch(os.path.join(self.workdir, "golden"), self.bucket, "golden", self.moto.url, self.opts.style)
            from ckptflow.chaos.worker import run_stages

            self.quiet_logs()  # importing prefect just added console handlers
            # Train to 4 and finish those lifecycles, then train on to 6 (a resume), as a
            # real run does: step 6's prune then has step 2 to delete on every tier.
            self._train(g, 4)
            for s in (2, 4):
                self._stages(run_stages, g.config_path, s, sanity=False)
            self._train(g, 6)
            self._stages(run_stages, g.config_path, 6, stages=("verify",))
            before = committed_by_tier(g)
            f = clone(g, os.path.join(self.workdir, "final"), self.s3, prefix="final")
            self._stages(run_stages, f.config_path, 6, stages=("compress", "promote", "archive", "prune"))
            self._golden = Golden(g, f, before, committed_by_tier(f))
            self.say(
                f"golden ready in {time.monotonic() - t0:.0f} s: before {before}, after step 6's "
                f"lifecycle {self._golden.after}"
            )
        return self._golden

    def _train(self, g: Scratch, max_steps: int) -> None:
        r = procs.run(
            procs.train_cmd(g.hot, RUN_ID, nproc=1, max_steps=max_steps, save_every=2),
            env=self.env,
            log_path=self.log("golden-train.log"),
            timeout=self.opts.timeout_s,
        )
        if r.rc != 0:
            raise HarnessError(f"training the golden run failed (rc={r.rc}); see {r.log_path}")

    @staticmethod
    def _stages(run_stages, config: str, step: int, **kw) -> None:
        out = run_stages(config, RUN_ID, step, **kw)
        if out.get("status") != "done":
            raise HarnessError(f"golden lifecycle of step {step} did not finish: {out}")

    def baseline(self, nproc: int) -> dict[int, tuple[float, float]]:
        """(loss, lr) per step of an uninterrupted trainer run: what an exact resume reproduces."""
        if nproc not in self._baselines:
            root = os.path.join(self.workdir, f"baseline-ws{nproc}")
            r = procs.run(
                procs.train_cmd(root, RUN_ID, nproc=nproc, max_steps=TRAIN_STEPS, save_every=SAVE_EVERY),
                env=self.env,
                log_path=self.log(f"baseline-ws{nproc}.log"),
                timeout=self.opts.timeout_s,
            )
            if r.rc != 0:
                raise HarnessError(f"the uninterrupted baseline run failed (rc={r.rc}); see {r.log_path}")
            self._baselines[nproc] = procs.metrics(layout.run_dir(root, RUN_ID))
            shutil.rmtree(root, ignore_errors=True)
        return self._baselines[nproc]

    def train_baseline(self, cmd_for: Callable[[str], list[str]]) -> dict:
        """The trainer's own timing summary with no Prefect configured (the stall reference)."""
        if self._train_baseline is None:
            root = os.path.join(self.workdir, "baseline-prefect")
            r = procs.run(
                cmd_for(root), env=self.env, log_path=self.log("baseline-prefect.log"), timeout=self.opts.timeout_s
            )
            if r.rc != 0 or r.summary() is None:
                raise HarnessError(f"the no-Prefect baseline run failed (rc={r.rc}); see {r.log_path}")
            self._train_baseline = r.summary()
            shutil.rmtree(root, ignore_errors=True)
        assert self._train_baseline is not None  # r.summary() was checked above (same output, same answer)
        return self._train_baseline

    def prefect(self) -> PrefectServer:
        if self._prefect is None:
            t0 = time.monotonic()
            self.say("starting a Prefect server for the prefect trials")
            self._prefect = PrefectServer(
                os.path.join(self.workdir, "prefect-server"), self.log("prefect-server.log"), self.env
            )
            self.say(f"prefect server up in {time.monotonic() - t0:.0f} s")
        return self._prefect

    def close(self) -> None:
        for stop in (getattr(self._prefect, "stop", None), self.moto.stop):
            if stop is not None:
                try:
                    stop()
                except (OSError, CkptflowError):
                    pass
        self._quiet.close()
        for k, v in self._saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _LogsToFile:
    """Library logs (expected warnings: every fault makes some) go to the campaign's log
    file; the console keeps errors only. Undone by ``close()``."""

    def __init__(self, path: str) -> None:
        self.root = logging.getLogger()
        self.file = logging.FileHandler(path)
        self.file.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        self.saved: list[tuple[logging.Handler, int]] = []
        self.root_level = self.root.level
        self.root.setLevel(min(self.root.level or logging.WARNING, logging.INFO))
        self.root.addHandler(self.file)
        self.refresh()

    def refresh(self) -> None:
        """Quiet handlers installed since (importing prefect installs its console handlers)."""
        seen = {id(h) for h, _ in self.saved}
        for lg in (self.root, logging.getLogger("prefect")):
            for h in lg.handlers:
                if h is not self.file and id(h) not in seen:
                    self.saved.append((h, h.level))
                    h.setLevel(max(h.level, logging.ERROR))

    def close(self) -> None:
        self.root.removeHandler(self.file)
        self.file.close()
        for h, level in self.saved:
            h.setLevel(level)
        self.root.setLevel(self.root_level)
