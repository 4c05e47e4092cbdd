"""What the code may depend on, read from its source: the trainer reaches torch's private
symbols only through trainer/_torch_private.py, never imports Prefect, and the layers point one
way (cli -> flows -> tasks -> trainer). The load's acceleration layer (ckptflow/fast/) extends the
trainer's reader: it keeps the trainer's rules and may use its internals."""

from __future__ import annotations

import ast
import os

import pytest

from tests.helpers import REPO

ADAPTER = os.path.join("trainer", "_torch_private.py")
FAST = os.path.join("ckptflow", "fast")


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


@pytest.mark.parametrize(
    "path", [p for p in _modules("trainer") + _modules(FAST) if p != ADAPTER and "reference" not in p]
)
def test_the_trainer_uses_torch_s_private_symbols_only_through_its_adapter(path):
    assert [n for n in _imports(path) if _private(n)] == [], f"{path}: import it through {ADAPTER}"
    assert _private_attributes(path) == [], f"{path}: reach it through {ADAPTER}"


@pytest.mark.parametrize("path", _modules("trainer") + _modules(FAST))
def test_the_trainer_never_imports_prefect_or_the_layers_above(path):
    bad = [
        n for n in _imports(path) if n.split(".")[0] == "prefect" or n.startswith(("ckptflow.tasks", "ckptflow.flows"))
    ]
    assert bad == [], path


@pytest.mark.parametrize("path", _modules("tasks"))
def test_tasks_never_import_the_flows_or_the_cli(path):
    bad = [n for n in _imports(path) if n.startswith(("ckptflow.flows", "ckptflow.cli"))]
    assert bad == [], path


def _module_name(path: str) -> str:
    return "ckptflow." + path[: -len(".py")].replace(os.sep, ".").removesuffix(".__init__")


def _trainer_imports_from_outside() -> list[tuple[str, str, str]]:
    """(importing file, trainer module, name) for every ``from ckptflow.trainer... import name``
    in the layers above the trainer."""
    out = []
    for folder in ("tasks", "flows", "ckptflow"):
        for path in _modules(folder):
            if path.startswith(FAST + os.sep):
                continue  # the trainer's own extension
            with open(os.path.join(REPO, path)) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptflow.trainer"):
                    out += [(path, node.module, a.name) for a in node.names]
    return out


def test_the_layers_above_use_only_the_trainer_s_public_names():
    """A trainer module is public when it declares ``__all__``; the rest (and every ``_`` module)
    are the trainer's internals. The layers above import public modules, and from them only the
    names in ``__all__``: the boundary is in the code, not in a convention."""
    import importlib
    import importlib.util

    bad = []
    for path, module, name in _trainer_imports_from_outside():
        if module.startswith("ckptflow.trainer.reference"):
            continue  # the reference job: a training loop of its own, used as one
        mod = importlib.import_module(module)
        if importlib.util.find_spec(f"{module}.{name}") if hasattr(mod, "__path__") else False:
            # `from ckptflow.trainer import events`: the module itself (imported or not yet)
            mod, name = importlib.import_module(f"{module}.{name}"), "*"
        public = getattr(mod, "__all__", None)
        private = any(part.startswith("_") for part in mod.__name__.split("."))
        if private or public is None or (name != "*" and name not in public):
            bad.append(f"{path}: {module}.{name}")
    assert bad == [], bad


@pytest.mark.parametrize("path", [p for p in _modules("trainer") if "reference" not in p])
def test_a_public_trainer_module_exports_what_it_defines(path):
    import importlib

    mod = importlib.import_module(_module_name(path))
    names = getattr(mod, "__all__", [])
    assert all(hasattr(mod, n) for n in names if n not in getattr(mod, "_LAZY", {})), path
