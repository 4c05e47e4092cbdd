"""Byte grouping: turn k-byte floats into k byte streams that compress separately.

Why: in trained weights the exponent byte of each value takes a handful of values
(~2.6 bits of information in 8), while the mantissa bytes are close to random.
Interleaved, zstd sees neither pattern; split, the exponent stream compresses ~3x
and the mantissa streams are stored as they are (measured in docs/benchmarks.md).

The transform, for an element width k in {2, 4, 8} (little-endian words):

1. rotate each k-byte word left by one bit, so the sign moves from the top bit to
   the bottom one. The top byte then holds exactly the 8 exponent bits of a
   bfloat16/float32 (the top 8 of float64's 11), instead of the sign plus seven
   exponent bits with the eighth exponent bit stranded among the mantissa bits.
   That costs nothing and gains ~0.07 bit per value on the exponent stream;
2. stream j (j = 0 … k-1) holds byte k-1-j of every rotated word: the most
   significant (exponent) stream first.

It is a permutation of bits, so it is lossless for every bit pattern: NaN payloads,
infinities, subnormals, negative zero. Integer tensors are not grouped (their high
bytes are mostly zero or sign, which zstd already finds), nor are 1-byte floats.

Speed: whole-array numpy ops (~1.3 GB/s per core here for split and merge, and
they release the GIL, so chunks run in parallel). Per-byte strided uint8 ops were
2x slower; a per-element Python loop would be 100x slower.
"""

from __future__ import annotations

import numpy as np

PLAIN = 0
"""Segment kind of bytes compressed as they are (ints, bools, fp8, non-tensor bytes)."""
WIDTHS = (2, 4, 8)
"""Segment kinds that are grouped: the element width in bytes."""
KINDS = (PLAIN, *WIDTHS)

_WORD: dict[int, np.dtype[np.unsignedinteger]] = {2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}

# dtype name (as torch prints it, without "torch.") -> element width to group by.
# Complex numbers are pairs of floats of half their size.
_FLOAT_WIDTH = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "complex32": 2,
    "chalf": 2,
    "float64": 8,
    "double": 8,
    "complex64": 4,
    "cfloat": 4,
    "complex128": 8,
    "cdouble": 8,
}


def kind_for_dtype(dtype: object) -> int:
    """The segment kind for a tensor dtype (``torch.bfloat16`` or ``"bfloat16"``)."""
    s = str(dtype)
    s = s[6:] if s.startswith("torch.") else s
    return _FLOAT_WIDTH.get(s, PLAIN)


def split(data: np.ndarray, k: int) -> list[np.ndarray]:
    """k uint8 streams (most significant first) of ``data``, a uint8 array of n*k bytes."""
    if k not in _WORD:
        raise ValueError(f"element width {k} is not one of {WIDTHS}")
    if data.size % k:
        raise ValueError(f"{data.size} bytes are not a whole number of {k}-byte elements")
    w = data.view(_WORD[k])
    r = w << 1
    r |= w >> (8 * k - 1)
    rows = r.view(np.uint8).reshape(-1, k)
    out = np.empty((k, w.size), np.uint8)
    for j in range(k):
        out[j] = rows[:, k - 1 - j]
    return list(out)


def merge(streams: list[np.ndarray], k: int) -> np.ndarray:
    """Inverse of :func:`split`: the original uint8 bytes."""
    if k not in _WORD or len(streams) != k:
        raise ValueError(f"merge needs {k} streams for width {k}, got {len(streams)}")
    n = streams[0].size
    if any(s.size != n for s in streams):
        raise ValueError("byte streams of one group differ in length")
    t = _WORD[k].type
    if k == 2:
        # two streams: shifts on 16-bit words beat strided byte stores (1.4 vs 0.4 GB/s)
        r = streams[0].astype(t)
        r <<= t(8)
        r |= streams[1]
    else:
        rows = np.empty((n, k), np.uint8)
        for j in range(k):
            rows[:, k - 1 - j] = streams[j]
        r = rows.reshape(-1).view(t)
    # rotate right by one, in place where possible (each temporary costs a pass)
    w = r >> t(1)
    r <<= t(8 * k - 1)
    w |= r
    return w.view(np.uint8)
