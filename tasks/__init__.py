"""ckptflow's lifecycle building blocks: plain typed functions, no Prefect.

Tiers and transfers (``storage``, ``transfer``), codecs, retention and prune, the
lifecycle's stages and their records. The flows (``ckptflow.flows``) wrap them as
Prefect tasks; nothing here imports ``ckptflow.flows`` or ``ckptflow.cli``.
"""

if __name__ != "ckptflow.tasks":  # the repository folder imported under its bare name
    raise ImportError(
        f"import ckptflow.tasks, not {__name__}: ckptflow installs one namespace, and a "
        "module loaded under two names would exist twice in one process"
    )
