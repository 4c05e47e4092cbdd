"""ckptflow installs one namespace, and a user's own modules can never shadow it.

Every check runs the real thing: pip installs the project into a folder, and fresh
interpreters import it from a directory that holds a user's ``trainer.py``, ``tasks.py``
and ``flows.py``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tomllib

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
LAYERS = {"ckptflow": "ckptflow", "ckptflow.trainer": "trainer", "ckptflow.tasks": "tasks", "ckptflow.flows": "flows"}


def _py(code: str, cwd: str, **env: str) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.pop("PYTHONPATH", None)
    e.update(env)
    return subprocess.run([PY, "-c", code], cwd=cwd, env=e, capture_output=True, text=True, timeout=120)


@pytest.fixture
def user_project(tmp_path):
    """A training project with modules named like ckptflow's layers (each exits if imported)."""
    for name in ("trainer.py", "tasks.py", "flows.py"):
        (tmp_path / name).write_text(f"raise SystemExit('the user\\'s own {name} was imported')\n")
    return tmp_path


def test_the_integration_line_and_the_cli_work_beside_a_users_trainer_tasks_and_flows(user_project):
    r = _py(
        "from ckptflow import CheckpointManager, CheckpointConfig, Provenance; print(CheckpointManager)",
        str(user_project),
    )
    assert r.returncode == 0, r.stderr
    assert "ckptflow.trainer.checkpointer.CheckpointManager" in r.stdout
    ckptflow = os.path.join(os.path.dirname(PY), "ckptflow")
    r = subprocess.run([ckptflow, "--help"], cwd=user_project, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Usage: ckptflow" in r.stdout and "demo" in r.stdout


def test_importing_ckptflow_is_cheap(user_project):
    """The namespace root loads neither torch nor prefect nor a layer until a name is used."""
    r = _py(
        "import sys, ckptflow; heavy = [m for m in ('torch', 'prefect', 'great_expectations', "
        "'ckptflow.trainer') if m in sys.modules]; print(heavy)",
        str(user_project),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_node_s_part_of_the_lifecycle_never_imports_torch(user_project):
    """A node's worker runs a flow run per part (stage, prune, scan): none of them reads tensors,
    and importing torch cost each 1.7 CPU-s and as much latency (the suite runs about twenty)."""
    r = _py(
        "import sys, ckptflow.flows.nodes, ckptflow.tasks.transfer._parts, ckptflow.tasks.prune, "
        "ckptflow.tasks.stages, ckptflow.trainer.nodes.topology; print('torch' in sys.modules)",
        str(user_project),
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_a_layer_folder_cannot_be_imported_under_its_bare_name():
    """From the repository root `trainer/` is on the path as a folder; importing it bare fails
    loudly instead of loading a second copy of every module."""
    for bare, full in (("trainer", "ckptflow.trainer"), ("tasks", "ckptflow.tasks"), ("flows", "ckptflow.flows")):
        r = _py(f"import {bare}", REPO)
        assert r.returncode != 0
        assert f"import {full}, not {bare}" in r.stderr


def test_no_module_is_loaded_under_two_names():
    """Import every module of every package; no file may back two entries of sys.modules."""
    code = (
        "import importlib, pkgutil, sys, ckptflow\n"
        "skip = ('ckptflow.trainer.train',)\n"  # runs the job when imported as __main__ only
        "for name in " + repr(sorted(LAYERS)) + ":\n"
        "    pkg = importlib.import_module(name)\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, name + '.'):\n"
        "        if m.name not in skip:\n"
        "            importlib.import_module(m.name)\n"
        "files = {}\n"
        "for n, m in list(sys.modules.items()):\n"
        "    f = getattr(m, '__file__', None)\n"
        "    if f and f.startswith(" + repr(tuple(os.path.join(REPO, d) + os.sep for d in LAYERS.values())) + "):\n"
        "        files.setdefault(f, []).append(n)\n"
        "dups = {f: ns for f, ns in files.items() if len(ns) > 1}\n"
        "print(len(files), dups)\n"
    )
    r = _py(code, "/")
    assert r.returncode == 0, r.stderr
    count, dups = r.stdout.split(" ", 1)
    assert int(count) > 90 and dups.strip() == "{}", r.stdout


def test_every_package_folder_is_listed_in_pyproject():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        st = tomllib.load(f)["tool"]["setuptools"]
    assert st["package-dir"] == LAYERS
    found = set()
    for pkg, folder in LAYERS.items():
        for dirpath, _dirs, names in os.walk(os.path.join(REPO, folder)):
            if "__init__.py" in names and "__pycache__" not in dirpath:
                rel = os.path.relpath(dirpath, os.path.join(REPO, folder))
                found.add(pkg if rel == "." else pkg + "." + rel.replace(os.sep, "."))
    # a layer mapped elsewhere is not also a subfolder of ckptflow/
    assert not any(os.path.isdir(os.path.join(REPO, "ckptflow", d)) for d in ("trainer", "tasks", "flows"))
    assert set(st["packages"]) == found


def test_pip_installs_only_the_ckptflow_namespace(tmp_path):
    target = tmp_path / "site"
    r = subprocess.run(
        [PY, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), REPO],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    top = sorted(n for n in os.listdir(target) if n not in ("bin",))
    assert (
        top[0] == "ckptflow" and len(top) == 2 and top[1].startswith("ckptflow-") and top[1].endswith(".dist-info")
    ), top
    # every module of the source tree made it, under its namespaced path
    for pkg, folder in LAYERS.items():
        for dirpath, _dirs, names in os.walk(os.path.join(REPO, folder)):
            if "__pycache__" in dirpath:
                continue
            rel = os.path.relpath(dirpath, os.path.join(REPO, folder))
            dest = os.path.join(target, *pkg.split("."), *([] if rel == "." else rel.split(os.sep)))
            for n in names:
                if n.endswith(".py"):
                    assert os.path.exists(os.path.join(dest, n)), (pkg, rel, n)
    # the C extension was built from the tree as pip sees it (its vendored xxHash headers included)
    if platform.machine() in ("x86_64", "AMD64"):
        built = os.listdir(os.path.join(target, "ckptflow", "fast"))
        assert any(n.startswith("_memcopy.") and n.endswith(".so") for n in built), sorted(built)
    # and the installed copy imports from there, beside nothing else of ours
    r = _py(
        "import ckptflow.trainer.format.layout as l, ckptflow.cli.main; print(l.__file__)",
        str(tmp_path),
        PYTHONPATH=str(target),
        PYTHONNOUSERSITE="1",
    )
    assert r.returncode == 0 and r.stdout.startswith(str(target)), r.stdout + r.stderr
