"""Where a tier is: the one notion of tier identity.

Two tiers that are one place under two spellings are one tier with two retention policies: ``prune``
through warm deletes what hot's rules protect, because they are the same files. A string comparison of
their URLs misses every alias a user can write: ``file://`` in front, a trailing slash, ``..``, a
symlinked folder, a bind mount, another spelling of the same bucket prefix. So a tier's place is taken
from what the URL *is*:

* a folder: every component of its real path (symlinks resolved) that exists, as ``(device, inode)``,
  then the names of the components that do not exist yet;
* an object store: the scheme, the endpoint, the bucket and the prefix's components.

Two places overlap when one is the other or lies inside it (:func:`overlap`): the same device and
inode at some depth of both, and the rest of one path a prefix of the rest of the other. The config
refuses overlapping tiers (``tasks/config.py``) for every command and flow that reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["Place", "below", "overlap", "place_of"]


@dataclass(frozen=True, slots=True)
class Place:
    """A tier's location as identity, not spelling."""

    kind: str
    """``"folder"`` or ``"object"``."""
    shown: str
    """The URL as configured, for messages."""
    names: tuple[str, ...]
    """Folder: the real path's components from ``/``; object store: ``(scheme, endpoint, bucket, *prefix)``."""
    ids: tuple[tuple[int, int] | None, ...] = ()
    """Folder: ``(st_dev, st_ino)`` of each component that exists (``None`` for one that does not yet)."""


def place_of(url: str, *, local: bool, endpoint_url: str | None = None) -> Place:
    """The place a tier URL names (``local``: a folder, ``file://`` or a plain path; else an object store at
    ``endpoint_url``, the provider's own when None: one bucket name on two servers is two places)."""
    if local:
        path = url[len("file://") :] if url.startswith("file://") else url
        real = os.path.realpath(os.path.abspath(os.path.expanduser(path)))
        names = tuple(p for p in real.split(os.sep) if p)
        ids: list[tuple[int, int] | None] = []
        cur = os.sep
        for i in range(len(names) + 1):
            if i:
                cur = os.path.join(cur, names[i - 1])
            try:
                st = os.stat(cur)
            except OSError:
                ids += [None] * (len(names) + 1 - i)
                break
            ids.append((st.st_dev, st.st_ino))
        return Place("folder", url, ("",) + names, tuple(ids))
    parts = urlsplit(url)
    endpoint = (endpoint_url or "").rstrip("/").lower()
    prefix = [p for p in parts.path.split("/") if p]
    return Place("object", url, (parts.scheme.lower(), endpoint, parts.netloc, *prefix))


def overlap(a: Place, b: Place) -> bool:
    """Whether ``a`` and ``b`` are one place, or one lies inside the other."""
    return below(a, b) is not None or below(b, a) is not None


def below(outer: Place, inner: Place) -> tuple[str, ...] | None:
    """The components of ``inner`` below ``outer`` (``()``: the same place), or None when ``inner`` is not
    ``outer`` or inside it."""
    if outer.kind != inner.kind:
        return None
    if outer.kind == "object":
        n = len(outer.names)
        return inner.names[n:] if inner.names[:n] == outer.names else None
    # Folders: find a component both paths pass through (same device and inode: a symlink or bind mount
    # spells it differently); below it, ``inner`` must continue ``outer``.
    where = {fid: j for j, fid in enumerate(inner.ids) if fid is not None}
    for i in range(len(outer.ids) - 1, -1, -1):
        fid = outer.ids[i]
        if fid is None or fid not in where:
            continue
        rest_o, rest_i = outer.names[i + 1 :], inner.names[where[fid] + 1 :]
        return rest_i[len(rest_o) :] if rest_i[: len(rest_o)] == rest_o else None
    return None
