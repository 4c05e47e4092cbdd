"""A user's own check of an adopted checkpoint (``[lifecycle] adopted_check``), as a team would
write one for its Hugging Face models: the weights load and every one of them is finite."""

from __future__ import annotations

import os


def hf_weights_finite(ckpt_dir: str) -> dict:
    import torch
    from safetensors.torch import load_file

    weights = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    bad = [k for k, v in weights.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"non-finite weights: {bad[:5]}")
    return {"tensors": len(weights)}
