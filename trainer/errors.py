"""Exception types for ckptflow.

Every error raised on purpose derives from :class:`CkptflowError` *and* the fitting builtin, so callers can
catch either (``except OSError`` keeps working around storage code). Messages name the path, the step and the
fix. Never ``BaseException``: DCP's ``CheckpointException`` is one and slips past ``except Exception``; we
wrap it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "CkptflowError",
    "CodecError",
    "ConfigError",
    "DestinationError",
    "IntegrityError",
    "LoadError",
    "ManifestError",
    "ResourceError",
    "MismatchError",
    "SaveError",
    "StorageError",
    "UnsafePathError",
    "UntrustedError",
]


class CkptflowError(Exception):
    """Root of every error ckptflow raises on purpose."""


class ConfigError(CkptflowError, ValueError):
    """A configuration value is invalid; the message names the field and value."""


class CheckpointNotFoundError(CkptflowError, FileNotFoundError):
    """No committed checkpoint exists (or none that verifies) where one was expected."""


class IntegrityError(CkptflowError, ValueError):
    """A checkpoint's bytes do not match its manifest; ``path`` names the offending file (or the manifest)."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class LoadError(IntegrityError):
    """A checkpoint that passed its checks could not be loaded for a reason other than its bytes: the model or
    optimizer differs from the one that saved it, or a resource ran out on some rank. A resume passes it over
    (it is an ``IntegrityError`` for that) but never calls it damage, so it is not set aside."""


class ManifestError(IntegrityError):
    """The manifest is missing, unreadable, of an unknown format, or tampered with."""


class UntrustedError(ManifestError):
    """The manifest may be intact, but this process cannot trust or read it: unsigned (or signed with another
    key) while a key is configured, or written by a newer ckptflow. Refused, but never called damage: a
    checkpoint refused for this is not set aside (the key or the version is what to fix)."""


class UnsafePathError(IntegrityError):
    """A name in a manifest or an object key escapes the checkpoint (``..``, absolute, symlink)."""


class MismatchError(CkptflowError, ValueError):
    """The checkpoint was made by a different config or data set than the resuming job."""


class SaveError(CkptflowError, RuntimeError):
    """An asynchronous save or its commit failed; earlier checkpoints are untouched."""


class StorageError(CkptflowError, OSError):
    """A storage tier operation failed (after its retries)."""


class DestinationError(StorageError):
    """Writing where the caller asked (a restore's ``--to``, an export's ``OUT``) failed: a full disk, a
    read-only or foreign folder. Not the checkpoint's fault, so no other candidate is tried."""


class ResourceError(CkptflowError, OSError):
    """A check could not run for want of a resource (a process to fork, CPU time on a machine too busy, a
    hard limit below what the check needs): not the input's fault, so never called damage."""


class CodecError(CkptflowError, ValueError):
    """A compressed container is truncated, corrupt or of an unknown format."""
