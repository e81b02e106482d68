"""The flash backward's tasks compiled (float32, scores with nothing between the two
products, as :mod:`.numba_loop`'s forward): every product by NumPy's own BLAS
(:mod:`.blas`) without the GIL, one compiled call per thread claiming tasks from a
shared counter.

A task is one unit's chunk of key blocks (see :func:`.backward.backward`). Each of its
kv heads is worked key-major — the transposed scores sᵀ (keys × rows), so that all
five products multiply untransposed operands (OpenBLAS's fastest kernels; see
:mod:`.blas`)::

    qᵀ, qc = q · scale, doᵀ, δ = rowsum(do ∘ out) − dlse      the head's rows, once
    for each key block: kᵀ
        for each query tile that sees it (columns of the rows):
            pᵀ = exp(scale · (k qᵀ) − lse) 0 outside each row's band, or lse = −inf
                                           (the scale applied to the sums, as the
                                           forward's: the scores' bits lse was made from)
            dv (+)= pᵀ do;   dsᵀ = pᵀ ∘ (v doᵀ − δ)
            dk (+)= dsᵀ qc;  dqᵀ += kᵀ dsᵀ
    dq = scale · (dqᵀ)ᵀ

Operands holding a NaN or inf (each checked as it is first read: a head's rows when
they are copied, a key block when it is transposed), or a ds that overflows, stop the
task: its outputs are set to zero again and it is left to the Python loop (status 0),
whose exempt products apply the NaN rule. Which thread runs a task never changes its
bits.

Developers: numba's disk cache follows this file's own timestamp, not that of
:mod:`.numba_kernels`, whose bodies and flags are compiled in here: after editing those,
delete ``__pycache__/numba_backward*.nb*`` (a fresh clone, as CI's, has none).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from . import blas
from .blas import NO_TRANS, ROW_MAJOR, TRANS
from .numba_kernels import LOG2E, REDUCE, _all_finite, _wide, exp2_f32, f32
from .numba_loop import _claim, _step


@numba.njit(**REDUCE, inline="always")
def _nn(gemm, M, N, K, alpha, a, lda, b, ldb, beta, c, ldc, small):
    # c (M × N) = alpha · a (M × K) b (K × N) + beta · c, row-major pointers, in the row
    # chunks of the forward's loop (numba_loop._step: products OpenBLAS makes unpacked)
    if M <= 0 or N <= 0:
        return
    step = _step(M, N, K, K, small)
    for r in range(0, M, step):
        gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, min(step, M - r), N, K, alpha, a + r * lda * 4, lda, b, ldb, beta,
             c + r * ldc * 4, ldc)


@numba.njit(**REDUCE)
def backward_tasks(gemm, omatcopy, q4, k4, v4, do4, o4, lse3, dlse3, scale, table, tiles, lo, hi, small,
                   counter, status, dq5, dk4, dv4):
    # The tasks of table (T, 13): n (the batch index of dout, out, lse, dq, dk, dv), q's,
    # k's and v's own batch indices, first query head h0, its kv head hk, nk kv heads of
    # g query heads, the unit's rows [r0, r1), tiles[t0:t1] — and the dq chunk it adds
    # into. tiles (n, 6): keys [c0, c1), rows [a0, a1), banded, and the
    # offset in lo/hi of the unit's per-row key bounds (its g heads' rows side by side).
    # dlse3: empty (no gradient for lse) or (N, H, L).
    _wide()
    T = table.shape[0]
    while True:
        i = _claim(counter)
        if i >= T:
            return
        n, nq, nkk, nv, h0, hk, nk, g, r0, r1, t0, t1, ch = (
            table[i, 0], table[i, 1], table[i, 2], table[i, 3], table[i, 4], table[i, 5], table[i, 6], table[i, 7],
            table[i, 8], table[i, 9], table[i, 10], table[i, 11], table[i, 12])
        tl = tiles[t0:t1]
        ok = _task(gemm, omatcopy, q4, k4, v4, do4, o4, lse3, dlse3, scale, tl, lo, hi, small, dq5, dk4, dv4,
                   n, nq, nkk, nv, h0, hk, nk, g, r0, r1, ch)
        if not ok:                                       # the Python loop redoes it from zero
            for a in range(nk):
                for f in range(g):
                    dq5[ch, n, h0 + a * g + f, r0:r1] = f32(0.0)
                for t in range(tl.shape[0]):
                    dk4[n, h0 + a * g, tl[t, 0]:tl[t, 1]] = f32(0.0)
                    dv4[n, h0 + a * g, tl[t, 0]:tl[t, 1]] = f32(0.0)
        status[i] = 1 if ok else 0


@numba.njit(**REDUCE)
def _task(gemm, omatcopy, q4, k4, v4, do4, o4, lse3, dlse3, scale, tl, lo, hi, small, dq5, dk4, dv4,
          n, nq, nkk, nv, h0, hk, nk, g, r0, r1, ch):
    # one task (see backward_tasks); False where it met a NaN or inf
    D, Dv, M = q4.shape[3], v4.shape[3], r1 - r0
    C = g * M                                            # columns: the g heads' rows side by side
    if C == 0:
        return True
    W = Rm = 1                                       # the widest key block, the most columns of a tile
    for t in range(tl.shape[0]):
        W = max(W, tl[t, 1] - tl[t, 0])
        Rm = max(Rm, tl[t, 3] - tl[t, 2] if g == 1 else C)
    qc = np.empty((C, D), dtype=f32)
    qT = np.empty((D, C), dtype=f32)
    doc = np.empty((C, Dv), dtype=f32)
    doT = np.empty((Dv, C), dtype=f32)
    dqT = np.empty((D, C), dtype=f32)
    lse = np.empty(C, dtype=f32)
    delta = np.empty(C, dtype=f32)
    orow = np.empty(Dv, dtype=f32)
    kT = np.empty((D, W), dtype=f32)
    pT = np.empty(W * Rm, dtype=f32)
    dsT = np.empty(W * Rm, dtype=f32)
    with_dlse = dlse3.shape[0] > 0
    for a in range(nk):
        hd = h0 + a * g                                  # dk, dv of a GQA group: its first head
        z = f32(0.0)                                     # x · 0 summed: NaN once any x is not finite
        for f in range(g):
            h = hd + f
            for r in range(M):
                i = f * M + r
                for d in range(Dv):
                    doc[i, d] = do4[n, h, r0 + r, d]
                    orow[d] = o4[n, h, r0 + r, d]
                x = f32(0.0)                             # summed from C-ordered copies: the same
                for d in range(Dv):                      # order (bits) for any layout of dout, out
                    x += doc[i, d] * orow[d]
                    z += doc[i, d] * f32(0.0) + orow[d] * f32(0.0)
                delta[i] = x - dlse3[n, h, r0 + r] if with_dlse else x
                c = lse3[n, h, r0 + r]
                lse[i] = c
                if np.isnan(c) or c == np.inf:
                    return False
                for d in range(D):
                    y = q4[nq, h, r0 + r, d]
                    qc[i, d] = y
                    z += y * f32(0.0)
        if z != f32(0.0):                                # q, dout or out holds NaN or inf
            return False
        # qᵀ unscaled: the scores are scale · (k qᵀ), as the forward's scale · (q kᵀ) (the
        # same products summed in the same order: the bits exp(s − lse) was made from)
        omatcopy(ROW_MAJOR, TRANS, C, D, f32(1.0), qc.ctypes.data, D, qT.ctypes.data, C)   # (D, Dv ≥ 1: validated)
        for i in range(C):
            for d in range(D):
                qc[i, d] *= scale
        omatcopy(ROW_MAJOR, TRANS, C, Dv, f32(1.0), doc.ctypes.data, Dv, doT.ctypes.data, C)
        dqT[...] = f32(0.0)
        k, v = k4[nkk, hk + a], v4[nv, hk + a]
        ldk = max(k.strides[0] // 4, D, 1) if k.shape[0] > 1 else max(D, 1)
        ldv = max(v.strides[0] // 4, Dv, 1) if v.shape[0] > 1 else max(Dv, 1)
        last = -1                                        # the key block in kT
        for t in range(tl.shape[0]):
            c0, c1, a0, a1, banded, bo = tl[t, 0], tl[t, 1], tl[t, 2], tl[t, 3], tl[t, 4], tl[t, 5]
            w = c1 - c0
            if w <= 0 or a1 <= a0:
                continue
            new_keys = c0 != last
            last = c0
            if new_keys:
                omatcopy(ROW_MAJOR, TRANS, w, D, f32(1.0), k[c0:].ctypes.data, ldk, kT.ctypes.data, W)
                if not (_all_finite(kT[:, :w]) and _all_finite(v[c0:c1])):   # checked while in cache
                    return False
            # columns [j0, j1): the tile's rows of each of the g heads (g > 1: all of them)
            j0, j1 = (a0 - r0, a1 - r0) if g == 1 else (0, C)
            R = j1 - j0
            p = pT[:w * R].reshape((w, R))
            ds = dsT[:w * R].reshape((w, R))
            _nn(gemm, w, R, D, scale, k[c0:].ctypes.data, ldk, qT.ctypes.data + j0 * 4, C, f32(0.0),
                p.ctypes.data, R, small)
            for j in range(w):
                key = c0 + j
                for x in range(R):
                    col = j0 + x
                    c = lse[col]
                    inside = not banded or (key >= lo[bo + col] and key < hi[bo + col])
                    p[j, x] = exp2_f32((p[j, x] - c) * LOG2E) if inside and c != -np.inf else f32(0.0)
            beta = f32(0.0) if new_keys else f32(1.0)
            _nn(gemm, w, Dv, R, f32(1.0), p.ctypes.data, R, doc.ctypes.data + j0 * Dv * 4, Dv, beta,
                dv4[n, hd, c0:].ctypes.data, Dv, small)
            _nn(gemm, w, R, Dv, f32(1.0), v[c0:].ctypes.data, ldv, doT.ctypes.data + j0 * 4, C, f32(0.0),
                ds.ctypes.data, R, small)
            z = f32(0.0)
            for j in range(w):
                for x in range(R):
                    y = p[j, x] * (ds[j, x] - delta[j0 + x])
                    ds[j, x] = y
                    z += y * f32(0.0)
            if z != f32(0.0):                            # dout vᵀ − δ overflowed
                return False
            _nn(gemm, w, D, R, f32(1.0), ds.ctypes.data, R, qc.ctypes.data + j0 * D * 4, D, beta,
                dk4[n, hd, c0:].ctypes.data, D, small)
            _nn(gemm, D, R, w, f32(1.0), kT.ctypes.data, W, ds.ctypes.data, R, f32(1.0),
                dqT.ctypes.data + j0 * 4, C, small)
        for f in range(g):
            omatcopy(ROW_MAJOR, TRANS, D, M, scale, dqT.ctypes.data + f * M * 4, C, dq5[ch, n, hd + f, r0:].ctypes.data,
                     D)
    return True


def kernels() -> Any:
    """backward_tasks bound to NumPy's sgemm and somatcopy, or None without them."""
    gemm, omatcopy = blas.sgemm(), blas.somatcopy()
    if gemm is None or omatcopy is None:
        return None

    def tasks(q4, k4, v4, do4, o4, lse3, dlse3, scale, table, tiles, lo, hi, counter, status, dq5, dk4, dv4):
        return backward_tasks(gemm, omatcopy, q4, k4, v4, do4, o4, lse3, dlse3, f32(scale), table, tiles, lo, hi,
                              blas.small_product_limit(), counter, status, dq5, dk4, dv4)
    return tasks
