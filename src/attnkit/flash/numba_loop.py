"""The flash forward's tile loop compiled (float32, scores with nothing between the two
products: no mask arrays, bias, softcap, ALiBi or dropout), both products by NumPy's
own BLAS (:mod:`.blas`) without the GIL.

:func:`tile_tasks` runs a call's tasks from a table: every thread of the call runs it
once (or once per ``budget`` of scores), claiming tasks one by one from a shared
counter, each finished straight into out and lse (or, a key part of split-KV, left as
its running state). One compiled call per thread instead of a Python call (and a wait
for the GIL) per task: inside a model, where every Python line runs several times
slower than alone, a BERT layer's tasks spent a sixth of their time in that Python.
Which thread runs a task never changes its bits. Threads enter it through
:func:`team_tasks`, a C function reading the call's arguments from one packed block
(:class:`Tasks`): libgomp's team calls it with no Python at all. The loop itself is
:func:`_loop_body`, with the softmax bodies of :mod:`.numba_kernels` inlined (a
reduction compiled into two callers may round differently in each: one caller only).

Developers: numba's disk cache follows this file's own timestamp, not that of
:mod:`.numba_kernels`, whose bodies and flags are compiled in here: after editing those,
delete ``__pycache__/numba_loop*.nb*`` (a fresh clone, as CI's, has none).
"""

from __future__ import annotations

import array
import ctypes
from typing import Any

import numba
import numpy as np
from llvmlite import ir
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


# ---- the launch: one compiled entry per thread, without the GIL ---------------------------
# tile_tasks' arguments as a block of int64 (addresses, shapes, strides, scalars) that
# a C-callable entry (team_tasks) reads on every thread of the call: libgomp's team runs
# it directly, no Python and no GIL on its threads (a BERT layer's second thread began
# its tasks 60–120 µs after the first, waiting for the first thread's Python to reach
# its kernel); elsewhere each thread calls it through ctypes, which drops the GIL.
SLOTS = 112
# where pack puts each argument (the arrays' slots: address, shape, strides, extent)
(AT_Q, AT_K, AT_V, AT_OUT, AT_LSE, AT_M0, AT_L0, AT_TABLE, AT_TILES, AT_LO, AT_HI, AT_COUNTER, AT_STATUS, AT_SM, AT_SL,
 AT_SACC) = 2, 12, 22, 32, 42, 50, 58, 66, 72, 78, 82, 86, 90, 94, 98, 102
AT_SMALL, AT_INNER, AT_BUDGET, AT_QSCALE = 108, 109, 110, 111
_GEMM, _OMATCOPY = (numba.typeof(blas.prototype(kind)(1)) for kind in ("sgemm", "somatcopy"))   # the types
# of NumPy's own functions (an address stands in: only their signatures make the type)


@intrinsic
def _gemm_at(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(_GEMM))
    return _GEMM(types.int64), codegen


@intrinsic
def _omatcopy_at(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(_OMATCOPY))
    return _OMATCOPY(types.int64), codegen


@intrinsic
def _pointer(typingctx, addr):
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())
    return types.voidptr(types.int64), codegen


@numba.njit(cache=True, inline="always")
def _put(block, i, x, c_order):
    # x at slot i: its address, shape, strides (in items) and extent (items from its
    # address to its last one, + 1); the next free slot. c_order: the team's entry
    # reads x as C-ordered (and C-ordered it must be)
    assert x.flags.c_contiguous or not c_order
    block[i] = x.ctypes.data
    extent = 1 if x.size else 0
    for d in range(x.ndim):
        block[i + 1 + d], block[i + 1 + x.ndim + d] = x.shape[d], x.strides[d] // x.itemsize
        extent += (x.shape[d] - 1) * (x.strides[d] // x.itemsize) if x.size else 0
    block[i + 1 + 2 * x.ndim] = extent
    return i + 2 + 2 * x.ndim


@numba.njit(cache=True)
def pack(block, gemm, omatcopy, q4, qscale, k4, v4, table, tiles, lo, hi, small, counter, status, m0, l0,
         out4, inner, lse3, sm, sl, sacc, budget):
    """tile_tasks' arguments into block (int64, SLOTS): gemm and omatcopy as addresses;
    q4, k4, v4 any strides; every other array C-ordered."""
    block[0], block[1] = gemm, omatcopy
    i = 2
    i = _put(block, i, q4, False)
    i = _put(block, i, k4, False)
    i = _put(block, i, v4, False)
    i = _put(block, i, out4, True)
    i = _put(block, i, lse3, True)
    i = _put(block, i, m0, True)
    i = _put(block, i, l0, True)
    i = _put(block, i, table, True)
    i = _put(block, i, tiles, True)
    i = _put(block, i, lo, True)
    i = _put(block, i, hi, True)
    i = _put(block, i, counter, True)
    i = _put(block, i, status, True)
    i = _put(block, i, sm, True)
    i = _put(block, i, sl, True)
    i = _put(block, i, sacc, True)
    assert i == AT_SMALL
    block[AT_SMALL], block[AT_INNER], block[AT_BUDGET] = small, inner, budget
    block[AT_QSCALE] = np.float32(qscale).view(np.int32)


@numba.njit(cache=True, inline="always")
def _strided(a, i):
    # float32 (N, A, B, C) at slot i, any strides
    x = numba.carray(_pointer(a[i]), (a[i + 9],), np.float32)
    return np.lib.stride_tricks.as_strided(x, shape=(a[i + 1], a[i + 2], a[i + 3], a[i + 4]),
                                           strides=(a[i + 5] * 4, a[i + 6] * 4, a[i + 7] * 4, a[i + 8] * 4))


@numba.cfunc(types.void(types.voidptr), cache=True, error_model="numpy")
def team_tasks(data):
    """tile_tasks on the arguments that :func:`pack` wrote at ``data``."""
    a = numba.carray(data, (SLOTS,), np.int64)
    out4 = numba.carray(_pointer(a[AT_OUT]), (a[AT_OUT + 1], a[AT_OUT + 2], a[AT_OUT + 3], a[AT_OUT + 4]), np.float32)
    lse3 = numba.carray(_pointer(a[AT_LSE]), (a[AT_LSE + 1], a[AT_LSE + 2], a[AT_LSE + 3]), np.float32)
    m0 = numba.carray(_pointer(a[AT_M0]), (a[AT_M0 + 1], a[AT_M0 + 2], a[AT_M0 + 3]), np.float32)
    l0 = numba.carray(_pointer(a[AT_L0]), (a[AT_L0 + 1], a[AT_L0 + 2], a[AT_L0 + 3]), np.float32)
    table = numba.carray(_pointer(a[AT_TABLE]), (a[AT_TABLE + 1], a[AT_TABLE + 2]), np.int64)
    tiles = numba.carray(_pointer(a[AT_TILES]), (a[AT_TILES + 1], a[AT_TILES + 2]), np.int64)
    lo, hi = (numba.carray(_pointer(a[AT_LO]), (a[AT_LO + 1],), np.int64),
              numba.carray(_pointer(a[AT_HI]), (a[AT_HI + 1],), np.int64))
    counter = numba.carray(_pointer(a[AT_COUNTER]), (a[AT_COUNTER + 1],), np.int64)
    status = numba.carray(_pointer(a[AT_STATUS]), (a[AT_STATUS + 1],), np.int8)
    sm, sl = (numba.carray(_pointer(a[AT_SM]), (a[AT_SM + 1],), np.float32),
              numba.carray(_pointer(a[AT_SL]), (a[AT_SL + 1],), np.float32))
    sacc = numba.carray(_pointer(a[AT_SACC]), (a[AT_SACC + 1], a[AT_SACC + 2]), np.float32)
    tile_tasks(_gemm_at(a[0]), _omatcopy_at(a[1]), _strided(a, AT_Q), np.int32(a[AT_QSCALE]).view(np.float32),
               _strided(a, AT_K), _strided(a, AT_V), table, tiles, lo, hi, a[AT_SMALL], counter, status, m0, l0, out4,
               a[AT_INNER] != 0, lse3, sm, sl, sacc, a[AT_BUDGET])


class Tasks:
    """The compiled loop on one call's arguments: ``pack`` them into a block, then
    ``run(block)`` (one pass of at most ``budget`` scores, on the calling thread, GIL
    dropped) on each thread, or libgomp's team calls ``address`` with the block."""

    def __init__(self, gemm: Any, omatcopy: Any) -> None:
        self.gemm, self.omatcopy = (ctypes.cast(f, ctypes.c_void_p).value for f in (gemm, omatcopy))
        self.address = team_tasks.address
        self.run = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(team_tasks.address)

    def pack(self, q4, qscale, k4, v4, table, tiles, lo, hi, counter, status, m0, l0, out4, lse3, sm, sl, sacc,
             budget) -> np.ndarray:
        # out4 (N, H, L, Dv) as the loop writes it: C-ordered, or the (N, L, H, Dv)
        # memory of out with its heads inner (any other layout: an error)
        inner = not out4.flags.c_contiguous
        if inner:
            out4 = out4.swapaxes(1, 2)
        block = np.empty(SLOTS, dtype=np.int64)
        pack(block, self.gemm, self.omatcopy, q4, f32(qscale), k4, v4, table, tiles, lo, hi,
             blas.small_product_limit(), counter, status, m0, l0, out4, inner, lse3, sm, sl, sacc, budget)
        return block

    @staticmethod
    def one_thread(tiles: np.ndarray, D: int, Dv: int) -> bool:
        """Whether NumPy's OpenBLAS makes every product of the loop on these tiles (rows
        f, keys [c0, c1) each) on the calling thread, so that BLAS need not be held to
        one thread. It does for a product of at most ``blas.small_product_limit()``
        multiply-adds (unpacked, before its threading: OpenBLAS's interface/gemm.c),
        which _step cuts every product to where that leaves MIN_CHUNK rows for the
        widest tile; a product with one column (a tile of one key, or Dv = 1) it hands
        to gemv instead, which threads from 460 800 (a one-row product here has at most
        small / MIN_CHUNK). False where any may use more (or the limit is unknown)."""
        small, widths = blas.small_product_limit(), tiles[:, 3] - tiles[:, 2]
        if not small or Dv <= 1 or not len(widths) or int(widths.min()) <= 1:
            return False
        return int(widths.max()) * max(D, Dv) * MIN_CHUNK <= small

    @staticmethod
    def unbounded(block: Any) -> Any:
        """A copy of the block (an ``array.array('q')``) with no budget: one pass runs
        until no task is left."""
        block = array.array("q", block)
        block[AT_BUDGET] = 1 << 62
        return block

    def __call__(self, *args: Any) -> None:
        """One pass of tile_tasks (pack's arguments) on the calling thread."""
        block = self.pack(*args)
        self.run(block.ctypes.data)


def kernels() -> Any:
    """The compiled loop bound to NumPy's sgemm and somatcopy (:class:`Tasks`), or
    None without them (see .blas). The products are cut into chunks where
    ``blas.small_product_limit()`` says (read at every call)."""
    gemm, omatcopy = blas.sgemm(), blas.somatcopy()
    if gemm is None or omatcopy is None:
        return None
    return Tasks(gemm, omatcopy)
