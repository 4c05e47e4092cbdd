"""``ckptflow export STEP_DIR OUT``: a checkpoint's model weights as Hugging Face-style safetensors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from ckptflow.cli.common import config_option


def export(
    step_dir: Path = typer.Argument(..., help="A committed checkpoint folder (step_NNNNNNNNN; hot, or adopted DCP)."),
    out: Path = typer.Argument(..., help="The new folder to write (refused if it exists)."),
    dtype: str = typer.Option("as_saved", "--dtype", help="as_saved, bf16 or fp16 (floating-point tensors only)."),
    shard_mb: float = typer.Option(5000, "--shard-mb", help="Largest shard in MiB; memory is about one shard."),
    prefix: str = typer.Option("model.", "--prefix", help="Export the tensors named PREFIX..., the prefix stripped."),
    key_map: str | None = typer.Option(None, "--key-map", help="module:function mapping names to Hugging Face's."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    config: Path | None = config_option(),
) -> None:
    """Write the model tensors of a checkpoint as ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` (what transformers' ``from_pretrained`` reads; add the
    model's ``config.json``), consolidated from any world size, every byte read checked against
    the manifest and every tensor read back after it is written. OUT appears whole or not at all."""
    from ckptflow.tasks.config import EXPORT_DTYPES
    from ckptflow.tasks.export import export_dir

    if dtype not in EXPORT_DTYPES:
        raise typer.BadParameter(f"{dtype!r} is not one of {', '.join(EXPORT_DTYPES)}", param_hint="--dtype")
    if shard_mb <= 0:
        raise typer.BadParameter("must be > 0", param_hint="--shard-mb")
    _check_outside_tiers(str(out), config)
    res = export_dir(str(step_dir), str(out), dtype=dtype, shard_mb=shard_mb, prefix=prefix, key_map=key_map)
    if as_json:
        print(json.dumps(res.to_dict(), indent=1))
        return
    s = res.seconds["total"]
    print(
        f"exported step {res.step}: {res.tensors} tensors, {res.bytes:,} bytes ({res.dtype}) in "
        f"{len(res.shards)} shard(s) to {res.location} in {s:.2f} s "
        f"({res.bytes_read / max(s, 1e-9) / 1e6:.0f} MB/s read)"
    )


def _check_outside_tiers(out: str, config: Path | None) -> None:
    """A hand export never goes into a tier's folders: there it would sit beside checkpoints the tier
    committed (and be counted, listed, pruned with them). The lifecycle's export stage writes its own."""
    from ckptflow.cli.common import fail, load
    from ckptflow.cli.errors import EXIT_USAGE
    from ckptflow.tasks.config import where_in_tiers

    hit = where_in_tiers(load(config), os.path.abspath(out))
    if hit is not None:
        fail(
            f"{out} is inside tier {hit[0].name} ({hit[0].url}); an export by hand goes outside the tiers "
            "(the lifecycle's export stage writes <run>/_exports/ itself): give another folder",
            EXIT_USAGE,
        )


def register(app: typer.Typer) -> None:
    app.command("export")(export)
