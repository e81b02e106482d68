"""The flash forward's tile loop compiled (float32, scores with nothing between the two
products: no mask arrays, bias, softcap, ALiBi or dropout), both products by NumPy's
own BLAS (:mod:`.blas`) without the GIL.

:func:`tile_tasks` runs a call's tasks from a table: every thread of the call runs it
once (or once per ``budget`` of scores), claiming tasks one by one from a shared
counter, each finished straight into out and lse (or, a key part of split-KV, left as
its running state). One compiled call per thread instead of a Python call (and a wait
for the GIL) per task: inside a model, where every Python line runs several times
slower than alone, a BERT layer's tasks spent a sixth of their time in that Python.
Which thread runs a task never changes its bits. The loop itself is
:func:`_loop_body`, with the softmax bodies of :mod:`.numba_kernels` inlined (a
reduction compiled into two callers may round differently in each: one caller only).

Developers: numba's disk cache follows this file's own timestamp, not that of
:mod:`.numba_kernels`, whose bodies and flags are compiled in here: after editing those,
delete ``__pycache__/numba_loop*.nb*`` (a fresh clone, as CI's, has none).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import blas
from .blas import NO_TRANS, ROW_MAJOR, TRANS
from .numba_kernels import (
    REDUCE,
    _all_finite,
    _lse_value,
    _normalized,
    _rescale_add,
    _softmax_rows,
    _softmax_rows_bounded,
    _wide,
    f32,
)

MIN_CHUNK = 16          # rows per product at least, where products are cut (see _step)


@intrinsic
def _claim(typingctx, counter):
    # counter[0] += 1 atomically; the old value: the next task of a table
    def codegen(context, builder, signature, args):
        aty = signature.args[0]
        ary = context.make_array(aty)(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [context.get_constant(types.intp, 0)])
        return builder.atomic_rmw("add", ptr, context.get_constant(types.int64, 1), "seq_cst")
    return types.int64(counter), codegen


@numba.njit(**REDUCE, inline="always")
def _step(rows, w, D, Dv, small):
    # rows per product for a block of ``rows`` rows against w keys: even chunks of
    # m·w·max(D, Dv) ≤ small multiply-adds where that leaves MIN_CHUNK rows or more
    # (.blas.small_product_limit: products OpenBLAS makes unpacked; 0: whole blocks)
    cap = small // max(w * max(D, Dv), 1)
    if cap >= MIN_CHUNK and rows > cap:
        return -(-rows // -(-rows // cap))
    return max(rows, 1)


@numba.njit(**REDUCE, inline="always")
def _loop_body(gemm, omatcopy, q, g, qscale, k, v, tiles, lo, hi, m_i, l_i, acc, small):
    # The online softmax over a task's tiles. q (F = nk·g, m, D): the rows of the unit's
    # query heads, times qscale by the first product; k (nk, S, D), v (nk, S, Dv) with
    # unit stride on the last axis. tiles (n, 5): stacked rows [f0, f1) of each kv head
    # (its g heads' m rows) × keys [c0, c1), and whether the band cuts it (row i then
    # keeps keys [lo[i], hi[i]); lo, hi, m_i, l_i flat over F·m rows). acc (nk, g·m, Dv):
    # zero, or (a single tile of every row) anything: the product itself then.
    # Each key block is copied transposed (omatcopy) for all kv heads and kept for the
    # next tiles that start at the same key (the causal diagonal's strips), so both
    # products multiply untransposed operands (gemm), in chunks of _step rows.
    # False as soon as a product p v is not finite (the state is then partly updated).
    F, m, D = q.shape
    nk, R, Dv = k.shape[0], g * m, v.shape[2]
    one = tiles.shape[0] == 1 and tiles[0, 0] == 0 and tiles[0, 1] == R
    # a kv head's g·m rows are one block where its heads' rows are evenly spaced in
    # memory (C order), else one block of m rows per query head (rows rs bytes apart)
    rs = q.strides[1] if m > 1 else q.strides[0]
    M = R if m == 1 or q.strides[0] == m * q.strides[1] else m          # (g = 1: R = m)
    c_end, W, need = 0, 1, 1
    for t in range(tiles.shape[0]):
        w = tiles[t, 3] - tiles[t, 2]
        c_end, W = max(c_end, tiles[t, 3]), max(W, w)
        need = max(need, _step(min(M, tiles[t, 1] - tiles[t, 0]), w, D, Dv, small) * w)
    kt = np.empty((nk, D, W), dtype=f32)
    s = np.empty(need, dtype=f32)
    pv = np.empty((M, Dv), dtype=f32)
    alpha = np.empty(M, dtype=f32)
    # leading dims as BLAS checks them (≥ the row length, ≥ 1): a single row's stride
    # may be anything
    ldq = max(rs // q.itemsize, D, 1) if M > 1 else max(D, 1)
    ldk = max(k.strides[1] // k.itemsize, D, 1) if k.shape[1] > 1 else max(D, 1)
    ldv = max(v.strides[1] // v.itemsize, Dv, 1) if v.shape[1] > 1 else max(Dv, 1)
    ldo = max(Dv, 1)
    K0 = K1 = 0                                          # the keys now in kt
    for t in range(tiles.shape[0]):
        f0, f1, c0, c1 = tiles[t, 0], tiles[t, 1], tiles[t, 2], tiles[t, 3]
        w = c1 - c0
        if c0 != K0 or c1 > K1:
            K0, K1 = c0, min(c0 + W, c_end)
            if D > 0:
                for h in range(nk):
                    omatcopy(ROW_MAJOR, TRANS, K1 - K0, D, f32(1.0), k[h, K0:].ctypes.data, ldk,
                             kt[h].ctypes.data, W)
        for h in range(nk):
            for j in range(f0 // M, (f1 + M - 1) // M):
                a, b = max(f0, j * M), min(f1, (j + 1) * M)
                step = _step(b - a, w, D, Dv, small)
                for a2 in range(a, b, step):
                    b2 = min(a2 + step, b)
                    n, r = b2 - a2, h * R + a2
                    st = s[:n * w].reshape((n, w))
                    jq = 0 if M == R else j                  # block j: query head h·g + j
                    qp = q.ctypes.data + (h * g + jq) * q.strides[0] + (a2 - jq * M) * rs
                    gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, n, w, D, qscale, qp, ldq, kt[h].ctypes.data, W, f32(0.0),
                         st.ctypes.data, w)
                    if tiles[t, 4]:
                        _softmax_rows_bounded(st, m_i[r:r + n], l_i[r:r + n], alpha, lo[r:r + n], hi[r:r + n], c0)
                    else:
                        _softmax_rows(st, m_i[r:r + n], l_i[r:r + n], alpha)
                    out = acc[h, a2:b2] if one else pv[:n]
                    gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, n, Dv, w, f32(1.0), st.ctypes.data, w,
                         v[h, c0:].ctypes.data, ldv, f32(0.0), out.ctypes.data, ldo)
                    if not _all_finite(out):
                        return False
                    if not one:
                        _rescale_add(acc[h, a2:b2], alpha, out)
    return True


@numba.njit(**REDUCE)
def tile_tasks(gemm, omatcopy, q4, qscale, k4, v4, table, tiles, lo, hi, small, counter, status, m0, l0,
               out4, inner, lse3, sm, sl, sacc, budget):
    # The tasks of table (T, 15) — n (out's and lse's batch index), q's, k's and v's own
    # batch indices, first query head h0, its kv head hk, nk kv heads of g query heads,
    # rows [r0, r1), tiles[t0:t1], bounds lo/hi from b0 (−1: no banded tile), state
    # offset so, sink — claimed from counter until none is left or ``budget`` scores
    # are done (the caller calls again: see forward._tile_tasks). q4 (Nq, H, L, D), k4
    # and v4 (Nk, Hkv, S, D[v]); m0, l0 (N, H, L): the state of rows that start with
    # their sink (sink = 1), else
    # (−inf, 0). A task is finished into out4 (N, H, L, Dv) — with inner, into out4
    # (N, L, H, Dv): out with its heads inner, C-ordered either way (a strided out4 kept
    # the finish from vectorising: 8% of a BERT layer) — and lse3 (N, H, L) (so = −1),
    # or (a key part of split-KV) leaves its state in rows so… of sm, sl, sacc. Written
    # once the task is done (status 1); a product p v that is not finite leaves it
    # (status 0) to the caller.
    _wide()
    T, Dv, done = table.shape[0], v4.shape[3], 0
    while done < budget:
        i = _claim(counter)
        if i >= T:
            return
        n, nq, nkk, nv, h0, hk, nk, g, r0, r1, t0, t1, b0, so, sink = (
            table[i, 0], table[i, 1], table[i, 2], table[i, 3], table[i, 4], table[i, 5], table[i, 6], table[i, 7],
            table[i, 8], table[i, 9], table[i, 10], table[i, 11], table[i, 12], table[i, 13], table[i, 14])
        m, F = r1 - r0, nk * g
        tl = tiles[t0:t1]
        m_i, l_i = np.full(F * m, -np.inf, dtype=f32), np.zeros(F * m, dtype=f32)
        if sink:
            for f in range(F):
                for r in range(m):
                    m_i[f * m + r], l_i[f * m + r] = m0[n, h0 + f, r0 + r], l0[n, h0 + f, r0 + r]
        acc = np.zeros((nk, g * m, Dv), dtype=f32)
        bl = lo[b0:b0 + F * m] if b0 >= 0 else lo[:0]
        bh = hi[b0:b0 + F * m] if b0 >= 0 else hi[:0]
        if _loop_body(gemm, omatcopy, q4[nq, h0:h0 + F, r0:r1], g, qscale, k4[nkk, hk:hk + nk], v4[nv, hk:hk + nk],
                      tl, bl, bh, m_i, l_i, acc, small):
            rows = acc.reshape((F * m, Dv))
            if so < 0:                                   # finish_into's rules, inlined
                for f in range(F):
                    for r in range(m):
                        li = l_i[f * m + r]
                        lse3[n, h0 + f, r0 + r] = _lse_value(m_i[f * m + r], li)
                        if inner:
                            for d in range(Dv):
                                out4[n, r0 + r, h0 + f, d] = _normalized(rows[f * m + r, d], li)
                        else:
                            for d in range(Dv):
                                out4[n, h0 + f, r0 + r, d] = _normalized(rows[f * m + r, d], li)
            else:
                sm[so:so + F * m], sl[so:so + F * m], sacc[so:so + F * m] = m_i, l_i, rows
            status[i] = 1
        for t in range(tl.shape[0]):
            done += (tl[t, 1] - tl[t, 0]) * (tl[t, 3] - tl[t, 2]) * nk


def kernels() -> Any:
    """tile_tasks bound to NumPy's sgemm and somatcopy, or None without them (see
    .blas). The products are cut into chunks where ``blas.small_product_limit()`` says
    (read at every call)."""
    gemm, omatcopy = blas.sgemm(), blas.somatcopy()
    if gemm is None or omatcopy is None:
        return None

    def tasks(q4, qscale, k4, v4, table, tiles, lo, hi, counter, status, m0, l0, out4, lse3, sm, sl, sacc, budget):
        # out4 (N, H, L, Dv) as the loop writes it: C-ordered, or the (N, L, H, Dv)
        # memory of out with its heads inner (any other layout: an error)
        inner = not out4.flags.c_contiguous
        if inner:
            out4 = out4.swapaxes(1, 2)
            assert out4.flags.c_contiguous, "out4: C order, or heads inner"
        return tile_tasks(gemm, omatcopy, q4, f32(qscale), k4, v4, table, tiles, lo, hi, blas.small_product_limit(),
                          counter, status, m0, l0, out4, inner, lse3, sm, sl, sacc, budget)
    return tasks
