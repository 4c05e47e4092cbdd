"""ckptflow for checkpoints written by a training framework: each module imports its framework
only when used, so none of them becomes a dependency of the core (``pip install
'ckptflow[transformers]'`` brings the one it needs)."""
