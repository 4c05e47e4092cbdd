"""The exact optimum checkpoint interval and the availability of any interval: pure functions.

Used by the trainer (``CheckpointConfig(interval="auto")``) and by ``ckptflow advise`` / ``goodput``, so they
live below both; Young's and Daly's estimates and the first-order waste are ``ckptflow.tasks.advise``'s. Models and
notation: that module's doc (``S`` save cost (the stall), ``R`` restart cost, ``M`` MTBF, ``T`` the interval of
training time).
"""

from __future__ import annotations

import math

from ckptflow.trainer.errors import ConfigError

__all__ = ["availability", "check_costs", "exact_interval"]


def check_costs(**values: float) -> None:
    for name, v in values.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ConfigError(f"{name}={v!r} must be a finite number")
    for name in ("save_s", "mtbf_s", "interval_s", "step_s"):
        if name in values and not values[name] > 0:
            raise ConfigError(f"{name}={values[name]!r} must be > 0")
    if "restore_s" in values and values["restore_s"] < 0:
        raise ConfigError(f"restore_s={values['restore_s']!r} must be >= 0")


def exact_interval(save_s: float, mtbf_s: float) -> float:
    """The interval that maximises :func:`availability` (exact model): the root ``u = T/M`` in (0, 1) of
    ``g(u) = (1 − u)·e^{u + S/M} − 1``, strictly decreasing there (``g(0) > 0``, ``g(1) = −1``), evaluated
    as ``expm1(u + d) − u·e^{u + d}`` to keep precision when ``S ≪ M``."""
    check_costs(save_s=save_s, mtbf_s=mtbf_s)
    d = save_s / mtbf_s
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        g = math.expm1(mid + d) - mid * math.exp(mid + d)
        if g > 0:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-15 * hi:
            break
    return 0.5 * (lo + hi) * mtbf_s


def availability(interval_s: float, save_s: float, restore_s: float, mtbf_s: float) -> float:
    """Expected fraction of wall time spent on new training (exact model, in (0, 1))."""
    check_costs(interval_s=interval_s, save_s=save_s, restore_s=restore_s, mtbf_s=mtbf_s)
    t, s, r, m = interval_s, save_s, restore_s, mtbf_s
    # log form: no overflow for T+S ≫ M, and expm1 keeps precision for T+S ≪ M
    log_den = r / m + _log_expm1((t + s) / m) + math.log(m)
    return math.exp(math.log(t) - log_den)


def _log_expm1(x: float) -> float:
    return x + math.log(-math.expm1(-x)) if x > 30 else math.log(math.expm1(x))
