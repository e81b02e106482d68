"""Mask geometry: the one band rule (causal and window), sequences (per-sequence
lengths and packed sequences), ALiBi distances, and keep/drop combined — for whole
arrays (the reference) and for tiles (the flash rung). The Triton kernels take their
constants from :func:`band` and :func:`Segment` offsets; ring attention plans its
blocks with :func:`band`.

A sequence (:class:`Segment`) owns query rows [q0, q1) and keys [k0, k1) of its
batch element. Its diagonal is ``diag(i) = i + sigma``: bottom-right alignment puts
the last query on the last key (``sigma = k1 − q1``), top-left the first on the first
(``sigma = k0 − q0``). Key j is visible to query i of the sequence iff
``k0 <= j < k1`` and ``diag(i) − left <= j <= diag(i) + right`` (None = unbounded).
Query rows outside every sequence are padding. Causal and alignment, drawn for
L < S (L=2, S=4) and L > S (L=4, S=2); ``x`` = attended, ``.`` = excluded::

    bottom_right (default)     top_left
    L=2,S=4   x x x .          x . . .
              x x x x          x x . .

    L=4,S=2   . .              x .
              . .   <- fully   x x
              x .      masked  x x
              x x      rows    x x

>>> seg = Segment.of(0, 2, 0, 4, "bottom_right")
>>> seg.sigma, key_range(seg, band(True, None), 0, 1)
(2, (0, 3))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .core import Spec, broadcast_to

Band = tuple[int | None, int | None]


def band(causal: bool, window: Band | None) -> Band:
    """causal and window as one band around the diagonal: (left, right), key j visible
    to query i iff diag(i) − left <= j <= diag(i) + right; None = unbounded. Causal is
    right = 0 (or the window's right side if smaller).

    >>> band(True, None), band(False, (3, None)), band(True, (2, 5))
    ((None, 0), (3, None), (2, 0))
    """
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


@dataclass(frozen=True)
class Segment:
    """One sequence: query rows [q0, q1), keys [k0, k1), diag(i) = i + sigma."""

    q0: int
    q1: int
    k0: int
    k1: int
    sigma: int

    @staticmethod
    def of(q0: int, q1: int, k0: int, k1: int, align: str) -> Segment:
        sigma = k1 - q1 if align == "bottom_right" else k0 - q0
        return Segment(int(q0), int(q1), int(k0), int(k1), int(sigma))


def key_range(seg: Segment, b: Band, r0: int, r1: int) -> tuple[int, int]:
    """Keys [lo, hi) that the band can leave visible to any query in [r0, r1) of seg
    (lo <= hi). Tiles outside are fully excluded and can be skipped."""
    left, right = b
    lo, hi = seg.k0, seg.k1
    if left is not None:
        lo = max(lo, r0 + seg.sigma - left)
    if right is not None:
        hi = min(hi, r1 - 1 + seg.sigma + right + 1)
    return lo, max(lo, hi)


def query_range(seg: Segment, b: Band, c0: int, c1: int) -> tuple[int, int]:
    """Query rows [lo, hi) of seg that can see any key in [c0, c1) (lo <= hi)."""
    left, right = b
    c0, c1 = max(c0, seg.k0), min(c1, seg.k1)
    if c0 >= c1:
        return seg.q0, seg.q0
    lo, hi = seg.q0, seg.q1
    if right is not None:                                # i + sigma + right >= c0
        lo = max(lo, c0 - seg.sigma - right)
    if left is not None:                                 # i + sigma - left <= c1 - 1
        hi = min(hi, c1 - 1 - seg.sigma + left + 1)
    return lo, max(lo, hi)


def filled(x: Any, shape: tuple[int, ...]) -> np.ndarray:
    """A new int64 array of ``shape`` holding x broadcast to it (an assignment: a tenth
    of ``np.array(np.broadcast_to(x, shape))``'s cost on the small arrays of a decoding
    step's bounds)."""
    out = np.empty(shape, dtype=np.int64)
    out[...] = x
    return out


def band_bounds(diag: np.ndarray, k0: Any, k1: Any, b: Band) -> tuple[np.ndarray, np.ndarray]:
    """int64 (lo, hi) of rows with diagonals ``diag`` in sequences of keys [k0, k1)
    (arrays that broadcast with diag): each row sees exactly the keys [lo, hi), lo <= hi."""
    lo, hi = filled(k0, diag.shape), filled(k1, diag.shape)
    left, right = b
    if left is not None:
        lo = np.maximum(lo, diag - left)
    if right is not None:
        hi = np.minimum(hi, diag + right + 1)
    return lo, np.maximum(lo, hi)


def row_key_bounds(seg: Segment, b: Band, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row :func:`key_range`: int64 arrays (lo, hi) of length r1 − r0; query row
    r0 + i sees exactly the keys [lo[i], hi[i]) of its sequence (lo <= hi)."""
    return band_bounds(np.arange(r0, r1, dtype=np.int64) + seg.sigma, seg.k0, seg.k1, b)


def dense_row_bounds(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of every query row of a whole, unpacked call, int64 of shape
    batch + (1, L): row i of batch element b sees exactly the keys [lo, hi) under the
    band and its sequence's keys [kv_starts[b], kv_lengths[b]); padding rows
    (i >= q_lengths[b]) see none."""
    assert not spec.packed and not spec.block
    ql = _lengths(spec, spec.q_lengths, spec.L)[..., None, None]
    kl = _lengths(spec, spec.kv_lengths, spec.S)[..., None, None]
    k0 = _lengths(spec, spec.kv_starts, 0)[..., None, None]
    i = np.arange(spec.L, dtype=np.int64)
    sigma = kl - ql if spec.align == "bottom_right" else k0
    lo, hi = band_bounds(i + sigma, k0, kl, band(spec.causal, spec.window))
    return (lo, hi) if spec.q_lengths is None else (lo, np.where(i < ql, hi, lo))


def tile_partial(seg: Segment, b: Band, r0: int, r1: int, c0: int, c1: int) -> bool:
    """True when the band or the sequence's key range hides part of the tile of rows
    [r0, r1) and keys [c0, c1) (the tile is clear inside every row's bounds)."""
    if c0 < seg.k0 or c1 > seg.k1:
        return True
    left, right = b
    if left is not None and r1 - 1 + seg.sigma - left > c0:   # the last row's lower bound is the largest
        return True
    return right is not None and r0 + seg.sigma + right < c1 - 1


def _lengths(spec: Spec, x: Any, n: int) -> np.ndarray:
    """Lengths broadcast to the batch dims (n for every element when not given)."""
    return np.full(spec.batch, n, dtype=np.int64) if x is None else np.asarray(x, dtype=np.int64)


def _global(spec: Spec) -> tuple[int, int, int, int]:
    """(row origin, key origin, L, S) of the whole problem spec is a block of."""
    r, c = spec.origin
    L, S = spec.extent if spec.extent is not None else (spec.L, spec.S)
    return r, c, L, S


def segments(spec: Spec, b: tuple[int, ...]) -> list[Segment]:
    """The sequences of batch element b (an index into spec.batch) in the call's own
    coordinates: one for dense inputs, one with the element's lengths for q_lengths /
    kv_lengths / kv_starts, and the packed sequences of cu_seqlens (sequences without queries are
    left out). For a block of a larger problem (``spec.origin``) they are the global
    sequences shifted and clipped to the block."""
    r, c, L, S = _global(spec)
    if spec.packed:
        cq = np.asarray(spec.cu_seqlens_q)
        ck = np.asarray(spec.cu_seqlens_k)
        segs = [Segment.of(cq[i], cq[i + 1], ck[i], ck[i + 1], spec.align)
                for i in range(len(cq) - 1) if cq[i + 1] > cq[i]]
    elif not spec.varlen:
        segs = [Segment.of(0, L, 0, S, spec.align)]
    else:
        ql = L if spec.q_lengths is None else int(np.asarray(spec.q_lengths)[b])   # (broadcast to
        kl = S if spec.kv_lengths is None else int(np.asarray(spec.kv_lengths)[b])  # the batch dims)
        k0 = 0 if spec.kv_starts is None else int(np.asarray(spec.kv_starts)[b])
        segs = [Segment.of(0, ql, k0, kl, spec.align)] if ql > 0 else []
    if (r, c) == (0, 0) and spec.extent is None:
        return segs
    out = []
    for g in segs:                                       # to the block's coordinates, clipped to it
        q0, q1 = max(g.q0 - r, 0), min(g.q1 - r, spec.L)
        k0, k1 = max(g.k0 - c, 0), min(g.k1 - c, spec.S)
        if q0 < q1:
            out.append(Segment(q0, q1, k0, max(k0, k1), g.sigma + r - c))
    return out


def _positions(spec: Spec) -> tuple[Any, Any, Any, Any, Any]:
    """Broadcastable integer arrays (i, j, k0, k1, sigma) giving every query/key pair
    its sequence's key range [k0, k1) and diagonal offset, for whole-array masks
    (shapes broadcast to batch + (1, L, S)), in global positions for a block of a
    larger problem. Padding rows get an empty key range."""
    r, c, L, S = _global(spec)
    i = np.arange(r, r + spec.L, dtype=np.int64)[:, None]
    j = np.arange(c, c + spec.S, dtype=np.int64)[None, :]
    if spec.packed:
        cq = np.asarray(spec.cu_seqlens_q, dtype=np.int64)
        ck = np.asarray(spec.cu_seqlens_k, dtype=np.int64)
        seq = np.searchsorted(cq, i[:, 0], side="right") - 1   # each row's sequence
        q0, q1, k0, k1 = cq[seq], cq[seq + 1], ck[seq], ck[seq + 1]
        q0, q1, k0, k1 = (x[:, None] for x in (q0, q1, k0, k1))
        return i, j, k0, k1, (k1 - q1 if spec.align == "bottom_right" else k0 - q0)
    ql = _lengths(spec, spec.q_lengths, L)[..., None, None, None]
    kl = _lengths(spec, spec.kv_lengths, S)[..., None, None, None]
    k0 = _lengths(spec, spec.kv_starts, 0)[..., None, None, None]
    valid = i < ql
    k1 = np.where(valid, kl, k0)                         # padding rows see no key
    return i, j, k0, k1, (kl - ql if spec.align == "bottom_right" else k0)


def index_visible(spec: Spec) -> np.ndarray | None:
    """Boolean array broadcastable to (..., H, L, S), True where the band and the
    sequences let query i see key j; None when neither restricts anything."""
    if not spec.has_index_mask and not spec.varlen:
        return None
    i, j, k0, k1, sigma = _positions(spec)
    diag = i + sigma
    ok = (j >= k0) & (j < k1)
    left, right = band(spec.causal, spec.window)
    if left is not None:
        ok = ok & (j >= diag - left)
    if right is not None:
        ok = ok & (j <= diag + right)
    return ok


def padding_rows(spec: Spec) -> np.ndarray | None:
    """Boolean array broadcastable to (..., H, L), True on query rows that belong to no
    sequence (i >= q_lengths[b]); None when there are none to mark."""
    if spec.q_lengths is None:
        return None
    i = np.arange(spec.origin[0], spec.origin[0] + spec.L, dtype=np.int64)
    return i >= np.asarray(spec.q_lengths, dtype=np.int64)[..., None, None]


def alibi_bias(spec: Spec, dtype: Any) -> np.ndarray:
    """−slope · |diag(i) − j| broadcastable to (..., H, L, S) (the reference's ALiBi term;
    pairs outside a sequence get 0: they are excluded anyway)."""
    i, j, k0, k1, sigma = _positions(spec)
    dist = np.abs(i + sigma - j).astype(dtype)
    dist = np.where((j >= k0) & (j < k1), dist, 0)
    slopes = np.asarray(spec.alibi_slopes, dtype=dtype)[..., None, None]
    return -slopes * dist


def combine(visible: Any, keep: Any, drop: Any) -> Any:
    """True = excluded, from the band/sequence rule (True = visible), keep and drop;
    each may be None; None when all are."""
    parts = [~x for x in (visible, keep) if x is not None] + ([drop] if drop is not None else [])
    if not parts:
        return None
    ex = parts[0]
    for p in parts[1:]:
        ex = ex | p
    return ex


def excluded(spec: Spec) -> Any:
    """Boolean array broadcastable to (..., H, L, S), True = excluded: keep, drop, the
    band and the sequences combined; None when nothing is excluded."""
    return combine(index_visible(spec),
                   *(None if m is None else np.asarray(m) for m in (spec.keep, spec.drop)))


def mask_tile(spec: Spec, m: Any, b: tuple[int, ...], h: int | slice, r0: int, r1: int,
              c0: int, c1: int) -> np.ndarray:
    """The (r1-r0, c1-c0) tile of a keep/drop/bias array broadcast to score_shape, for
    query head h (an int, or a slice of heads: then (heads, r1-r0, c1-c0))."""
    full = broadcast_to(m, spec.score_shape)
    return np.asarray(full[b + (h,)][..., r0:r1, c0:c1])


def tile_excluded(spec: Spec, seg: Segment, b: tuple[int, ...], h: int | slice, r0: int, r1: int,
                  c0: int, c1: int, index: bool = True) -> np.ndarray | None:
    """Boolean (r1-r0, c1-c0) array (with a leading heads axis when h is a slice), True =
    excluded, for batch element b, query head(s) h, rows [r0, r1) of sequence seg and
    keys [c0, c1): keep, drop, the band and the
    sequence's key range combined; None when nothing is excluded there. Masks are
    sliced, never expanded. ``index=False``: the caller knows the band and the key
    range leave the tile whole."""
    vis = None
    if index:
        lo, hi = row_key_bounds(seg, band(spec.causal, spec.window), r0, r1)
        cols = np.arange(c0, c1)
        vis = (cols >= lo[:, None]) & (cols < hi[:, None])
    return combine(vis, *(None if m is None else mask_tile(spec, m, b, h, r0, r1, c0, c1)
                          for m in (spec.keep, spec.drop)))
