"""Shared fixtures: real servers, started once per session.

* ``s3_endpoint``: moto's S3-compatible server in its own process on 127.0.0.1,
  spoken to over HTTP exactly like a real object store.
* ``prefect_api``: one real Prefect server (SQLite) per session; it takes 6-20 s to
  start, so never per test.
* ``torchrun``: launches real ``torchrun`` jobs (gloo, CPU) and returns the result.
* ``tiny_run``: a committed run of the tiny reference model (read-only).
* ``golden``: the loss and LR of every step of an uninterrupted 2-rank run of the tiny model,
  which every resume at 2 ranks must reproduce bit for bit (a save's cadence does not change
  them, so one run serves every test's interval).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from filelock import FileLock

from ckptflow.harness import MotoServer
from tests.helpers import last_per_step, make_run, metrics, prefect_at, run_torchrun


@pytest.fixture(scope="session")
def s3_endpoint():
    """URL of a moto S3 server process; credentials are set in the environment."""
    with MotoServer() as srv:
        old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
        os.environ.update(
            AWS_ACCESS_KEY_ID="testing-key-id",
            AWS_SECRET_ACCESS_KEY="testing-secret-key",
            AWS_DEFAULT_REGION="us-east-1",
        )
        yield srv.url
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_bucket(s3_endpoint):
    """A fresh, empty bucket per test."""
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A real Prefect server for the whole session (``prefect server start``, SQLite, as the demo
    starts it); yields its URL, which this process's Prefect settings point at meanwhile.

    Not Prefect's test harness: it takes its port from the kernel's ephemeral range, where any
    client socket can take it before the server binds (a first health probe then met a reset
    connection), and its exit drains Prefect's log and event workers without a bound; after such
    a start a CI worker waited there for good, with both servers still running. Here the port
    comes from below that range (``harness.free_port``), and the drain is bounded (``prefect_at``)."""
    from ckptflow.harness import PrefectServer

    home = tmp_path_factory.mktemp("prefect")
    with PrefectServer(str(home / "home"), str(home / "server.log")) as server, prefect_at(server.url):
        # what the session's flows logged and emitted reaches the server before it stops
        yield server.url


@pytest.fixture
def torchrun():
    return run_torchrun


def once(tmp_path_factory, name: str, make: Callable[[str], Any]) -> Any:
    """``make(folder)``'s result, made once per test session, however many xdist workers ask: the
    first to come makes it under the session's shared base folder, the others wait on the lock and
    read its JSON. For read-only data (a training run, a curve)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = shared / f"once-{name}", shared / f"once-{name}.json"
    with FileLock(str(shared / f"once-{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            done.write_text(json.dumps(make(str(folder))))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A read-only committed run (steps 2, 4, 6) of the tiny model. Copy it before changing it."""
    return once(tmp_path_factory, "tiny_run", lambda d: make_run(d, "tiny", max_steps=6, save_every=2))


@pytest.fixture
def wide_tables(monkeypatch):
    """CLI tables on one line each, whatever the terminal."""
    monkeypatch.setenv("COLUMNS", "250")


GOLDEN_STEPS = 12


def _golden_curve(root: str) -> list:
    r = run_torchrun(
        ["--ckpt-root", root, "--run-id", "g", "--model", "tiny", "--max-steps", str(GOLDEN_STEPS)]
        + ["--save-every", "4"]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return [[s, x["loss"], x["lr"]] for s, x in sorted(last_per_step(metrics(os.path.join(root, "g"))).items())]


@pytest.fixture(scope="session")
def golden(tmp_path_factory) -> dict[int, tuple[float, float]]:
    """step -> (loss, lr) of the tiny model on 2 ranks (FSDP2, dropout on), steps 1-12."""
    return {int(s): (loss, lr) for s, loss, lr in once(tmp_path_factory, "golden", _golden_curve)}


# ---- how the files are shared out among xdist's workers (`make test`) ---------------------------

# The files that use the session's Prefect server, in two groups of about equal length (each about
# 680 s of the parallel part's wall time on this VM). Each group is one unit of work, run on one
# worker, so a run starts two session servers, not one per worker: a Prefect server costs about
# 28 CPU-s over a run here, most of it polling while idle, and the suite is CPU-bound on 2 cores.
PREFECT_GROUPS = {
    "prefect-a": ("node_lifecycle", "forkserver", "security", "drill", "export", "events", "stages"),
    "prefect-b": ("chaos_faults", "adopt", "lifecycle", "adopt_hf", "cli_prefect"),
}
# Then the longest files, longest first, so that none starts last and runs alone at the end: the
# README's paths (tests/e2e), then the files that start most torchrun jobs. The rest follow in
# collection order.
LONGEST = ("chaos_campaign", "node_demo", "demo", "fleet", "goodput_real_run")
LONGEST += ("nodes", "netns", "any_loop", "probe", "commit_crash", "exact_resume")
_GROUP_OF = {m: g for g, mods in PREFECT_GROUPS.items() for m in mods}


def _module(path: str) -> str:
    return os.path.basename(path).removesuffix(".py").removeprefix("test_")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every user of the session Prefect server is in a group; the groups come first, then the
    longest files, then the rest. xdist hands out units in this order (``--no-loadscope-reorder``);
    a unit's tests keep their order."""
    for item in items:
        mod = _module(str(item.path))
        if "prefect_api" in item.fixturenames and mod not in _GROUP_OF:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session Prefect server: add {mod!r} to a group in "
                "tests/conftest.py's PREFECT_GROUPS, so that a run starts two servers, not one per worker"
            )

    def place(item: pytest.Item) -> tuple[int, int]:
        mod = _module(str(item.path))
        if mod in _GROUP_OF:
            return 0, list(PREFECT_GROUPS).index(_GROUP_OF[mod])
        if mod in LONGEST and "unit" not in item.path.parts:
            return 1, LONGEST.index(mod)
        return 2, 0

    order = {id(item): (place(item), i) for i, item in enumerate(items)}
    items.sort(key=lambda it: order[id(it)])


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile``, with each Prefect group as one unit. (xdist's own ``loadgroup`` marks
    the units by rewriting node ids, which pytest 9.2 no longer lets it do.)"""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileOrPrefectGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(_module(path), path)

    return FileOrPrefectGroup(config, log)
