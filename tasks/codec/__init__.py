"""Checkpoint compression codecs, pluggable per storage tier.

``get_codec(name)`` returns one of:

* ``"none"``      — bytes as they are (still digested);
* ``"zstd"``      — a standard zstd frame, multithreaded (``zstd -d`` reads it);
* ``"bytegroup"`` — tensor-aware byte grouping + zstd in a chunked, checksummed,
  parallel ``.ckz`` container (docs/codec.md), the lifecycle's default.

Every codec streams ``src`` to ``dst`` without seeking and returns
:class:`CodecStats` (sizes, xxh3-128 digests of raw and stored bytes, seconds).
``dtype_maps_for_checkpoint`` tells ``bytegroup`` where a DCP checkpoint's tensors
are; ``tasks.codec.tool`` compresses whole checkpoint directories.
"""

from __future__ import annotations

from ckptflow.tasks.codec.base import Codec, CodecStats
from ckptflow.tasks.codec.bytegroup import BytegroupCodec
from ckptflow.tasks.codec.container import ContainerError
from ckptflow.tasks.codec.dtypemap import DtypeMap, Range, dtype_maps_for_checkpoint
from ckptflow.tasks.codec.plain import NoneCodec, ZstdCodec
from ckptflow.trainer.errors import ConfigError

_CODECS = {"bytegroup": BytegroupCodec, "zstd": ZstdCodec, "none": NoneCodec}


def get_codec(name: str) -> Codec:
    """The codec registered under ``name`` (as recorded in a tier index)."""
    try:
        return _CODECS[name]()
    except KeyError:
        raise ConfigError(f"codec {name!r} is unknown; choose one of {available_codecs()}") from None


def available_codecs() -> list[str]:
    return list(_CODECS)


__all__ = [
    "Codec",
    "CodecStats",
    "ContainerError",
    "DtypeMap",
    "Range",
    "available_codecs",
    "dtype_maps_for_checkpoint",
    "get_codec",
]
