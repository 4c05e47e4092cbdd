"""Small readers shared by tests (not fixtures)."""

from __future__ import annotations

import json
import os

from ckptflow.trainer import layout


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, layout.METRICS)) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_per_step(rows: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in rows:
        out[r["step"]] = r
    return out


def step_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, layout.step_name(step))


def tmp_dirs(run_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(run_dir) if layout.parse_tmp_step(n) is not None)


def read_latest(run_dir: str) -> str:
    with open(os.path.join(run_dir, layout.LATEST)) as f:
        return f.read().strip()


def flip_byte(path: str, offset: int | None = None) -> None:
    size = os.path.getsize(path)
    off = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x01]))
