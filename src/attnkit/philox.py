"""Dropout's random bits: Philox4x32-10 (Salmon et al., "Parallel random numbers: as
easy as 1, 2, 3", 2011), the counter-based generator Triton's ``tl.rand`` uses.

The drop decision for score (batch element n, head h, row i, key j) is a pure
function of (seed, n, h, i, j)::

    counter = (j // 4, i, (n·H + h) mod 2³², (n·H + h) div 2³²),  key = (seed mod 2³², seed div 2³²)
    word    = philox4x32_10(counter, key)[j mod 4]
    dropped = word < threshold(p)            threshold(p) = floor(p · 2³²)

so every rung, tile size and thread count drops the same weights, and the backward
pass regenerates them instead of storing them. Indices are those of the score array
(packed sequences: packed rows and keys).

>>> words = philox4x32_10(*(np.zeros(1, np.uint32),) * 4, np.uint32(0), np.uint32(0))
>>> [f"{int(w[0]):08x}" for w in words]          # Random123's known answer
['6627e8d5', 'e169c58d', 'bc57ac4c', '9b00dbd8']
"""

from __future__ import annotations

from typing import Any

import numpy as np

M0, M1 = 0xD2511F53, 0xCD9E8D57          # round multipliers
W0, W1 = 0x9E3779B9, 0xBB67AE85          # key schedule (Weyl) increments
ROUNDS = 10
MASK32 = 0xFFFFFFFF


def philox4x32_10(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> tuple[Any, Any, Any, Any]:
    """The four output words for counters (c0, c1, c2, c3) and key (k0, k1): uint32
    NumPy arrays (broadcast together)."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    m0, m1, mask = np.uint64(M0), np.uint64(M1), np.uint64(MASK32)
    for _ in range(ROUNDS):
        p0 = c0 * m0                                     # 32 × 32 → 64-bit products, exact in uint64
        p1 = c2 * m1
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & mask,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & mask)
        k0 = (k0 + np.uint64(W0)) & mask
        k1 = (k1 + np.uint64(W1)) & mask
    return c0.astype(np.uint32), c1.astype(np.uint32), c2.astype(np.uint32), c3.astype(np.uint32)


def threshold(p: float) -> int:
    """Words below this are dropped: floor(p · 2³²), so P(drop) = p to within 2⁻³²."""
    return int(p * 2.0 ** 32)


def key(seed: int) -> tuple[int, int]:
    return seed & MASK32, (seed >> 32) & MASK32


def int64(seed: int) -> int:
    """A seed in [0, 2⁶⁴) as the signed int64 with the same 64 bits (numba and torch
    take int64; :func:`key` gives the same words for both)."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


def words(seed: int, head: Any, rows: Any, cols: Any) -> np.ndarray:
    """The uint32 word of every (head, row, key): ``head`` is n·H + h, the three index
    arrays broadcast together."""
    head = np.asarray(head, dtype=np.uint64)
    rows = np.asarray(rows, dtype=np.uint64)
    cols = np.asarray(cols, dtype=np.uint64)
    k0, k1 = key(seed)
    out = philox4x32_10(cols >> np.uint64(2), rows, head & np.uint64(MASK32), head >> np.uint64(32), k0, k1)
    lane = (cols & np.uint64(3)).astype(np.int64)
    shape = np.broadcast_shapes(head.shape, rows.shape, cols.shape)
    w = np.empty(shape, dtype=np.uint32)
    for i in range(4):
        np.copyto(w, np.broadcast_to(out[i], shape), where=np.broadcast_to(lane == i, shape))
    return w


def kept(seed: int, p: float, head: Any, rows: Any, cols: Any) -> np.ndarray:
    """Boolean: True where the weight (head, row, key) survives dropout with probability p.

    >>> k = kept(7, 0.25, 0, np.arange(64)[:, None], np.arange(64)[None, :])
    >>> bool(0.2 < 1 - k.mean() < 0.3)
    True
    """
    return words(seed, head, rows, cols) >= np.uint32(threshold(p))
