"""The load's optional acceleration layer: the core reader's checks (``trainer/dcp/reader.py``), at disk speed.

``reader.py`` (``FastReader``): each block copied right after it matched, cold files streamed in while DCP plans;
``verifiedcopy.py`` its block schedule, thread pool and stream; ``memcopy.py`` the inner loop in C without the GIL
(``csrc/_memcopy.c``, vendored xxHash under ``third_party/``; optional at install); ``devicecopy.py`` pinned staging
into CUDA tensors. ``trainer.dcp.reader.open_reader`` picks it unless ``CKPTFLOW_NO_ACCEL=1``; nothing else in the
trainer depends on it. ``benchmarks/bench_load.py`` measures it against the core reader and ``dcp.load``.
"""
