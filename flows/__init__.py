"""ckptflow's Prefect flows: lifecycle, reconcile, restore drill, alerts, serve."""

if __name__ != "ckptflow.flows":  # the repository folder imported under its bare name
    raise ImportError(
        f"import ckptflow.flows, not {__name__}: ckptflow installs one namespace, and a "
        "module loaded under two names would exist twice in one process"
    )
