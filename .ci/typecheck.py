"""Type-check the ckptflow namespace with mypy (``make typecheck``; ``.ci/run`` runs it).

mypy does not follow setuptools' editable-install import hooks, so it cannot see that the
repository folders ``trainer/``, ``tasks/`` and ``flows/`` are ``ckptflow.trainer``,
``ckptflow.tasks`` and ``ckptflow.flows``. This builds that tree from symlinks under
``build/typecheck`` (the same mapping as pyproject's ``package-dir``), runs mypy on it with
the settings in pyproject.toml, and prints every path as the repository file it is.
"""

from __future__ import annotations

import os
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FARM = os.path.join(REPO, "build", "typecheck")
LAYERS = {"trainer": "trainer", "tasks": "tasks", "flows": "flows"}


def build_farm() -> str:
    shutil.rmtree(FARM, ignore_errors=True)
    root = os.path.join(FARM, "ckptflow")
    os.makedirs(root)
    for name in os.listdir(os.path.join(REPO, "ckptflow")):
        if name != "__pycache__":
            os.symlink(os.path.join(REPO, "ckptflow", name), os.path.join(root, name))
    for sub, folder in LAYERS.items():
        os.symlink(os.path.join(REPO, folder), os.path.join(root, sub))
    return root


def main() -> int:
    from mypy import api

    root = build_farm()
    out, err, code = api.run(["--config-file", os.path.join(REPO, "pyproject.toml"), root])
    prefix = os.path.relpath(root, REPO) + os.sep
    for line in out.splitlines():
        if line.startswith(prefix):
            rest = line[len(prefix) :]
            top = rest.split(os.sep, 1)[0]
            line = (LAYERS[top] + rest[len(top) :]) if top in LAYERS else os.path.join("ckptflow", rest)
        print(line)
    if err:
        print(err, file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
