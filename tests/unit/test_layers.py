"""What the code may depend on, read from its source: the trainer reaches torch's private
symbols only through trainer/_torch_private.py, never imports Prefect, and the layers point one
way (cli -> flows -> tasks -> trainer)."""

from __future__ import annotations

import ast
import os

import pytest

from tests.helpers import REPO

ADAPTER = os.path.join("trainer", "_torch_private.py")


def _modules(folder: str) -> list[str]:
    out = []
    for d, _, files in os.walk(os.path.join(REPO, folder)):
        out += [os.path.relpath(os.path.join(d, f), REPO) for f in files if f.endswith(".py")]
    return sorted(out)


def _imports(path: str) -> list[str]:
    with open(os.path.join(REPO, path)) as f:
        tree = ast.parse(f.read(), path)
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _private(name: str) -> bool:
    return name.startswith("torch.") and any(part.startswith("_") for part in name.split(".")[1:])


def _private_attributes(path: str) -> list[str]:
    """Attributes with a leading underscore read or written on torch's objects in the module:
    the planner's plan cache, the stager's state-dict stager, a DTensor's local tensor."""
    with open(os.path.join(REPO, path)) as f:
        src = f.read()
    names = ("_cached_plans_key", "_cached_save_plan", "_state_dict_stager", "_local_tensor")
    return [a for a in names if f".{a}" in src]


@pytest.mark.parametrize("path", [p for p in _modules("trainer") if p != ADAPTER and "reference" not in p])
def test_the_trainer_uses_torch_s_private_symbols_only_through_its_adapter(path):
    assert [n for n in _imports(path) if _private(n)] == [], f"{path}: import it through {ADAPTER}"
    assert _private_attributes(path) == [], f"{path}: reach it through {ADAPTER}"


@pytest.mark.parametrize("path", _modules("trainer"))
def test_the_trainer_never_imports_prefect_or_the_layers_above(path):
    bad = [
        n for n in _imports(path) if n.split(".")[0] == "prefect" or n.startswith(("ckptflow.tasks", "ckptflow.flows"))
    ]
    assert bad == [], path


@pytest.mark.parametrize("path", _modules("tasks"))
def test_tasks_never_import_the_flows_or_the_cli(path):
    bad = [n for n in _imports(path) if n.startswith(("ckptflow.flows", "ckptflow.cli"))]
    assert bad == [], path
