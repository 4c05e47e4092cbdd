"""What S3 needs that fsspec's s3fs does not give: storage class, multipart tuning, metadata, tags.

Only the data objects of a checkpoint go through here (big, parallel, multipart, with
their digests as object metadata). Listing and the small records (index, manifest,
marker, pins, leases) go through the tier's fsspec file system like every other tier.

Credentials come from boto3's standard chain (environment, profile, instance role);
nothing here reads, stores or logs them, and errors name the ``s3://`` URI only.
"""

from __future__ import annotations

import threading
import urllib.parse
from dataclasses import dataclass
from typing import Any

from ckptflow.tasks.config import TierConfig
from ckptflow.trainer.errors import StorageError
from ckptflow.trainer.fsutil import WRITE_ERRNOS

# Object metadata (x-amz-meta-*) written with every data object, so a re-run can tell
# from a HEAD, without downloading, that an object is already complete and correct.
META_RAW = "ckptflow-raw-xxh3"
META_RAW_SIZE = "ckptflow-raw-size"
META_STORED = "ckptflow-stored-xxh3"
META_CODEC = "ckptflow-codec"
META_LEVEL = "ckptflow-level"

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    size: int
    metadata: dict[str, str]
    storage_class: str


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ("bucket", "a/b")."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, key = url[len("s3://") :].partition("/")
    return bucket, key.strip("/")


class S3Objects:
    """boto3 access to one tier's bucket: one client and one transfer config per tier."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = _shared_client(self.config.endpoint_url, self.config.region, self.config.max_concurrency + 4)
        return self._client

    def transfer_config(self) -> Any:
        """Multipart settings from the tier config (the same object the benchmark baseline uses)."""
        from boto3.s3.transfer import TransferConfig

        chunk = self.config.multipart_chunksize_mb * MiB
        return TransferConfig(
            multipart_threshold=chunk,
            multipart_chunksize=chunk,
            max_concurrency=self.config.max_concurrency,
            use_threads=True,
        )

    def transfer_manager(self) -> Any:
        """One manager per archive/fetch: all files share its pool of ``max_concurrency``."""
        from boto3.s3.transfer import create_transfer_manager

        return create_transfer_manager(self.client, self.transfer_config())

    def head(self, url: str) -> ObjectInfo | None:
        """Size, metadata and storage class of an object; None if it does not exist."""
        from botocore.exceptions import ClientError

        bucket, key = split_s3_url(url)
        try:
            r = self.client.head_object(Bucket=bucket, Key=key)
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return None
            raise storage_error(url, "HEAD", e) from None
        except Exception as e:  # connection errors: botocore raises many types
            raise storage_error(url, "HEAD", e) from None
        return ObjectInfo(int(r["ContentLength"]), dict(r.get("Metadata") or {}), r.get("StorageClass") or "STANDARD")

    def upload_args(self, *, metadata: dict[str, str], tags: dict[str, str]) -> dict[str, Any]:
        args: dict[str, Any] = {"Metadata": metadata}
        if self.config.storage_class:
            args["StorageClass"] = self.config.storage_class
        if tags and self.config.object_tags:
            args["Tagging"] = urllib.parse.urlencode(tags)
        return args

    def upload(self, manager: Any, path: str, url: str, extra_args: dict[str, Any]) -> None:
        """Upload a local file through ``manager`` (multipart above the threshold); blocks."""
        bucket, key = split_s3_url(url)
        try:
            manager.upload(path, bucket, key, extra_args=extra_args).result()
        except Exception as e:
            raise storage_error(url, "upload", e) from None

    def download(self, manager: Any, url: str, path: str) -> None:
        """Download an object to a local file (parallel ranged GETs above the threshold)."""
        bucket, key = split_s3_url(url)
        try:
            manager.download(bucket, key, path).result()
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise  # writing the local file failed (a full disk): the caller's destination, not the store
            raise storage_error(url, "download", e) from None
        except Exception as e:
            # botocore's connection errors carry response=None once its retries run out
            resp = getattr(e, "response", None)
            code = resp.get("Error", {}).get("Code") if isinstance(resp, dict) else None
            if code in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(url) from None
            raise storage_error(url, "download", e) from None


_CLIENTS: dict[tuple, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _shared_client(endpoint_url: str | None, region: str | None, pool: int) -> Any:
    """One boto3 client per endpoint/region/pool (and credential source) per process.

    Building a client costs ~0.1-0.3 s (it loads the service model); a Prefect worker
    runs many short tasks, each opening its tiers anew. Clients are thread-safe and
    refresh expiring credentials themselves; the key includes which static credentials
    or profile the environment names, so changing them yields a new client.
    """
    import os

    key = (endpoint_url, region, pool, os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_PROFILE"))
    with _CLIENTS_LOCK:  # boto3 clients are thread-safe, their creation is not
        client = _CLIENTS.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3",
                endpoint_url=endpoint_url,
                region_name=region,
                config=Config(max_pool_connections=pool, retries={"max_attempts": 5, "mode": "standard"}),
            )
            _CLIENTS[key] = client
        return client


def storage_error(url: str, what: str, e: BaseException) -> StorageError:
    """A StorageError naming the object and the S3 error code, never the request or its headers."""
    code = ""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        code = str(resp.get("Error", {}).get("Code", ""))
    reason = code or type(e).__name__
    return StorageError(
        f"{url}: {what} failed ({reason}); check the bucket, the endpoint_url and "
        "the AWS credentials chain, then re-run (completed objects are skipped)"
    )
