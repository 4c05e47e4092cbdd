"""The one ckptflow config file: storage tiers and their policies, lifecycle, Prefect, drills.

Where it comes from (first that exists wins)::

    load_config("path")          the CLI's --config
    $CKPTFLOW_CONFIG             a path; an error if it names a missing file
    ./ckptflow.toml              in the working directory
    built-in default             hot ./.ckptflow/hot, warm ./.ckptflow/warm, no cold

Relative local tier paths are resolved against the directory of the file that names
them (workers and the CLI run from different working directories; the file is the one
fixed point), and against the working directory for the built-in default.

The file is TOML; every section maps to a dataclass below and every key to a field
with the same name. An unknown key is an error naming the key and the file: a typo in
a retention rule must fail loudly, not silently keep the default. Credentials never go
here — cold storage uses the standard AWS chain (env, profile, instance role). The
commented example is ``deployments/ckptflow.example.toml``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from ckptflow.tasks.tierplace import Place, below, overlap, place_of
from ckptflow.trainer.errors import ConfigError

ENV_VAR = "CKPTFLOW_CONFIG"
DEFAULT_FILE = "ckptflow.toml"
BUILTIN = "<built-in default>"
CODECS = ("none", "zstd", "bytegroup")
# S3's storage classes. GLACIER and DEEP_ARCHIVE objects must be restored (hours) before
# they can be read, so a restore drill against them fails by design; GLACIER_IR reads
# immediately and is the usual choice for a cold checkpoint tier.
STORAGE_CLASSES = (
    "STANDARD",
    "STANDARD_IA",
    "ONEZONE_IA",
    "INTELLIGENT_TIERING",
    "GLACIER_IR",
    "GLACIER",
    "DEEP_ARCHIVE",
    "REDUCED_REDUNDANCY",
    "EXPRESS_ONEZONE",
)
_SECRET_KEYS = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token", "key", "secret", "token", "password"}


def _fail(field_name: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{field_name}={value!r} is invalid: {rule}")


@dataclass(kw_only=True, slots=True)
class RetentionConfig:
    """What prune keeps on one tier (beyond what it always keeps: latest, the newest
    verified checkpoint, pinned and leased ones). A checkpoint is kept if any rule keeps it."""

    keep_last: int | None = 3
    """Keep the N newest checkpoints that are not quarantined."""
    keep_every: int | None = None
    """Keep every checkpoint whose step is a multiple of K (long-term history)."""
    keep_best: int | None = None
    """Keep the N best checkpoints by ``best_metric`` (from the manifest's training meta)."""
    best_metric: str = "loss"
    """Metric name in the manifest's ``training`` section that ``keep_best`` ranks by."""
    best_mode: str = "min"
    """"min" (lower is better, e.g. loss) or "max" (e.g. accuracy)."""
    keep_pinned: bool = True
    """Listed in the report as a reason; pinned checkpoints are never deleted regardless."""
    keep_all: bool = False
    """Keep everything (a cold archive that is only ever emptied by hand)."""

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every", "keep_best"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise _fail(f"retention.{name}", v, "must be a positive integer or absent")
        if self.best_mode not in ("min", "max"):
            raise _fail("retention.best_mode", self.best_mode, 'must be "min" or "max"')
        if not self.best_metric:
            raise _fail("retention.best_metric", self.best_metric, "must name a metric")
        if not (self.keep_all or self.keep_last or self.keep_every or self.keep_best):
            raise ConfigError(
                "retention keeps nothing but protected checkpoints: set keep_last, "
                "keep_every, keep_best or keep_all = true"
            )


@dataclass(kw_only=True, slots=True)
class TierConfig:
    """One storage tier: where it is, how it stores, what it keeps."""

    name: str
    """"hot", "warm" or "cold" (set from the section name)."""
    url: str
    """A local folder (hot, warm: commit by rename) or ``s3://bucket/prefix`` (cold: commit by
    marker). Other fsspec object stores (gs://, az://) can be listed, fetched and restored
    from; archiving needs s3:// (storage class, multipart, object metadata)."""
    codec: str = "none"
    """Stored form: "none", "zstd" or "bytegroup" (tensor-aware zstd, best ratio)."""
    level: int | None = None
    """Compression level (zstd levels, -7..22); None = the codec's default."""
    codec_threads: int | None = None
    """Compressor threads per file; None = one per CPU core."""
    retention: RetentionConfig = field(default_factory=RetentionConfig)
    """What prune keeps on this tier."""
    storage_class: str | None = None
    """S3 storage class of data objects (indexes and markers stay STANDARD so a tier can always
    be listed and read). None = the bucket default."""
    endpoint_url: str | None = None
    """Any S3-compatible store (MinIO, Ceph, R2, a local moto); None = AWS."""
    region: str | None = None
    """S3 region; None = from the AWS chain."""
    max_concurrency: int = 8
    """Parallel transfers (files and multipart parts together) per archive/fetch."""
    multipart_chunksize_mb: int = 64
    """Size of one multipart part, and the size above which an upload goes multipart."""
    object_tags: bool = True
    """Tag S3 objects with run and step (for bucket lifecycle rules and cost reports); turn off
    for S3-compatible stores without object tagging."""
    move_after_hours: float | None = None
    """Reconcile moves a checkpoint to the next tier once it is this old; None = never by age."""

    def __post_init__(self) -> None:
        n = self.name
        if not self.name or not self.name.replace("_", "").isalnum():
            raise _fail("tier name", self.name, "must be a short alphanumeric name")
        if not isinstance(self.url, str) or not self.url.strip():
            raise _fail(f"{n}.url", self.url, "must be a local path or s3://bucket/prefix")
        if self.is_s3:
            bucket = self.url[len("s3://") :].split("/", 1)[0]
            if not bucket:
                raise _fail(f"{n}.url", self.url, "names no bucket (s3://bucket/prefix)")
        if self.codec not in CODECS:
            raise _fail(f"{n}.codec", self.codec, f"must be one of {', '.join(CODECS)}")
        if self.level is not None and (isinstance(self.level, bool) or not -7 <= self.level <= 22):
            raise _fail(f"{n}.level", self.level, "must be an integer in [-7, 22] or absent")
        if self.codec_threads is not None and self.codec_threads < 1:
            raise _fail(f"{n}.codec_threads", self.codec_threads, "must be >= 1 or absent")
        if self.storage_class is not None:
            if not self.is_s3:
                raise _fail(f"{n}.storage_class", self.storage_class, "applies to s3:// tiers only")
            if self.storage_class not in STORAGE_CLASSES:
                raise _fail(f"{n}.storage_class", self.storage_class, f"must be one of {', '.join(STORAGE_CLASSES)}")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise _fail(f"{n}.endpoint_url", "<redacted>", "must be an http(s):// URL")
        if not isinstance(self.max_concurrency, int) or not 1 <= self.max_concurrency <= 256:
            raise _fail(f"{n}.max_concurrency", self.max_concurrency, "must be in [1, 256]")
        # S3 refuses parts under 5 MiB (except the last) and over 5 GiB.
        if not isinstance(self.multipart_chunksize_mb, int) or not 5 <= self.multipart_chunksize_mb <= 5120:
            raise _fail(
                f"{n}.multipart_chunksize_mb",
                self.multipart_chunksize_mb,
                "must be in [5, 5120] (S3's part size limits)",
            )
        if self.move_after_hours is not None and self.move_after_hours < 0:
            raise _fail(f"{n}.move_after_hours", self.move_after_hours, "must be >= 0 or absent")

    @property
    def is_s3(self) -> bool:
        return self.url.startswith("s3://")

    def place(self) -> Place:
        """Where this tier is, as identity rather than spelling (``tasks/tierplace.py``)."""
        return place_of(self.url, local=self.is_local, endpoint_url=self.endpoint_url)

    @property
    def is_local(self) -> bool:
        return "://" not in self.url or self.url.startswith("file://")


@dataclass(kw_only=True, slots=True)
class LifecycleConfig:
    """What the lifecycle flow checks before it moves a checkpoint on."""

    sanity_step: bool = True
    """Rebuild the model from the checkpoint and recompute the probe loss."""
    expectations: bool | None = None
    """Great Expectations over per-tensor statistics of the *restored* model and optimizer
    (finite, Adam's second moment >= 0, parameter norm within ``max_norm_change`` of the previous
    verified checkpoint's). The statistics come from the sanity step, so this needs
    ``sanity_step``; None (the default) means "whenever the sanity step runs"."""
    max_norm_change: float = 0.5
    """Largest relative change of the parameter norm between consecutive checkpoints."""
    sanity_timeout_s: float = 900.0
    """How long the sanity step (and an adopted checkpoint's own check) may run. One that runs past it
    is killed and the checkpoint goes on unproven, not quarantined (``tasks/verify.py``)."""
    node_part_timeout_s: float = 1800.0
    """Node-local hot roots: how long the lifecycle waits for every node's part before it takes the
    missing files over from replicas (a node whose worker is down delays only its own part)."""
    adopted_check: str | None = None
    """A checkpoint adopted from another tool records no probe to replay; its sanity step is the
    pickle-free parse of every file, then this ``module:function`` when set: called as
    ``function(ckpt_dir)`` in a fresh process (load the model with its framework, run a forward
    pass), it fails the checkpoint by raising; a dict it returns is recorded with the result."""

    def __post_init__(self) -> None:
        if self.adopted_check is not None and not re.fullmatch(r"[\w.]+:\w+", self.adopted_check):
            raise _fail("lifecycle.adopted_check", self.adopted_check, "must be 'module:function'")
        if self.expectations is None:
            self.expectations = self.sanity_step
        elif self.expectations and not self.sanity_step:
            raise ConfigError(
                "lifecycle.expectations = true needs lifecycle.sanity_step = true: the "
                "expectations check the statistics of the state the sanity step restores; "
                "turn the sanity step on, or the expectations off"
            )
        if not self.sanity_timeout_s > 0:
            raise _fail("lifecycle.sanity_timeout_s", self.sanity_timeout_s, "must be > 0")
        if not self.node_part_timeout_s > 0:
            raise _fail("lifecycle.node_part_timeout_s", self.node_part_timeout_s, "must be > 0")
        if not self.max_norm_change > 0:
            raise _fail("lifecycle.max_norm_change", self.max_norm_change, "must be > 0")


EXPORT_WHEN = ("off", "every", "every_k", "kept")
EXPORT_DTYPES = ("as_saved", "bf16", "fp16")


@dataclass(kw_only=True, slots=True)
class ExportConfig:
    """The export stage: a verified checkpoint's model weights as Hugging Face-style sharded
    safetensors on warm (and cold), for evaluation and inference (``tasks/export.py``)."""

    when: str = "off"
    """Which verified checkpoints: ``off``, ``every`` one, ``every_k`` (steps that are multiples
    of ``every_k``), or ``kept`` (steps the furthest tier's ``retention.keep_every`` keeps for good)."""
    every_k: int | None = None
    dtype: str = "as_saved"
    """``as_saved``, ``bf16`` or ``fp16``: floating-point tensors are cast, others kept as they are."""
    shard_mb: float = 5000.0
    """Largest shard (a tensor bigger than that is a shard of its own, as transformers does);
    the export's memory is about one shard."""
    prefix: str = "model."
    """The tensors exported: those whose name starts with this, the prefix stripped. ckptflow's
    checkpoints hold the model under ``model.``; a torchtitan checkpoint has it at the top (``""``)."""
    key_map: str | None = None
    """``module:function`` mapping each exported name to a Hugging Face name (None drops it)."""
    cold: bool = False
    """Also upload the export to the cold tier."""

    def __post_init__(self) -> None:
        if self.when not in EXPORT_WHEN:
            raise _fail("export.when", self.when, f"must be one of {', '.join(EXPORT_WHEN)}")
        if self.when == "every_k" and not (self.every_k and self.every_k > 0):
            raise _fail("export.every_k", self.every_k, "must be > 0 when export.when = 'every_k'")
        if self.dtype not in EXPORT_DTYPES:
            raise _fail("export.dtype", self.dtype, f"must be one of {', '.join(EXPORT_DTYPES)}")
        if not self.shard_mb > 0:
            raise _fail("export.shard_mb", self.shard_mb, "must be > 0")
        if self.key_map is not None and not re.fullmatch(r"[\w.]+:\w+", self.key_map):
            raise _fail("export.key_map", self.key_map, "must be 'module:function'")


@dataclass(kw_only=True, slots=True)
class PrefectConfig:
    """How the flows run under ``ckptflow serve``."""

    flow_concurrency: int = 2
    """Flow runs at once under ``ckptflow serve`` (a work pool's deployments take their own
    ``concurrency_limit`` from ``deployments/prefect.yaml``)."""
    sanity_per_machine: int = 1
    """Sanity steps at once on one machine (a global concurrency limit ``ckptflow worker``
    creates for its machine; ``flows/limits.py``)."""
    uploads_per_machine: int = 2
    """Archives (S3 uploads) at once on one machine (likewise)."""
    forkserver: bool = True
    """``ckptflow worker --general`` and ``ckptflow serve`` start a fork server
    (``tasks/forkserver.py``): the lifecycle's stages, sanity steps and expectations run in
    children forked from one process that imported torch, DCP, Great Expectations, boto3 and
    s3fs once, instead of paying those imports in every flow run. Prefect's flow-run processes
    themselves start as Prefect starts them."""
    fork_flow_runs: bool | None = None
    """Ignored; accepted so older config files still load (flow runs are no longer forked)."""
    work_pool: str | None = None
    """Ignored; accepted so older config files still load. The work pool is named where the
    deployments are: ``deployments/prefect.yaml``."""

    def __post_init__(self) -> None:
        if self.fork_flow_runs is not None:
            logging.getLogger(__name__).warning(
                "[prefect] fork_flow_runs is ignored: flow runs start as Prefect starts them; remove the key"
            )
        if self.work_pool is not None:
            logging.getLogger(__name__).warning(
                "[prefect] work_pool = %r is ignored: the work pool is named in deployments/prefect.yaml; "
                "remove the key",
                self.work_pool,
            )
        for key in ("flow_concurrency", "sanity_per_machine", "uploads_per_machine"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _fail(f"prefect.{key}", v, "must be an integer >= 1")
        if not isinstance(self.forkserver, bool):
            raise _fail("prefect.forkserver", self.forkserver, "must be true or false")


@dataclass(kw_only=True, slots=True)
class DrillConfig:
    """The nightly restore drill."""

    schedule_cron: str = "0 3 * * *"
    """When the drill runs (cron, in ``timezone``)."""
    timezone: str = "UTC"
    """Time zone of ``schedule_cron``."""
    world_size: int = 1
    """Processes the drill restores into (a reshard check when it differs from training)."""
    random_older: bool = True
    """Also restore one random older checkpoint, not only the newest."""
    webhook_url: str | None = field(default=None, repr=False)
    """Alert target when a drill fails; never logged (it often embeds a token)."""

    def __post_init__(self) -> None:
        if len(self.schedule_cron.split()) != 5:
            raise _fail("drill.schedule_cron", self.schedule_cron, "must have five cron fields")
        if self.world_size < 1:
            raise _fail("drill.world_size", self.world_size, "must be >= 1")
        if self.webhook_url is not None and not self.webhook_url.startswith(("http://", "https://")):
            raise _fail("drill.webhook_url", "<redacted>", "must be an http(s):// URL")


@dataclass(kw_only=True, slots=True)
class CkptflowConfig:
    """The whole config: tiers in restore order (hot, warm, cold) plus flow settings."""

    hot: TierConfig
    """The trainer's checkpoint root (``--ckpt-root``)."""
    warm: TierConfig | None = None
    """A shared file system path; None = promote is skipped."""
    cold: TierConfig | None = None
    """An S3 bucket/prefix; None = archive is skipped."""
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
    prefect: PrefectConfig = field(default_factory=PrefectConfig)
    drill: DrillConfig = field(default_factory=DrillConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    source: str = BUILTIN
    """The file this config was read from (for messages)."""

    def __post_init__(self) -> None:
        if self.hot.is_s3 or not self.hot.is_local:
            raise _fail("hot.url", self.hot.url, "must be a local folder (the trainer writes there)")
        if self.export.when != "off" and self.warm is None:
            raise _fail("export.when", self.export.when, "needs a [warm] tier (the export is written there)")
        if self.export.cold and self.cold is None:
            raise _fail("export.cold", True, "needs a [cold] tier")
        if self.export.when == "kept" and not any(t.retention.keep_every for t in (self.cold, self.warm) if t):
            raise _fail("export.when", "kept", "needs retention.keep_every on the cold or warm tier")
        check_tiers_apart(self.tiers(), self.source)

    def tiers(self) -> list[TierConfig]:
        """Configured tiers in restore order: hot, warm, cold."""
        return [t for t in (self.hot, self.warm, self.cold) if t is not None]


def check_tiers_apart(tiers: list[TierConfig], source: str) -> None:
    """Refuse two tiers that are one place, or one inside the other, however their URLs are spelled: each
    tier's retention and commits would act on the other's checkpoints (a prune through warm deleting what
    hot still needs)."""
    places = [(t, t.place()) for t in tiers]
    for i, (a, pa) in enumerate(places):
        for b, pb in places[i + 1 :]:
            if overlap(pa, pb):
                how = "the same place" if pa.names == pb.names else "one inside the other"
                raise ConfigError(
                    f"{source}: tiers {a.name} ({a.url}) and {b.name} ({b.url}) are {how} "
                    f"(compared by what they resolve to, not by spelling); each tier needs a root of its own, "
                    f"outside the others"
                )


def where_in_tiers(cfg: CkptflowConfig, path: str) -> tuple[TierConfig, tuple[str, ...]] | None:
    """The configured folder tier that holds the local ``path`` (resolved as tiers are: symlinks, bind
    mounts), and ``path``'s components below its root; None when it is in none of them."""
    inner = place_of(path, local=True)
    for t in cfg.tiers():
        if t.is_local and (rel := below(t.place(), inner)) is not None:
            return t, rel
    return None


# ---- loading ----------------------------------------------------------------------


def default_config(base_dir: str | None = None) -> CkptflowConfig:
    """The built-in local setup: two folders under ./.ckptflow, no cold tier."""
    base = base_dir or os.getcwd()
    return CkptflowConfig(
        hot=TierConfig(name="hot", url=os.path.join(base, ".ckptflow", "hot")),
        warm=TierConfig(
            name="warm",
            url=os.path.join(base, ".ckptflow", "warm"),
            codec="bytegroup",
            retention=RetentionConfig(keep_last=10),
        ),
    )


def find_config_file(path: str | None = None) -> str | None:
    """The file :func:`load_config` reads, or None for the built-in default."""
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} (from --config) does not exist")
        return path
    env = os.environ.get(ENV_VAR)
    if env:
        if not os.path.isfile(env):
            raise ConfigError(f"config file {env!r} (from ${ENV_VAR}) does not exist; fix or unset {ENV_VAR}")
        return env
    return DEFAULT_FILE if os.path.isfile(DEFAULT_FILE) else None


def load_config(path: str | None = None) -> CkptflowConfig:
    """Read the config (see the module docstring for where from); validated and typed."""
    found = find_config_file(path)
    if found is None:
        return default_config()
    try:
        with open(found, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{found}: not valid TOML ({e})") from None
    return parse_config(data, source=found)


def parse_config(data: dict[str, Any], *, source: str = BUILTIN) -> CkptflowConfig:
    """Build a config from an already-parsed TOML table; ``source`` names it in errors."""
    base = os.path.dirname(os.path.abspath(source)) if source != BUILTIN else os.getcwd()
    _check_keys(data, {f.name for f in dataclasses.fields(CkptflowConfig)} - {"source"}, "", source)
    if "hot" not in data:
        raise ConfigError(f"{source}: missing section [hot] (the trainer's checkpoint root)")
    try:
        kw: dict[str, Any] = {"source": source}
        for tier in ("hot", "warm", "cold"):
            if tier in data:
                kw[tier] = _tier(data[tier], tier, source, base)
        sections = (
            ("lifecycle", LifecycleConfig),
            ("prefect", PrefectConfig),
            ("drill", DrillConfig),
            ("export", ExportConfig),
        )
        for name, cls in sections:
            if name in data:
                kw[name] = _build(cls, data[name], name, source)
        return CkptflowConfig(**kw)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def _tier(table: Any, name: str, source: str, base: str) -> TierConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{name}] must be a table")
    table = dict(table)
    table.setdefault("name", name)
    if isinstance(table.get("url"), str) and not table["url"].strip():
        # Left empty, a relative path would resolve to the config file's own folder: never what was meant.
        raise ConfigError(f"{source}: [{name}] url is empty; give a folder or s3://bucket/prefix")
    if "retention" in table:
        table["retention"] = _build(RetentionConfig, table["retention"], f"{name}.retention", source)
    url = table.get("url")
    if isinstance(url, str) and "://" not in url:
        table["url"] = os.path.normpath(os.path.join(base, os.path.expanduser(url)))
    return _build(TierConfig, table, name, source)


def _check_keys(table: dict[str, Any], known: set[str], where: str, source: str) -> None:
    for key in table:
        if key in known:
            continue
        full = f"{where}.{key}" if where else key
        hint = (
            (
                " — credentials never go in the config file; use the AWS chain (environment, "
                "~/.aws profile, instance role)"
            )
            if key.lower() in _SECRET_KEYS
            else ""
        )
        raise ConfigError(f"{source}: unknown key {full!r}{hint} (known here: {', '.join(sorted(known))})")


def _build(cls: type, table: Any, where: str, source: str) -> Any:
    """Instantiate ``cls`` from a TOML table, checking keys and value types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{where}] must be a table, not {type(table).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    _check_keys(table, fields, where, source)
    for key, value in table.items():
        if not _type_ok(value, hints[key]):
            raise ConfigError(
                f"{source}: {where}.{key} = {value!r} has the wrong type (expected {_type_name(hints[key])})"
            )
    try:
        return cls(**table)
    except ConfigError as e:
        raise ConfigError(f"{source}: [{where}] {e}") from None


def _type_ok(value: Any, hint: Any) -> bool:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return isinstance(value, hint)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _type_name(hint: Any) -> str:
    args = typing.get_args(hint)
    if args:
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    return getattr(hint, "__name__", str(hint))
