"""The reference job: an example *user* of ``ckptflow.trainer``, not part of the library.

A small decoder-only transformer on deterministic synthetic data (``model``, ``data``),
its builder (``build``: also what the restore sanity step rebuilds from a manifest), and
the training script (``job``), run as ``torchrun ... -m ckptflow.trainer.train``. Tests,
the demo, the chaos campaign and the benchmarks train it; nothing in the library
imports it except the sanity step's allow-list, which always admits its builder.
"""
