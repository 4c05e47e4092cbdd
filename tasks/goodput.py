"""Goodput: replay failures against a checkpointing strategy, second by second of wall time.

The closed forms in ``tasks.advise`` answer "which interval"; this answers "what does the
whole system deliver", with the parts that make up the rest. A replay is a discrete-event
simulation of one job, exact for the model below (no sampling inside a replay; only the
failure times are random, and they come from a seed or a trace file):

* training runs in steps of ``step_s``; every ``interval_steps`` steps a save **stalls**
  training for ``save_s`` (async: the staging copy), plus ``verify_s`` where verification
  competes with training;
* a save becomes a recovery point ``persist_s`` after it started (staged, written, committed);
  one save is in flight at a time, so a save due before the previous one is durable first
  waits for it (counted as stall) — the trainer's ``AsyncSaver`` does the same;
* a **failure** throws away every step since the newest *durable* checkpoint (a save still in
  flight is no recovery point) and costs ``restore_s`` of **restart** (detect, restart the
  processes, restore, reload) before training runs again; a failure during a restart starts
  the restart over; a failure during a stall loses that save;
* ``effective`` = (steps of kept progress x ``step_s``) / wall time. Every wall second lands in
  exactly one part: ``effective + stall + verify + lost + restart == 1``.

Two ways to end a replay: a job of ``work_steps`` steps (ends with a final save that the job
waits for, as ``CheckpointManager.close()`` does) — what a real run is compared with — or a
wall-clock ``horizon_s`` (the steady state a trace or an MTBF describes; progress made by the
horizon counts as kept).

Pure functions except :func:`read_trace` (a file) and :func:`costs_from_run` (a run's files).
"""

from __future__ import annotations

import math
import os
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ckptflow.tasks.advise import daly_interval, young_interval
from ckptflow.trainer.errors import ConfigError
from ckptflow.trainer.optimum import exact_interval

RESTORE_SOURCES = ("hot", "peer", "warm", "cold")
# The trace shipped with ckptflow: 419 failures in 54 days (Llama 3 405B's unexpected
# interruptions, causes in the published proportions; see the file's header).
SAMPLE_TRACE = os.path.join(os.path.dirname(__file__), "data", "llama3_54d_trace.txt")


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds, all measured (or typed in): what one step, save, persist and restart cost."""

    step_s: float
    save_s: float
    """Training time lost per save: the stall."""
    restore_s: float
    """Failure -> training again: detection, process restart, restore, reload."""
    persist_s: float = 0.0
    """Save start -> committed (durable). Below ``save_s`` it is taken as ``save_s``."""
    verify_s: float = 0.0
    """Training time lost per save to verification that competes with training (0: it runs
    on other machines, as the lifecycle's does)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each number came from."""

    def __post_init__(self) -> None:
        for name in ("step_s", "save_s", "restore_s", "persist_s", "verify_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise ConfigError(f"{name}={v!r} must be a finite number of seconds")
            if v < 0 or (name == "step_s" and v <= 0):
                raise ConfigError(f"{name}={v!r} must be {'> 0' if name == 'step_s' else '>= 0'}")


@dataclass(slots=True)
class Replay:
    """One replay: wall time and where every second of it went."""

    interval_steps: int
    wall_s: float
    kept_steps: int
    failures: int
    saves: int
    parts: dict[str, float]
    """Seconds per part: ``useful``, ``stall``, ``verify``, ``lost``, ``restart``."""
    rollbacks: list[tuple[float, int]] = field(default_factory=list)
    """(failure time, step training resumed from) for every failure outside a restart."""

    @property
    def effective(self) -> float:
        return self.parts["useful"] / self.wall_s if self.wall_s > 0 else 0.0

    def fractions(self) -> dict[str, float]:
        return {k: (v / self.wall_s if self.wall_s > 0 else 0.0) for k, v in self.parts.items()}


def replay(
    costs: Costs,
    interval_steps: int,
    failures: Iterable[float],
    *,
    work_steps: int | None = None,
    horizon_s: float | None = None,
    fast_forward: bool = True,
) -> Replay:
    """Replay ``failures`` (seconds of wall time from the start) against saving every
    ``interval_steps`` steps; stop at ``work_steps`` of kept progress or at ``horizon_s``.
    ``fast_forward=False`` steps through every save (the tests check the shortcut against it)."""
    if not isinstance(interval_steps, int) or interval_steps < 1:
        raise ConfigError(f"interval_steps={interval_steps!r} must be an integer >= 1")
    if (work_steps is None) == (horizon_s is None):
        raise ConfigError("give exactly one of work_steps (a job) or horizon_s (a wall-clock window)")
    if work_steps is not None and work_steps < 1:
        raise ConfigError(f"work_steps={work_steps!r} must be >= 1")
    if horizon_s is not None and not horizon_s > 0:
        raise ConfigError(f"horizon_s={horizon_s!r} must be > 0")
    n, step = interval_steps, costs.step_s
    save = costs.save_s + costs.verify_s
    persist = max(costs.persist_s, costs.save_s)
    stop_t = math.inf if horizon_s is None else float(horizon_s)
    stop_pos = math.inf if work_steps is None else work_steps
    fails = iter(sorted(f for f in failures if f >= 0))
    nf = next(fails, math.inf)

    t = 0.0
    pos = 0  # steps of progress at the current position
    durable = 0  # step of the newest durable checkpoint (0: the start)
    inflight: tuple[float, int] | None = None  # (durable at, step)
    stall = verify = restart = train = 0.0
    n_fail = n_save = 0
    rollbacks: list[tuple[float, int]] = []

    def settle(now: float) -> None:
        nonlocal durable, inflight
        if inflight is not None and inflight[0] <= now:
            durable, inflight = inflight[1], None

    def fail_at(f: float) -> None:
        """Roll back to the newest durable checkpoint, then restart (again, while failures hit it)."""
        nonlocal t, pos, inflight, restart, n_fail, nf
        settle(f)
        t, pos, inflight = f, durable, None
        rollbacks.append((f, durable))
        n_fail += 1
        nf = next(fails, math.inf)
        while True:
            end = t + costs.restore_s
            if nf < end and nf < stop_t:
                restart += nf - t
                t, n_fail, nf = nf, n_fail + 1, next(fails, math.inf)
                continue
            if stop_t < end:
                restart += stop_t - t
                t = stop_t
            else:
                restart += costs.restore_s
                t = end
            return

    while t < stop_t and pos < stop_pos:
        settle(t)
        # Fast-forward whole save cycles no failure or stop can reach: after a save every
        # cycle is the same (train n steps, wait for the previous save if still in flight,
        # stall), so k of them add k times the same amounts.
        if fast_forward and inflight is not None and pos % n == 0:
            wait = max(0.0, persist - save - n * step)
            cycle = n * step + wait + save
            horizon = min(nf, stop_t)
            k = int((horizon - t) / cycle) - 2 if math.isfinite(horizon) else 0
            if math.isfinite(stop_pos):
                k = min(k, int((stop_pos - pos) // n) - 2)
            if k > 0:
                t += k * cycle
                pos += k * n
                train += k * n * step
                stall += k * (wait + costs.save_s)
                verify += k * costs.verify_s
                n_save += k
                durable, inflight = pos - n, (t + persist - save, pos)
                continue
        target = min((pos // n + 1) * n, stop_pos)
        end = t + (target - pos) * step
        first = min(nf, stop_t)
        if first < end:
            train += first - t
            pos += int((first - t) / step + 1e-9)
            if nf <= stop_t:
                fail_at(nf)
            else:
                t = stop_t
            continue
        train += end - t
        t, pos = end, int(target)
        # A save: wait for the one in flight, then stall. The last save of a job is waited
        # for in full (close() returns once it is committed).
        final = pos >= stop_pos
        wait = max(0.0, inflight[0] - t) if inflight is not None else 0.0
        length = wait + (persist if final else save)
        first = min(nf, stop_t)
        if first < t + length:
            stall += first - t
            if nf <= stop_t:
                fail_at(nf)
            else:
                t = stop_t
            continue
        settle(t + wait)
        n_save += 1
        if final:
            stall += length
            t += length
            durable = pos
            break
        stall += wait + costs.save_s
        verify += costs.verify_s
        inflight = (t + wait + persist, pos)
        t += length
    useful = pos * step
    parts = {"useful": useful, "stall": stall, "verify": verify, "lost": train - useful, "restart": restart}
    return Replay(
        interval_steps=n, wall_s=t, kept_steps=pos, failures=n_fail, saves=n_save, parts=parts, rollbacks=rollbacks
    )


# ---- failures ----------------------------------------------------------------------------


def exponential_failures(mtbf_s: float, horizon_s: float, rng: random.Random) -> list[float]:
    """Failure times of a Poisson process with mean gap ``mtbf_s``, up to ``horizon_s``."""
    if not mtbf_s > 0:
        raise ConfigError(f"mtbf_s={mtbf_s!r} must be > 0")
    out: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= horizon_s:
            return out
        out.append(t)


@dataclass(slots=True)
class Trace:
    path: str
    times_s: list[float]
    causes: list[str]
    span_s: float
    """The window the trace covers: its ``# span_s`` header, else the last failure time."""

    @property
    def mtbf_s(self) -> float:
        return self.span_s / max(1, len(self.times_s))


def read_trace(path: str) -> Trace:
    """One failure per line: seconds from the start, optionally a cause after whitespace.
    ``#`` starts a comment; ``# span_s: N`` gives the window the trace covers."""
    times: list[float] = []
    causes: list[str] = []
    span: float | None = None
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        raise FileNotFoundError(2, "no such trace file (one failure time in seconds per line)", path) from None
    for no, raw in enumerate(lines, 1):
        line = raw.strip()
        if line.startswith("#"):
            key, _, val = line[1:].partition(":")
            if key.strip() == "span_s":
                try:
                    span = float(val)
                except ValueError:
                    raise ConfigError(
                        f"{path}:{no}: '# span_s:' needs a number of seconds, got {val.strip()!r}"
                    ) from None
            continue
        if not line:
            continue
        first, _, rest = line.partition(" ")
        try:
            v = float(first)
        except ValueError:
            raise ConfigError(
                f"{path}:{no}: {first!r} is not a failure time; each line is seconds from the start "
                "(then, optionally, a cause)"
            ) from None
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{path}:{no}: failure time {v!r} must be a finite number >= 0")
        times.append(v)
        causes.append(rest.strip() or "unknown")
    if not times:
        raise ConfigError(f"{path}: no failure times in it (one number of seconds per line)")
    order = sorted(range(len(times)), key=times.__getitem__)
    times = [times[i] for i in order]
    causes = [causes[i] for i in order]
    span = span if span is not None else times[-1]
    if span < times[-1]:
        raise ConfigError(f"{path}: '# span_s: {span:g}' is shorter than its last failure ({times[-1]:g} s)")
    return Trace(path=path, times_s=times, causes=causes, span_s=span)


def shifted(trace: Trace, offset_s: float) -> list[float]:
    """The trace started ``offset_s`` into itself, wrapping around (a trial of the same mix)."""
    return sorted((x - offset_s) % trace.span_s for x in trace.times_s)


# The 419 unexpected interruptions of Llama 3 405B's 54-day pre-training snapshot on 16,384
# H100s, by root cause (The Llama 3 Herd of Models, 2024, Table 5; "other" holds the few the
# table spreads over causes with one or two each). The times are synthetic: a Poisson process
# with the same rate (one failure every 3.09 h), seeded, so the trace is reproducible.
LLAMA3_CAUSES = (
    ("faulty-gpu", 148),
    ("gpu-hbm3-memory", 72),
    ("software-bug", 54),
    ("network-switch-cable", 35),
    ("host-maintenance", 32),
    ("gpu-sram-memory", 19),
    ("gpu-system-processor", 17),
    ("nic", 7),
    ("nccl-watchdog-timeout", 7),
    ("silent-data-corruption", 6),
    ("gpu-thermal-interface-sensor", 6),
    ("ssd", 3),
    ("power-supply", 3),
    ("server-chassis", 2),
    ("io-network", 2),
    ("dependency", 2),
    ("cpu", 2),
    ("other", 2),
)
LLAMA3_SPAN_S = 54 * 86400.0


def llama3_trace_lines(seed: int = 405) -> list[str]:
    """The sample trace's lines (``tasks/data/llama3_54d_trace.txt`` is this, written out):
    419 failures in 54 days, uniformly placed given their number (a Poisson process conditioned
    on its count), causes in the published counts, shuffled."""
    rng = random.Random(seed)
    causes = [c for c, k in LLAMA3_CAUSES for _ in range(k)]
    rng.shuffle(causes)
    times = sorted(rng.uniform(0.0, LLAMA3_SPAN_S) for _ in causes)
    head = [
        "# Failure trace shaped like Llama 3 405B's 54-day pre-training snapshot (16,384 H100s):",
        "# 419 unexpected interruptions, causes in the published counts (The Llama 3 Herd of",
        "# Models, 2024, Table 5); times synthetic, uniform given the count (Poisson, MTBF 3.09 h).",
        f"# Regenerate: ckptflow.tasks.goodput.llama3_trace_lines(seed={seed}).",
        "# One failure per line: seconds from the start, then the cause.",
        f"# span_s: {LLAMA3_SPAN_S:.0f}",
    ]
    return head + [f"{t:.1f} {c}" for t, c in zip(times, causes, strict=True)]


# ---- many replays --------------------------------------------------------------------------


@dataclass(slots=True)
class Estimate:
    """Replays of one interval: the mean effective time and a 95 % interval over trials."""

    interval_steps: int
    effective: float
    low: float
    high: float
    trials: int
    fractions: dict[str, float]
    failures_per_trial: float


def estimate(
    costs: Costs,
    interval_steps: int,
    *,
    horizon_s: float,
    mtbf_s: float | None = None,
    trace: Trace | None = None,
    trials: int = 1,
    seed: int = 0,
    work_steps: int | None = None,
) -> Estimate:
    """``trials`` replays of ``horizon_s`` (or, with ``work_steps``, of a job that long, failures
    drawn over ``horizon_s``): MTBF failures from ``seed``, or the trace shifted by a seeded
    offset per trial (trial 0: the trace as recorded)."""
    if (mtbf_s is None) == (trace is None):
        raise ConfigError("give exactly one of an MTBF or a trace")
    if trials < 1:
        raise ConfigError(f"trials={trials!r} must be >= 1")
    runs = []
    for i in range(trials):
        rng = random.Random(seed * 1_000_003 + i)
        if trace is not None:
            f = list(trace.times_s) if i == 0 else shifted(trace, rng.uniform(0, trace.span_s))
            f = [x for x in f if x < horizon_s]
        else:
            assert mtbf_s is not None
            f = exponential_failures(mtbf_s, horizon_s, rng)
        if work_steps is not None:
            runs.append(replay(costs, interval_steps, f, work_steps=work_steps))
        else:
            runs.append(replay(costs, interval_steps, f, horizon_s=horizon_s))
    eff = [r.effective for r in runs]
    mean = statistics.fmean(eff)
    half = 1.96 * statistics.stdev(eff) / math.sqrt(len(eff)) if len(eff) > 1 else 0.0
    fr = {k: statistics.fmean(r.fractions()[k] for r in runs) for k in runs[0].parts}
    return Estimate(
        interval_steps=interval_steps,
        effective=mean,
        low=mean - half,
        high=mean + half,
        trials=trials,
        fractions=fr,
        failures_per_trial=statistics.fmean(r.failures for r in runs),
    )


def optima(costs: Costs, mtbf_s: float) -> dict[str, float]:
    """Young's, Daly's and the exact optimum, in seconds of training between saves."""
    s = costs.save_s + costs.verify_s
    return {
        "young": young_interval(s, mtbf_s),
        "daly": daly_interval(s, mtbf_s),
        "exact": exact_interval(s, mtbf_s),
    }


def advised_steps(costs: Costs, mtbf_s: float) -> int:
    """The exact optimum in whole steps, never shorter than one save in flight allows."""
    t = optima(costs, mtbf_s)["exact"]
    return max(1, round(t / costs.step_s), min_steps_in_flight(costs))


def min_steps_in_flight(costs: Costs) -> int:
    """Fewest steps between saves for which a save is durable before the next is due."""
    return max(1, math.ceil((max(costs.persist_s, costs.save_s) - costs.save_s - costs.verify_s) / costs.step_s))


def sweep_intervals(center: int, lo: int = 1, points: int = 25) -> list[int]:
    """Intervals from center/16 to 16x center, log-spaced, whole steps, sorted, unique."""
    out = {max(lo, round(center * 2 ** (8 * (i / (points - 1)) - 4))) for i in range(points)}
    out.add(center)
    return sorted(out)


@dataclass(slots=True)
class GoodputReport:
    costs: Costs
    mtbf_s: float
    source: str
    restore_source: str
    horizon_s: float
    chosen: Estimate
    optima_s: dict[str, float]
    optima_steps: dict[str, int]
    sweep: list[Estimate]
    seed: int
    trace: str | None = None
    notes: list[str] = field(default_factory=list)
    work_steps: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "effective": self.chosen.effective,
            "effective_low": self.chosen.low,
            "effective_high": self.chosen.high,
            "interval_steps": self.chosen.interval_steps,
            "interval_s": self.chosen.interval_steps * self.costs.step_s,
            "parts": self.chosen.fractions,
            "failures_per_trial": self.chosen.failures_per_trial,
            "trials": self.chosen.trials,
            "seed": self.seed,
            "horizon_s": self.horizon_s if math.isfinite(self.horizon_s) else None,
            "work_steps": self.work_steps,
            "mtbf_s": self.mtbf_s,
            "failures_from": self.source,
            "trace": self.trace,
            "restore_source": self.restore_source,
            "costs": asdict(self.costs),
            "optima_s": self.optima_s,
            "optima_steps": self.optima_steps,
            "sweep": [asdict(e) for e in self.sweep],
            "notes": self.notes,
        }


def goodput(
    costs: Costs,
    *,
    interval_steps: int | None = None,
    mtbf_s: float | None = None,
    trace: Trace | None = None,
    horizon_s: float | None = None,
    trials: int = 1,
    seed: int = 0,
    restore_source: str = "hot",
    sweep_points: int = 25,
    work_steps: int | None = None,
) -> GoodputReport:
    """The effective training time at ``interval_steps`` (default: the advised interval), its
    parts, and a sweep of intervals around the optimum (for the plot). ``work_steps``: replay a
    job of that many steps (ending in its final save) instead of a wall-clock window — how a
    finished run is compared with its replay."""
    if restore_source not in RESTORE_SOURCES:
        raise ConfigError(f"restore source {restore_source!r}; choose one of {', '.join(RESTORE_SOURCES)}")
    if trace is not None:
        m = trace.mtbf_s if mtbf_s is None else mtbf_s
        horizon = horizon_s or (math.inf if work_steps else trace.span_s)
        source = f"trace {trace.path} ({len(trace.times_s)} failures in {trace.span_s / 3600:.1f} h)"
    elif mtbf_s is not None:
        m = mtbf_s
        horizon = horizon_s or (200.0 * mtbf_s + (10.0 * work_steps * costs.step_s if work_steps else 0.0))
        source = f"exponential, MTBF {mtbf_s / 3600:.3g} h"
    else:
        raise ConfigError("give an MTBF (--mtbf-hours) or a trace (--trace)")
    opt = optima(costs, m)
    opt_steps = {k: max(1, round(v / costs.step_s)) for k, v in opt.items()}
    n = interval_steps or advised_steps(costs, m)

    def one(k: int) -> Estimate:
        if trace is not None:
            return estimate(costs, k, horizon_s=horizon, trace=trace, trials=trials, seed=seed, work_steps=work_steps)
        return estimate(costs, k, horizon_s=horizon, mtbf_s=m, trials=trials, seed=seed, work_steps=work_steps)

    chosen = one(n)
    sweep = [chosen if k == n else one(k) for k in sweep_intervals(opt_steps["exact"], points=sweep_points)]
    notes = []
    if n < min_steps_in_flight(costs):
        notes.append(
            f"every {n} steps saves more often than one save in flight allows (persist "
            f"{costs.persist_s:.3g} s > {n} steps + stall): each save waits for the previous one"
        )
    return GoodputReport(
        costs=costs,
        mtbf_s=m,
        source=source,
        restore_source=restore_source,
        horizon_s=horizon,
        chosen=chosen,
        optima_s=opt,
        optima_steps=opt_steps,
        sweep=sweep,
        seed=seed,
        trace=trace.path if trace else None,
        notes=notes,
        work_steps=work_steps,
    )


def largest_loss(fractions: dict[str, float]) -> tuple[str, float]:
    """The part (other than useful time) that costs the most, and its share."""
    rest = {k: v for k, v in fractions.items() if k != "useful"}
    k = max(rest, key=rest.__getitem__)
    return k, rest[k]


def plot(report: GoodputReport, path: str) -> str:
    """PNG of effective time against the interval, the chosen one and Young/Daly marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = report.costs
    xs = [e.interval_steps * c.step_s for e in report.sweep]
    ys = [100 * e.effective for e in report.sweep]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(xs, ys, marker="o", ms=3, label="replay (mean over trials)")
    if report.chosen.trials > 1:
        ax.fill_between(
            xs, [100 * e.low for e in report.sweep], [100 * e.high for e in report.sweep], alpha=0.2, label="95 % CI"
        )
    styles = {"young": ("Young", ":"), "daly": ("Daly", "--"), "exact": ("exact optimum", "-.")}
    for k, (name, ls) in styles.items():
        ax.axvline(report.optima_s[k], ls=ls, color="grey", lw=1, label=f"{name}: {report.optima_s[k]:.3g} s")
    ch = report.chosen
    ax.plot([ch.interval_steps * c.step_s], [100 * ch.effective], "r*", ms=12, label="chosen")
    ax.set_xscale("log")
    ax.set_xlabel("interval (seconds of training between saves)")
    ax.set_ylabel("effective training time (%)")
    ax.set_title(f"goodput, {report.source}; restore from {report.restore_source}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- costs measured from a run -------------------------------------------------------------


def restarts_from_metrics(rows: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds each torchrun restart cost, from a run's ``metrics.jsonl``: the wall time from the
    last step an attempt finished to the first step the next attempt finished, less one step
    (the failure came at most one step after the last row; the first row is one step of work)."""
    out = []
    for a, b in zip(rows, rows[1:], strict=False):
        if b.get("attempt", 0) != a.get("attempt", 0) and isinstance(a.get("wall"), (int, float)):
            if isinstance(b.get("wall"), (int, float)):
                out.append(float(b["wall"]) - float(a["wall"]))
    return out


def step_and_stall(run_dir: str) -> tuple[float | None, float | None]:
    """Mean step (steps not right after a save) and mean stall (the step after a save, less the
    mean step) from a run's ``metrics.jsonl``.

    Means, not the medians ``advise`` uses: a replay adds up time, and a total is n x the mean.
    On this machine the median step undershot the mean by 1.8 % and the median stall the mean
    by 15 %, which over a 460 s run was a 10 s (2 point) optimism in the replay.
    """
    from ckptflow.tasks.advise import MIN_STALL_S, step_deltas
    from ckptflow.trainer.events import read_outbox
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.reference.metrics import read_metrics

    saves = {int(o["step"]) for o in read_outbox(run_dir) if isinstance(o.get("step"), int)}
    saves |= {s for n in os.listdir(run_dir) if (s := layout.parse_step(n)) is not None}
    deltas = step_deltas(read_metrics(run_dir))
    plain = [d for s, d in deltas.items() if (s - 1) not in saves]
    after = [d for s, d in deltas.items() if (s - 1) in saves]
    if not plain:
        return None, None
    step = statistics.fmean(plain)
    return step, (max(MIN_STALL_S, statistics.fmean(after) - step) if after else None)


def costs_from_run(
    run_dir: str, history_dir: str | None = None, *, restore_source: str = "hot"
) -> tuple[dict[str, Any], list[str]]:
    """What a run's own files say: ``{"values": {...}, "sources": {...}}`` for ``step_s``,
    ``save_s``, ``persist_s``, ``restore_s`` (only the measurable ones), and notes on the rest.

    Step and stall: means (:func:`step_and_stall`). Persist: the mean save -> committed
    latency. Restore: ``hot``/``peer`` take the run's own torchrun restarts (median of the gaps
    between attempts in metrics.jsonl, less one step: robust to a failure that hit a restart,
    which shows up as one double gap); ``warm``/``cold`` (or no restart in the run) the
    successful restore drills' median recovery time.
    """
    from ckptflow.tasks.advise import measure_run
    from ckptflow.trainer.events import read_outbox
    from ckptflow.trainer.format import layout
    from ckptflow.trainer.reference.metrics import read_metrics

    m = measure_run(run_dir, history_dir)
    got: dict[str, float] = {}
    src: dict[str, str] = {}
    step, stall = step_and_stall(m.run_dir)
    rows = read_metrics(m.run_dir)
    wall = {r["step"]: r["wall"] for r in rows if isinstance(r.get("wall"), (int, float))}
    lat = [
        float(o["committed_at"]) - wall[o["step"]]
        for o in read_outbox(m.run_dir)
        if o.get("step") in wall and isinstance(o.get("committed_at"), (int, float))
    ]
    for key, v, why in (
        ("step_s", step, "mean step, metrics.jsonl"),
        ("save_s", stall, "mean stall after a save, metrics.jsonl"),
        ("persist_s", statistics.fmean(lat) if lat else None, f"mean save -> committed, {layout.OUTBOX}"),
    ):
        if v is not None:
            got[key], src[key] = max(0.0, float(v)), f"{run_dir}: {why}"
    restarts = restarts_from_metrics(rows) if restore_source in ("hot", "peer") else []
    if restarts and "step_s" in got:
        got["restore_s"] = max(0.0, statistics.median(restarts) - got["step_s"])
        src["restore_s"] = f"{run_dir}: median of {len(restarts)} torchrun restart(s), metrics.jsonl"
    elif m.restore_s is not None:
        got["restore_s"], src["restore_s"] = float(m.restore_s), f"{m.history}: median drill recovery"
    return {"values": got, "sources": src}, list(m.notes)
