"""PyTorch Lightning with ckptflow: saves committed asynchronously as ckptflow checkpoints, and a
resume that verifies before it loads.

    import lightning as L
    from ckptflow.integrations.lightning import CkptflowCheckpointIO, RNGState

    io = CkptflowCheckpointIO(run_id="lit")
    trainer = L.Trainer(plugins=[io], callbacks=[RNGState(),
                        L.pytorch.callbacks.ModelCheckpoint(every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path=io.last())

Lightning's ``ModelCheckpoint`` keeps deciding when and under which names. Each save is copied on the
training thread into buffers reused from one save to the next (no allocation, so no page faults:
the stall), then written in the background as ``<hot root>/<run>/step_<N>/checkpoint.ckpt`` (a
plain ``torch.save`` file), made durable, digested into a manifest, committed by the rename and
announced with the ``ckptflow.checkpoint.committed`` event: the deployed lifecycle takes it from
there. Only then does the name Lightning asked for appear, as a hard link to the committed file
(a copy across file systems), so ``last.ckpt`` always names a whole, committed checkpoint and a
crash mid-save leaves Lightning's previous one in place. ``save_last=True`` costs nothing more:
the second save at a step becomes one more link. Removing a name (``save_top_k``) removes only
Lightning's link; the committed copy is ckptflow's, kept by the config's retention.

``fit(ckpt_path=io.last())`` resumes from the run's newest checkpoint wherever it is: Lightning's own
``"last"`` looks only in this process's ``ModelCheckpoint`` folder, which without a ``dirpath`` is a
new ``lightning_logs/version_N`` on every start (and is gone with the disk), so it finds nothing and
trains from scratch. ``last()`` lists the run on the hot root, and on warm and cold when hot has no
``latest`` (a replaced disk, a moved job); it returns None only when no tier holds a step, and raises
when a tier that may hold one cannot be reached. The load (of that path, of a ``last.ckpt``, of any
path this plugin wrote) runs on rank 0 of the group, the others meeting it in 10 s rounds however long
a fetch from cold takes, and every rank loads what it found: the newest
committed step (not after the one named; a ``last*.ckpt`` names the newest, so a link that trails its
commit never loses a save) whose every byte matches its digest and whose file parses without running
a pickle. A damaged hot copy is set aside and the step brought back from warm or cold into the hot
root, committed under the manifest the tiers hold; with no good copy the step before is tried. A path
ckptflow did not write is loaded as Lightning would. The hot root must be one every rank reads (a
shared file system), as Lightning's own checkpoint path must: every rank calls ``last()`` before the
process group exists, and they must see the same run.

A fit that resumed from nothing, or from a step older than the run's newest (steps the load found no
good copy of anywhere do not count), would save steps under names the run already holds: two
histories under one run id. Its first save is refused on rank 0, naming the steps and the fix,
before anything is written (the launcher then stops the other ranks). A save of a step the verify
stage quarantined sets that copy aside first.

At an epoch's last batch a stateful loader's state says "every sample yielded"; restored, the
next epoch's iterator yields nothing and Lightning skips that epoch (stock Lightning does too). Such a
checkpoint is saved without the loader's state, so the next epoch starts afresh, in the order its
sampler gives that epoch, as it did in the run that saved.

What Lightning restores is not all of a run's state: it saves no random number generator state, so
a run with dropout or random augmentation draws other numbers after a resume. :class:`RNGState`
(a callback) saves every rank's generators (torch, CUDA, NumPy, Python) and restores each rank's
own, at the same world size. A data loader resumes mid-epoch only if it is stateful (torchdata's
``StatefulDataLoader``); Lightning saves and restores it then.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import re
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

import torch

from ckptflow.integrations._resolve import newest_verified, run_tiers
from ckptflow.tasks.adopt import TORCH_SAVE, commit_written, step_from_name
from ckptflow.tasks.config import load_config
from ckptflow.trainer.errors import CheckpointNotFoundError, ConfigError
from ckptflow.trainer.format import commit, layout
from ckptflow.trainer.recall import TierUnreachableError, steps_with_retries

try:
    from lightning.fabric.plugins import CheckpointIO as _IO
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - exercised only without the extra
    _IO = _Callback = object  # type: ignore[assignment,misc]

__all__ = ["FILE", "CkptflowCheckpointIO", "RNGState"]

FILE = "checkpoint.ckpt"
"""The ``torch.save`` file in each committed step folder."""

_LAST_NAME = re.compile(r"^last(-v\d+)?\.ckpt$")
"""The names ``ModelCheckpoint(save_last=True)`` gives its newest save."""

log = logging.getLogger(__name__)


def _need_lightning() -> None:
    if _IO is object:
        raise ImportError("ckptflow.integrations.lightning needs Lightning: pip install 'ckptflow[lightning]'")


class _Snapshot:
    """A copy of a checkpoint's tensors into CPU buffers kept from one save to the next, found by
    their place in the checkpoint; a tensor whose shape or dtype changed gets a new buffer."""

    def __init__(self) -> None:
        self._bufs: dict[tuple, torch.Tensor] = {}

    def take(self, obj: Any, at: tuple = ()) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._bufs.get(at)
            src = obj.detach()
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=src.is_cuda)
                self._bufs[at] = buf
            buf.copy_(src, non_blocking=src.is_cuda)
            return buf
        if isinstance(obj, dict):
            out = copy.copy(obj)  # its own type (an OrderedDict state dict stays one)
            for k, v in obj.items():
                out[k] = self.take(v, (*at, k))
            return out
        if isinstance(obj, list):
            return [self.take(v, (*at, i)) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.take(v, (*at, i)) for i, v in enumerate(obj))
        return obj  # numbers, strings, hyper-parameters: Lightning builds them afresh for each save


class CkptflowCheckpointIO(_IO):
    """Lightning's checkpoint I/O through ckptflow (see the module's doc).

    ``config``: the ckptflow config file (default: ``$CKPTFLOW_CONFIG`` or ``./ckptflow.toml``);
    its ``[hot] url`` is where checkpoints are committed unless ``root`` is given, and its tiers
    are where a resume looks (``tiers_wait_s``: how long an unreachable one is retried). The event
    goes to ``$PREFECT_API_URL`` when set (the outbox line is written either way)."""

    def __init__(
        self, run_id: str, *, config: str | None = None, root: str | None = None, tiers_wait_s: float = 60.0
    ) -> None:
        _need_lightning()
        self.run_id = layout.check_run_id(run_id)
        self.config = config
        self.root = os.path.abspath(root if root is not None else load_config(config).hot.url)
        self.tiers_wait_s = tiers_wait_s
        self._resumed_from: int | None = None
        self._history_checked = False
        self._hot_only_check = False
        self._passed_over: set[int] = set()
        self._snapshot = _Snapshot()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._error: BaseException | None = None
        self._saved_step: int | None = None
        self._lock = threading.Lock()

    # ---- save --------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        path = os.path.abspath(os.fspath(path))
        step = int(checkpoint["global_step"])
        if not self._history_checked:
            self._refuse_second_history(step)
            self._history_checked = True
        checkpoint = _next_epoch_starts_afresh(checkpoint)
        if step == self._saved_step:  # save_last after the top-k save: the same state, one more name
            self._submit(self._link, step, path)
        else:
            self._wait()  # the buffers are the previous save's until its write has finished
            snap = self._snapshot.take(checkpoint)
            if torch.cuda.is_available():
                torch.cuda.synchronize()  # the copies from the device have landed
            self._saved_step = step
            self._submit(self._write, step, snap, path)

    def _write(self, step: int, snap: dict[str, Any], path: str) -> None:
        def write(tmp: str) -> None:
            torch.save(snap, os.path.join(tmp, FILE))

        run_path = os.path.join(self.root, self.run_id)
        if commit.is_quarantined(run_path, step):  # found bad by the verify stage: this save replaces it
            commit.set_aside(run_path, step, ["quarantined by the verify stage; saved again"], found_by="lightning")

        commit_written(
            run_id=self.run_id,
            root=self.root,
            step=step,
            write=write,
            adopted={"source": path, "format": TORCH_SAVE, "tool": "lightning"},
            world_size=1,
            api_url=os.environ.get("PREFECT_API_URL"),
            already=self._kept,
        )
        self._link(step, path)

    def _kept(self, final: str, run_path: str) -> dict[str, Any]:
        # Committed before (a run resumed from an earlier step saves it again): a committed
        # checkpoint never changes, and this one is the same training state.
        log.warning("%s is committed already; keeping it", final)
        return {"uri": final, "already": True}

    def _link(self, step: int, path: str) -> None:
        src = os.path.join(self.root, self.run_id, layout.step_name(step), FILE)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.ckptflow.tmp"
        if os.path.lexists(tmp):
            os.remove(tmp)
        try:
            os.link(src, tmp)
        except OSError:  # another file system: a copy
            import shutil

            shutil.copyfile(src, tmp)
        os.replace(tmp, path)  # the name appears whole, after the commit

    def last(self) -> str | None:
        """The path ``fit(ckpt_path=...)`` resumes from: the run's newest committed step, on the hot root
        or (when hot has no ``latest``) on warm or cold, or None when no tier holds one (a first start).
        The load verifies it and falls back or brings it from a tier (see the module's doc). Raises
        TierUnreachableError when hot has nothing and a tier cannot be listed within ``tiers_wait_s``:
        never a fresh start over checkpoints it could not see."""
        newest = self._newest()
        if newest is None:
            self._hot_only_check = True  # no tier holds the run: its first save looks at hot alone
            return None
        return os.path.join(self.root, self.run_id, layout.step_name(newest[0]), FILE)

    def _newest(self, *, hot_only: bool = False, passed_over: frozenset[int] = frozenset()) -> tuple[int, str] | None:
        """The run's newest committed step that is not quarantined (nor in ``passed_over``), and where: hot when
        its ``latest`` names a committed step (or ``hot_only``), else the newest of hot's and the tiers'."""
        run_path = os.path.join(self.root, self.run_id)
        hot = [
            s
            for s in commit.committed_steps(run_path)
            if s not in passed_over and not commit.is_quarantined(run_path, s)
        ]
        if (hot and commit.read_latest(run_path) in hot) or hot_only:
            return (max(hot), f"hot ({run_path})") if hot else None
        from ckptflow.tasks.recall import TierRecall

        recall = TierRecall(run_tiers(self.config, self.root)[1:])
        try:
            held = steps_with_retries(recall, self.run_id, wait_s=self.tiers_wait_s) if recall.tiers else set()
        except TierUnreachableError as e:
            raise TierUnreachableError(
                f"run {self.run_id}: {e}. Not resuming: the tiers may hold its newest checkpoint. Make the tier "
                "reachable, or pass fit(ckpt_path=...) a checkpoint yourself"
            ) from e
        held -= passed_over
        if not hot and not held:
            return None
        if held and max(held) > max(hot, default=-1):
            return max(held), recall.describe()
        return max(hot), f"hot ({run_path})"

    def _refuse_second_history(self, step: int) -> None:
        """Before the first save of this fit: a run that holds a step newer than the one this fit resumed from
        (or any step, when it resumed from none) would get a second history under its id. The steps the resume
        found no good copy of anywhere are not counted: going on from the one before them is the fallback."""
        newest = self._newest(hot_only=self._hot_only_check, passed_over=frozenset(self._passed_over))
        if newest is None or (self._resumed_from is not None and newest[0] <= self._resumed_from):
            return
        began = "started without resuming" if self._resumed_from is None else f"resumed from step {self._resumed_from}"
        raise ConfigError(
            f"run {self.run_id} already has checkpoints up to step {newest[0]} ({newest[1]}) and this fit {began}: "
            f"saving step {step} would write a second history under the same run id. Resume from the newest, "
            "trainer.fit(..., ckpt_path=io.last()) with io the CkptflowCheckpointIO, or use a new run_id"
        )

    # ---- load / remove -----------------------------------------------------------------------

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        self._wait()
        path = os.path.abspath(os.fspath(path))
        step = self._step_of(path)
        if step is None:
            log.warning("%s was not written by ckptflow for run %s: loaded as Lightning would", path, self.run_id)
            return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        at_most = None if _LAST_NAME.match(os.path.basename(path)) else step
        folder = _on_rank0(lambda: self._resolve(at_most), f"run {self.run_id}")
        found = layout.parse_step(os.path.basename(folder))
        if found != step and at_most is not None:
            log.warning("%s (step %d) does not verify; resuming from %s instead", path, step, folder)
        self._resumed_from = found
        return TorchCheckpointIO().load_checkpoint(
            os.path.join(folder, FILE), map_location=map_location, weights_only=weights_only
        )

    def _resolve(self, at_most: int | None) -> str:
        folder = newest_verified(
            run_tiers(self.config, self.root),
            self.run_id,
            at_most=at_most,
            passed_over=self._passed_over,
            wait_s=self.tiers_wait_s,
        )
        if folder is None:
            raise CheckpointNotFoundError(
                f"run {self.run_id} has no committed step{'' if at_most is None else f' <= {at_most}'} on any tier"
            )
        return folder

    def _step_of(self, path: str) -> int | None:
        """The committed step ``path`` is a link to (same file), or the step in its name when the
        run has it committed, or the step of a path :meth:`last` gives; None: not ours."""
        run_path = os.path.join(self.root, self.run_id)
        folder = os.path.dirname(path)
        if os.path.dirname(folder) == run_path and os.path.basename(path) == FILE:
            given = layout.parse_step(os.path.basename(folder))
            if given is not None:
                return given  # there or not: the load brings it, or the newest before it
        steps = commit.committed_steps(run_path)
        try:
            st = os.stat(path)
        except OSError:
            st = None
        for s in steps:
            try:
                mine = os.stat(os.path.join(run_path, layout.step_name(s), FILE))
            except OSError:
                continue
            if st is not None and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                return s
        if _LAST_NAME.match(os.path.basename(path)) and steps:
            return steps[0]  # Lightning's newest name, copied across file systems or left by a set-aside step
        named = step_from_name(path)
        return named if named is not None and (named in steps or st is None) else None

    def remove_checkpoint(self, path: Any) -> None:
        self._submit(_remove, os.path.abspath(os.fspath(path)))

    # ---- the background writer ---------------------------------------------------------------

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        self._raise()
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptflow-lightning")
            self._pending = self._pool.submit(self._guard, fn, *args)

    def _guard(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as e:  # raised on the training thread at the next call
            self._error = e

    def _wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def teardown(self) -> None:
        """Every save finished and committed (Lightning calls it when fitting ends); the next fit with this
        object resumes, and is checked, afresh."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._resumed_from, self._saved_step, self._passed_over = None, None, set()
        self._history_checked = self._hot_only_check = False
        self._raise()


def _on_rank0(fn: Callable[[], str], what: str) -> str:
    """``fn()`` on rank 0 of Lightning's group and its answer (or its error) on every rank: one copy is checked
    and brought, and every rank loads the same step. The others wait in rounds of 10 s (``distenv.on_ranks``),
    so a long fetch from cold never outlasts the group's timeout."""
    import torch.distributed as dist

    from ckptflow.trainer.distenv import on_ranks

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    outcome = on_ranks(fn, here=rank == 0, group=None, round_s=10.0, name="lightning-resume")[0]
    assert outcome is not None
    folder, why = outcome
    if folder is None:
        raise CheckpointNotFoundError(f"{what}: rank 0 could not find a checkpoint to resume from: {why}")
    return folder


def _next_epoch_starts_afresh(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """``checkpoint`` without its loaders' state when taken at an epoch's last batch (see the module's doc);
    Lightning's dict itself is left as it is."""
    loops = checkpoint.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    if not isinstance(loops, dict) or not isinstance(fit, dict):
        return checkpoint
    if not fit.get("epoch_loop.batch_progress", {}).get("is_last_batch"):
        return checkpoint
    state = fit.get("state_dict", {})
    if not state.get("combined_loader"):
        return checkpoint
    state = {k: v for k, v in state.items() if k != "combined_loader"}
    return {**checkpoint, "loops": {**loops, "fit_loop": {**fit, "state_dict": state}}}


def _remove(path: str) -> None:
    if os.path.lexists(path):
        os.remove(path)


class RNGState(_Callback):
    """Saves every rank's random number generators (torch, CUDA, NumPy, Python) in the checkpoint
    and restores each rank's own on resume: what Lightning itself leaves out. At another world
    size the generators are left as they are, with a warning.

    Two states per rank: the one the epoch's data iterator was made from, and the one at the save.
    A shuffling sampler draws the epoch's order from the global generator when its iterator is
    made, and Lightning makes it again on a resume in the middle of an epoch: the first state is
    set when the checkpoint loads (before that), the second before the first batch runs (dropout's
    numbers). A checkpoint saved at an epoch's last batch sets the second at once: the next epoch
    starts from it, as it did in the run that saved."""

    def __init__(self) -> None:
        _need_lightning()
        self._trainer: Any = None
        self._epoch = -1
        self._epoch_start: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # The first epoch's iterator is made before any epoch hook, and nothing draws in between
        # (a resume replaces this in load_state_dict, which runs after this hook).
        self._epoch, self._epoch_start = trainer.current_epoch, _rng_state()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch != self._epoch:  # a later epoch: its iterator is made after this hook
            self._epoch, self._epoch_start = trainer.current_epoch, _rng_state()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._pending is not None:
            _set_rng_state(self._pending)
            self._pending = None

    def state_dict(self) -> dict[str, Any]:
        import torch.distributed as dist

        last = bool(self._trainer is not None and self._trainer.fit_loop.epoch_loop.batch_progress.is_last_batch)
        mine = {"epoch": self._epoch, "epoch_start": self._epoch_start, "now": _rng_state(), "epoch_done": last}
        if dist.is_available() and dist.is_initialized():
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)  # the trainer's group and timeout; every rank saves
            return {"ranks": every}
        return {"ranks": [mine]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        import torch.distributed as dist

        ranks = state_dict["ranks"]
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if len(ranks) != world:
            log.warning("RNG state saved by %d ranks, resuming on %d: generators not restored", len(ranks), world)
            return
        mine = ranks[rank]
        if mine["epoch_done"] or mine["epoch_start"] is None:
            _set_rng_state(mine["now"])
            self._epoch, self._epoch_start = mine["epoch"] + 1, mine["now"]
        else:
            _set_rng_state(mine["epoch_start"])
            self._epoch, self._epoch_start = mine["epoch"], mine["epoch_start"]
            self._pending = mine["now"]


def _rng_state() -> dict[str, Any]:
    """Every generator's state as tensors, numbers and tuples: a ``weights_only`` load reads it."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = cast(tuple, np.random.get_state(legacy=True))
    version, state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)),
        "python": (version, list(state), py_gauss),
    }


def _set_rng_state(s: dict[str, Any]) -> None:
    import numpy as np

    torch.set_rng_state(s["torch"])
    if s["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])
    kind, keys, pos, has_gauss, gauss = s["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, state, py_gauss = s["python"]
    random.setstate((version, tuple(state), py_gauss))
