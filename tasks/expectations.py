"""Great Expectations checks on per-tensor statistics of a restored checkpoint.

Checksums prove the bytes are the bytes that were written; they cannot tell that
what was written is sane. This suite looks at the numbers: every tensor finite,
Adam second moments non-negative, parameter norms moving by no more than a bound
since the previous verified checkpoint, and the step moving forward. The statistics
come from the restore sanity step (``python -m ckptflow.tasks.sanity --stats``), which has
the restored tensors in hand.

``great_expectations`` takes seconds to import: it is imported inside ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ExpectationReport:
    success: bool
    failures: list[str] = field(default_factory=list)
    result: dict[str, Any] = field(default_factory=dict)
    """GX's validation result (JSON), kept beside the stage record."""


def stats_frame(stats: list[dict], prev_stats: list[dict] | None, *, step: int, prev_step: int | None):
    """One row per tensor with the previous checkpoint's norm joined in."""
    import pandas as pd

    df = pd.DataFrame(stats)
    prev = {r["name"]: r["norm"] for r in (prev_stats or [])}
    df["prev_norm"] = df["name"].map(prev)
    # Relative change, with the denominator floored at an RMS of 0.01 per element:
    # zero-initialised tensors (biases, LayerNorm shifts) would otherwise show an
    # "infinite" relative change after their first updates.
    floor = 0.01 * df["numel"].clip(lower=1) ** 0.5
    denom = df["prev_norm"].abs().where(df["prev_norm"].abs() > floor, floor)
    df["norm_change"] = (df["norm"] - df["prev_norm"]).abs() / denom  # NaN without a previous
    df["step"] = step
    df["step_delta"] = step - prev_step if prev_step is not None else 1
    return df


def build_suite(max_norm_change: float):
    import great_expectations as gx
    from great_expectations.expectations.row_conditions import Column

    E = gx.expectations
    suite = gx.ExpectationSuite(name="ckptflow-tensor-stats")
    suite.add_expectation(
        E.ExpectColumnValuesToBeBetween(
            column="finite_frac", min_value=1.0, max_value=1.0, meta={"why": "every value finite (no NaN/inf)"}
        )
    )
    suite.add_expectation(
        E.ExpectColumnValuesToBeBetween(
            column="min",
            min_value=0.0,
            row_condition=Column("kind") == "exp_avg_sq",
            meta={"why": "Adam second moments are squares: never negative"},
        )
    )
    suite.add_expectation(
        E.ExpectColumnValuesToBeBetween(
            column="norm_change",
            max_value=max_norm_change,
            row_condition=Column("kind") == "param",
            mostly=1.0,
            meta={"why": "parameter norms move by at most the bound between checkpoints"},
        )
    )
    suite.add_expectation(
        E.ExpectColumnValuesToBeBetween(column="step_delta", min_value=1, meta={"why": "the step moves forward"})
    )
    return suite


def validate(
    stats: list[dict], prev_stats: list[dict] | None, *, step: int, prev_step: int | None, max_norm_change: float
) -> ExpectationReport:
    import great_expectations as gx

    df = stats_frame(stats, prev_stats, step=step, prev_step=prev_step)
    ctx = gx.get_context(mode="ephemeral")
    try:
        # GX reads this setting as a mapping (Validator._determine_progress_bars); its setter is annotated narrower
        ctx.variables.progress_bars = {"globally": False}  # type: ignore[assignment]
    except Exception:  # older/newer GX: cosmetic only
        pass
    batch = (
        ctx.data_sources.add_pandas("ckptflow")
        .add_dataframe_asset("tensor_stats")
        .add_batch_definition_whole_dataframe("checkpoint")
        .get_batch(batch_parameters={"dataframe": df})
    )
    res = batch.validate(build_suite(max_norm_change))
    d = res.to_json_dict()
    failures = []
    for r in d["results"]:
        if not r["success"]:
            cfg = r["expectation_config"]
            kw = cfg.get("kwargs", {})
            col = kw.get("column")
            bad = r.get("result", {}).get("partial_unexpected_index_list") or []
            names = [df.loc[i, "name"] for i in bad[:5] if i in df.index]
            failures.append(
                f"{cfg.get('type')} on {col} ({(cfg.get('meta') or {}).get('why', '')}): "
                f"{r.get('result', {}).get('unexpected_count', '?')} tensor(s) {names}"
            )
    return ExpectationReport(bool(d["success"]), failures, d)
