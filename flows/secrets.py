"""The manifest-signing key from a Prefect Secret block, for the flows.

The trainer reads the key from ``CKPTFLOW_MANIFEST_KEY`` alone (it never imports Prefect). A
deployment that names a Secret block in ``CKPTFLOW_MANIFEST_KEY_BLOCK`` instead has each flow
load it here when it starts and export it as ``CKPTFLOW_MANIFEST_KEY``: the stages, their
forked children and the sanity step's process then see it as they would the variable. A block
named but not readable fails the flow: skipping authentication would accept exactly the
manifests signing exists to refuse.
"""

from __future__ import annotations

import os

from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.format.manifest import KEY_BLOCK_ENV, KEY_ENV


def export_manifest_key() -> None:
    name = os.environ.get(KEY_BLOCK_ENV)
    if not name or os.environ.get(KEY_ENV):
        return
    from prefect.blocks.system import Secret

    try:
        # async_dispatch pops the _sync kwarg its stub does not declare, and types the result as X | Coroutine
        value = Secret.load(name, _sync=True).value.get_secret_value()  # type: ignore[call-arg, union-attr]
    except Exception as e:  # the block's value never appears in the message
        raise ConfigError(
            f"{KEY_BLOCK_ENV}: cannot read the Prefect Secret block {name!r} "
            f"({type(e).__name__}); create it, or set {KEY_ENV}"
        ) from None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{KEY_BLOCK_ENV}: the Secret block {name!r} must hold a non-empty string")
    os.environ[KEY_ENV] = value
