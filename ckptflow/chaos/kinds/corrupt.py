"""``corrupt``: damage step 6 on one tier (or on all three), then prove the damage is found
before anything is loaded or unpickled, named by path, and that restore falls back.

The workspace is a clone of ``final`` (steps 4 and 6 on hot, warm and cold). Damage:

================  ==================================================================
bitflip           one byte of a stored file/object flipped
truncate          a stored file/object cut short
missing           a stored file/object deleted
edit_manifest     manifest.json edited without re-signing: a file entry, a training
                  value (refused only when signing is on: the campaign signs by default),
                  or an unsafe name (``../``)
marker_no_objects the commit proof stays (marker, or manifest on a folder tier), the data goes
objects_no_marker the data stays, the commit proof goes (``_COMMITTED``; manifest.json on folders)
stale_latest      hot only: ``latest`` names a missing step, an older step, or garbage
================  ==================================================================

Checks, all inside :class:`checks.NoUnpickle` (zero pickles may be opened): the tier's own
reader refuses step 6 and names the damaged file (hot: ``trainer.verify``, what resume
and ``ckptflow verify`` use; warm/cold: ``fetch``, what restore and drills use);
``find_resume_point`` skips it; ``restore`` over the damaged tier skips it naming the
path and returns step 4, verified; ``restore`` over all tiers returns a verified
checkpoint (step 6 from an undamaged tier, or step 4 when every copy is damaged).
"""

from __future__ import annotations

import json
import os
import random
import time

from ckptflow.chaos import checks
from ckptflow.chaos.campaign import Campaign
from ckptflow.chaos.model import TrialPlan, TrialResult
from ckptflow.chaos.workspace import Scratch, list_keys
from ckptflow.tasks.transfer import fetch
from ckptflow.trainer.errors import CkptflowError
from ckptflow.trainer.format import layout
from ckptflow.trainer.verify import verify_checkpoint

DAMAGES = ("bitflip", "truncate", "missing", "edit_manifest", "marker_no_objects", "objects_no_marker", "stale_latest")
RECORDS = (layout.MANIFEST, layout.TIER_MANIFEST, layout.COMMIT_MARKER)
STEP = 6


def plan(rng: random.Random, camp: Campaign) -> dict:
    damage = rng.choice(DAMAGES)
    tiers = (
        ["hot"]
        if damage == "stale_latest"
        else (["hot", "warm", "cold"] if rng.random() < 0.2 else [rng.choice(["hot", "warm", "cold"])])
    )
    edits = ["entry", "unsafe"] + (["meta"] if camp.opts.sign else [])
    return {
        "damage": damage,
        "tiers": tiers,
        "pick": rng.random(),
        "edit": rng.choice(edits) if damage == "edit_manifest" else None,
        "latest": rng.choice(["missing", "older", "garbage"]) if damage == "stale_latest" else None,
    }


def run(camp: Campaign, tp: TrialPlan) -> TrialResult:
    p = tp.params
    where = "+".join(p["tiers"])
    label = p["damage"] + (f":{p['edit'] or p['latest']}" if (p["edit"] or p["latest"]) else "")
    res = TrialResult(tp.index, "corrupt", f"{label} on {where}", p)
    sc = camp.clone_golden(tp.index, "corrupt", final=True)
    damaged = {t: _damage(camp, sc, t, p) for t in p["tiers"]}
    res.injected = len(damaged)
    res.detail["damaged"] = damaged
    tiers = {t.name: t for t in sc.tiers()}
    with checks.NoUnpickle() as audit:
        for name, what in damaged.items():
            res.undetected += _detect(sc, tiers[name], what, p["damage"])
        if "hot" in damaged:
            expect = STEP if p["damage"] == "stale_latest" else 4
            prob, rep = checks.resume_problem(sc.run_path, expect)
            if prob:
                res.undetected.append(prob)
            # no problem: resume chose step `expect`, so rep.chosen is set (the check only narrows it)
            elif p["damage"] == "stale_latest" and rep.chosen is not None and rep.latest_was == rep.chosen.step:
                res.undetected.append("resume did not notice that latest is stale")
        t0 = time.monotonic()
        for name in damaged:
            one = checks.restore_check([tiers[name]], sc)
            fallback = STEP if p["damage"] == "stale_latest" else 4
            if one.problem or one.step != fallback:
                res.violations.append(f"restore from {name} alone: step {one.step}, {one.problem}")
            elif p["damage"] not in ("objects_no_marker", "stale_latest") and not any(
                layout.step_name(STEP) in uri and _names(why, damaged[name]) for uri, why in one.skipped
            ):
                res.undetected.append(
                    f"restore from {name} skipped step {STEP} without naming {damaged[name]}: {one.skipped}"
                )
        whole = checks.restore_check(list(tiers.values()), sc)
        res.recovery_s = time.monotonic() - t0
    want = 4 if len(damaged) == 3 and p["damage"] != "stale_latest" else STEP
    if whole.problem or whole.step != want:
        res.violations.append(
            f"restore over all tiers: step {whole.step} from {whole.tier}, expected step {want}: {whole.problem}"
        )
    else:
        res.recovered = True
    if audit.events:
        res.undetected.append(f"something was unpickled while checking damaged data: {audit.events[:5]}")
    res.detail["restored"] = {"step": whole.step, "tier": whole.tier}
    return res


def _names(text: str, what: str) -> bool:
    """The report names the damaged file — or, for an edited manifest, the checkpoint whose
    manifest it is (an edited entry is reported at the file it describes)."""
    base = os.path.basename(what.rstrip("/"))
    if base == layout.MANIFEST:
        return layout.step_name(STEP) in text
    return base in text


# ---- detection on one tier ----------------------------------------------------------------


def _detect(sc: Scratch, tier, what: str, damage: str) -> list[str]:
    if damage == "stale_latest":
        return []  # resume's view is checked by the caller
    if damage == "objects_no_marker" and tier.rule.kind == "marker":
        if STEP in tier.committed_steps(sc.run_id):
            return [f"{tier.name} lists step {STEP} as committed without its commit proof"]
        return []
    # On a file system the rename committed the step: without its manifest it is a damaged
    # checkpoint, which every reader must report (naming the manifest), not one to hide.
    if tier.name == "hot":
        v = verify_checkpoint(tier.url_for(sc.run_id, STEP))
        if v.ok:
            return [f"hot step {STEP} verifies although {what} was damaged"]
        text = " ".join(f"{x.path} {x.what}" for x in v.problems)
    else:
        dst = sc.scratch_dir(f"detect-{tier.name}")
        try:
            fetch(tier, sc.run_id, STEP, dst)
            ok = verify_checkpoint(dst).ok
            return [f"{tier.name} step {STEP} fetched and verified although {what} was damaged"] if ok else []
        except (CkptflowError, OSError) as e:
            text = str(e)
    if not _names(text, what):
        return [f"{tier.name}: the damage was found but {os.path.basename(what)} is not named: {text[:300]}"]
    return []


# ---- damage ------------------------------------------------------------------------------------


def _damage(camp: Campaign, sc: Scratch, tier: str, p: dict) -> str:
    """Apply the damage; returns the path or URL of what was damaged."""
    d = p["damage"]
    if d == "stale_latest":
        target = {
            "missing": layout.step_name(99) + "\n",
            "older": layout.step_name(4) + "\n",
            "garbage": "\x00not a step\n",
        }[p["latest"]]
        path = os.path.join(sc.run_path, layout.LATEST)
        with open(path, "w") as f:
            f.write(target)
        return path
    store = _Store(camp, sc, tier)
    members = store.members()
    if d == "edit_manifest":
        return store.edit_manifest(p["edit"])
    if d == "marker_no_objects":
        for m in members:
            store.delete(m)
        return store.where("")  # every member is gone: the report must name the checkpoint
    if d == "objects_no_marker":
        return store.delete(layout.MANIFEST if store.local else layout.COMMIT_MARKER)
    m = members[int(p["pick"] * len(members))]
    return {"bitflip": store.flip, "truncate": store.truncate, "missing": store.delete}[d](m)


class _Store:
    """Step 6's stored objects on one tier, local folder or bucket prefix."""

    def __init__(self, camp: Campaign, sc: Scratch, tier: str) -> None:
        self.camp, self.sc, self.tier = camp, sc, tier
        self.local = tier != "cold"
        base = sc.hot if tier == "hot" else sc.warm
        self.dir = os.path.join(base, sc.run_id, layout.step_name(STEP))
        self.key = f"{sc.prefix}/{sc.run_id}/{layout.step_name(STEP)}"

    def members(self) -> list[str]:
        if self.local:
            names = sorted(n for n in os.listdir(self.dir) if n not in RECORDS)
        else:
            names = sorted(
                k.rsplit("/", 1)[1]
                for k in list_keys(self.camp.s3, self.camp.bucket, self.key)
                if k.rsplit("/", 1)[1] not in RECORDS
            )
        return names

    def where(self, name: str) -> str:
        return os.path.join(self.dir, name) if self.local else f"s3://{self.camp.bucket}/{self.key}/{name}"

    def read(self, name: str) -> bytes:
        if self.local:
            with open(os.path.join(self.dir, name), "rb") as f:
                return f.read()
        return self.camp.s3.get_object(Bucket=self.camp.bucket, Key=f"{self.key}/{name}")["Body"].read()

    def write(self, name: str, data: bytes) -> None:
        if self.local:
            with open(os.path.join(self.dir, name), "wb") as f:
                f.write(data)
        else:
            self.camp.s3.put_object(Bucket=self.camp.bucket, Key=f"{self.key}/{name}", Body=data)

    def delete(self, name: str) -> str:
        if self.local:
            os.unlink(os.path.join(self.dir, name))
        else:
            self.camp.s3.delete_object(Bucket=self.camp.bucket, Key=f"{self.key}/{name}")
        return self.where(name)

    def flip(self, name: str) -> str:
        data = bytearray(self.read(name))
        data[len(data) // 2] ^= 0x01
        self.write(name, bytes(data))
        return self.where(name)

    def truncate(self, name: str) -> str:
        data = self.read(name)
        self.write(name, data[: max(0, len(data) - max(1, len(data) // 10))])
        return self.where(name)

    def edit_manifest(self, how: str) -> str:
        d = json.loads(self.read(layout.MANIFEST))
        if how == "entry":
            name = sorted(d["files"])[-1]
            d["files"][name]["size"] += 1
        elif how == "meta":
            d["training"]["loss"] = float(d["training"].get("loss", 0.0)) * 0.5
        else:
            d["files"]["../../escape.distcp"] = {"size": 1, "checksum": "0" * 32}
        self.write(layout.MANIFEST, json.dumps(d, indent=1).encode())
        return self.where(layout.MANIFEST)
