"""float32 tile kernels compiled by numba (see :mod:`.kernels` for what each computes):
one pass for the row max, one fused pass for exp and the row sum, with a polynomial
exp that the compiler vectorises. Compiled on first use and cached on disk
(``cache=True``), so later processes load them instead of compiling.

Fast-math without reassociation keeps every sum in its source order; the row max and
row sum allow it (the order is then fixed at compile time, so the bits stay the same
run to run and thread to thread).
"""

from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

ORDERED = dict(nogil=True, cache=True, error_model="numpy", fastmath={"nsz", "arcp", "contract", "afn"})
REDUCE = dict(ORDERED, fastmath={"reassoc", "nsz", "arcp", "contract", "afn"})
f32 = np.float32
LOG2E = f32(1.44269504088896341)                          # exp(x) = 2^(x · log2 e)
EXP2_MIN = f32(-125.0)                                   # below 2^-125 the result is 0


@intrinsic
def _f32_from_bits(typingctx, x):
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


@intrinsic
def _fmax(typingctx, a, b):
    # llvm.maxnum with nnan: the form of max the vectoriser turns into vmaxps (numba's
    # max() stays scalar); a NaN score may be skipped by the row max but still makes
    # its row NaN in the exp pass
    def codegen(context, builder, signature, args):
        f = ir.FloatType()
        fn = builder.module.declare_intrinsic("llvm.maxnum", [f], ir.FunctionType(f, [f, f]))
        return builder.call(fn, args, fastmath=("nnan", "nsz"))
    return types.float32(types.float32, types.float32), codegen


@numba.njit(**ORDERED)
def exp2_f32(t):
    # 2^t = 2^n · 2^r with n = round(t), r = t − n exact, |r| ≤ 1/2; callers fold log2(e)
    # into t (exp(x − c) = 2^(x·log2 e − c·log2 e)). t ≤ 0 here (scores minus their max).
    n = np.floor(t + f32(0.5))
    r = t - n
    p = f32(1.5356125e-4)                                # near-minimax for (2^r − 1) / r, ≤ 2 ulp
    p = p * r + f32(1.3398818e-3)
    p = p * r + f32(9.6184276e-3)
    p = p * r + f32(5.5503327e-2)
    p = p * r + f32(2.4022648e-1)
    p = p * r + f32(6.9314718e-1)
    y = p * r + f32(1.0)
    y = y * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)  # 2^n from its exponent bits
    # below 2^−125 (and for −inf) the bits above are garbage: the result is exactly 0
    # there; a NaN t fails the test and stays NaN through r
    return f32(0.0) if t < EXP2_MIN else y


@numba.njit(**REDUCE, inline="always")
def _softmax_span(s, i, a0, a1, m_i, l_i, alpha):
    # row i of s over its columns [a0, a1): exp in place, the row state updated. Indexes
    # s element by element (no row views: a view costs as much as a short row's work)
    m_new = m_i[i]
    for j in range(a0, a1):
        m_new = _fmax(m_new, s[i, j])
    shift = f32(0.0) if m_new == -np.inf else m_new      # all −inf so far: shift by 0, no NaN
    total = f32(0.0)
    for j in range(a0, a1):
        e = exp2_f32((s[i, j] - shift) * LOG2E)          # subtract first: shift·LOG2E may overflow
        s[i, j] = e
        total += e
    _row_done(i, m_new, shift, total, m_i, l_i, alpha)


@numba.njit(**REDUCE, inline="always")
def _row_done(i, m_new, shift, total, m_i, l_i, alpha):
    # row i's online-softmax state after a tile: the old sums rescaled by alpha
    a = exp2_f32((m_i[i] - shift) * LOG2E)               # m_i = −inf gives 0
    alpha[i] = a
    l_i[i] = l_i[i] * a + total
    m_i[i] = m_new


@numba.njit(**REDUCE)
def _softmax_tile(s, m_i, l_i, alpha):
    for i in range(s.shape[0]):
        _softmax_span(s, i, 0, s.shape[1], m_i, l_i, alpha)


@numba.njit(**REDUCE)
def _softmax_tile_bounded(s, m_i, l_i, alpha, lo, hi, c0):
    # row i limited to the keys [lo[i], hi[i]); the other columns get weight 0. Every
    # row runs over the whole tile width with a select (what the vectoriser takes):
    # loops over [a0, a1) with bounds read per row were left scalar and ran 7–13x
    # slower than the tile's plain softmax (every causal diagonal tile, every tile of
    # a short causal sequence). Columns outside the bounds never reach the max or the
    # sum, so NaN or inf there cannot leak into the row.
    w = s.shape[1]
    for i in range(s.shape[0]):
        a0 = min(max(lo[i] - c0, 0), w)
        a1 = min(max(hi[i] - c0, a0), w)
        m_new = m_i[i]
        for j in range(w):
            m_new = _fmax(m_new, s[i, j] if a0 <= j < a1 else f32(-np.inf))
        shift = f32(0.0) if m_new == -np.inf else m_new  # all −inf so far: shift by 0, no NaN
        total = f32(0.0)
        for j in range(w):
            e = exp2_f32((s[i, j] - shift) * LOG2E)
            e = e if a0 <= j < a1 else f32(0.0)
            s[i, j] = e
            total += e
        _row_done(i, m_new, shift, total, m_i, l_i, alpha)


@numba.njit(**ORDERED)
def rescale_add(o, alpha, pv):
    n = o.shape[1]
    for i in range(o.shape[0]):                          # (element-wise indexing: no row views)
        a = alpha[i]
        if a == f32(1.0):
            for j in range(n):
                o[i, j] += pv[i, j]
        else:
            for j in range(n):
                o[i, j] = o[i, j] * a + pv[i, j]


@numba.njit(**ORDERED)
def exp_from_lse(s, lse):
    n = s.shape[1]
    for i in range(s.shape[0]):
        if lse[i] == -np.inf:                            # fully masked row: weights 0
            for j in range(n):
                s[i, j] = f32(0.0)
            continue
        c = lse[i]
        for j in range(n):
            x = s[i, j]
            s[i, j] = f32(0.0) if x == -np.inf else exp2_f32((x - c) * LOG2E)  # excluded: 0 even for a NaN lse


@numba.njit(**ORDERED)
def ds_tile(p, dp, delta):
    for i in range(p.shape[0]):
        d = delta[i]
        for j in range(p.shape[1]):
            dp[i, j] = p[i, j] * (dp[i, j] - d)


@numba.njit(**ORDERED)
def alibi_tile(s, slopes, r0, c0, sigma):
    for h in range(s.shape[0]):
        sl = f32(slopes[h])
        for i in range(s.shape[1]):
            d0 = r0 + i + sigma - c0
            for j in range(s.shape[2]):
                s[h, i, j] -= sl * f32(abs(d0 - j))


@numba.njit(**ORDERED, inline="always")
def _philox4(c0, c1, c2, c3, k0, k1):
    # Philox4x32-10 on uint64 holding uint32 values (see attnkit.philox): all four words
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = c0 * np.uint64(0xD2511F53)
        p1 = c2 * np.uint64(0xCD9E8D57)
        n0 = ((p1 >> np.uint64(32)) ^ c1 ^ k0) & mask
        n2 = ((p0 >> np.uint64(32)) ^ c3 ^ k1) & mask
        c0, c1, c2, c3 = n0, p1 & mask, n2, p0 & mask
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return c0, c1, c2, c3


@numba.njit(**ORDERED)
def dropout_tile(p, heads, r0, c0, seed, thr, scale):
    # one Philox call per 4 keys (its 4 words into a row buffer, a loop LLVM
    # vectorises), then the threshold over the row
    k0 = np.uint64(seed & 0xFFFFFFFF)
    k1 = np.uint64((seed >> 32) & 0xFFFFFFFF)
    t = np.uint64(thr)
    sc = f32(scale)
    n = p.shape[2]
    g0 = c0 >> 2
    ng = ((c0 + n + 3) >> 2) - g0
    off = c0 - 4 * g0
    w = np.empty(4 * ng, np.uint64)
    for h in range(p.shape[0]):
        hd = np.uint64(heads[h])
        h_lo, h_hi = hd & np.uint64(0xFFFFFFFF), hd >> np.uint64(32)
        for i in range(p.shape[1]):
            row = np.uint64(r0 + i)
            for g in range(ng):
                a, b, c, d = _philox4(np.uint64(g0 + g), row, h_lo, h_hi, k0, k1)
                w[4 * g], w[4 * g + 1], w[4 * g + 2], w[4 * g + 3] = a, b, c, d
            for j in range(n):
                p[h, i, j] = p[h, i, j] * sc if w[off + j] >= t else f32(0.0)


# ---- decoding: few query rows against many keys, streamed from the cache -------------
CHUNK = 64                                               # keys per pass over the rows
CHUNK_LONG = 256                                         # the same where pages hold at least this many keys


@numba.njit(**REDUCE)
def decode_part(q, kc, vc, table, row, hk, P, c0, c1, lo, hi, softcap, slopes, diag, m_i, l_i, acc):
    """Rows q (A, R, D) — already times scale (and / softcap) — of kv heads hk … hk + A − 1
    (R rows each) against keys [c0, c1) of one sequence, key p of kv head hk + a at
    ``kc[table[row, p // P], hk + a, p % P]`` (a contiguous cache is one page per
    sequence: table[row] = [row], P = S). Flat row f = a·R + r sees keys [lo[f], hi[f]);
    ALiBi subtracts slopes[f]·|diag[f] − p| when slopes has rows; softcap > 0 caps.
    Updates the online softmax state m_i, l_i (A·R,) and acc (A, R, Dv) in place, keys
    in chunks of CHUNK (CHUNK_LONG keys where a page holds at least that many: a
    contiguous cache, long pages; measured 1.1–1.3× faster there, slower on 16-key
    pages): every key and value row is read once for all rows of its head
    (a GQA group's heads share one read), and a page's heads are read together, head
    after head through the chunk's keys in that page (a page is one contiguous block, so
    the read is sequential; reading one head at a time across pages, the prefetcher
    would restart at every short run). Compiled with reassociation (sums run in
    vector lanes, in an order fixed at compile time) and indexing the cache element by
    element: a view per key row would cost more than the row."""
    A, R, D = q.shape
    Dv = acc.shape[2]
    chunk = CHUNK_LONG if P >= CHUNK_LONG else CHUNK
    s = np.empty((A * R, chunk), dtype=np.float32)
    alpha = np.empty(A * R, dtype=np.float32)
    use_alibi = slopes.shape[0] == A * R
    pages = np.empty(chunk, dtype=np.int64)                # each key's page and slot, for both passes
    slots = np.empty(chunk, dtype=np.int64)
    for start in range(c0, c1, chunk):
        n = min(chunk, c1 - start)
        pi, slot = start // P, start % P                   # walked along: no division per key
        for jj in range(n):
            pages[jj], slots[jj] = table[row, pi], slot
            slot += 1
            if slot == P:
                pi, slot = pi + 1, 0
        j0 = 0
        while j0 < n:                                      # a run of keys in one page: its heads in order
            j1 = min(n, j0 + P - slots[j0])
            for a in range(A):
                for jj in range(j0, j1):
                    p, page, slot = start + jj, pages[jj], slots[jj]
                    for r in range(R):
                        f = a * R + r
                        x = f32(0.0)
                        for d in range(D):
                            x += q[a, r, d] * kc[page, hk + a, slot, d]
                        if softcap > f32(0.0):
                            x = softcap * np.tanh(x)
                        if use_alibi:
                            x -= slopes[f] * f32(abs(diag[f] - p))
                        s[f, jj] = x if lo[f] <= p < hi[f] else -np.inf
            j0 = j1
        for f in range(A * R):
            m_new = m_i[f]
            for jj in range(n):
                m_new = _fmax(m_new, s[f, jj])
            shift = f32(0.0) if m_new == -np.inf else m_new
            total = f32(0.0)
            for jj in range(n):
                x = s[f, jj]
                e = f32(0.0) if x == -np.inf else exp2_f32((x - shift) * LOG2E)
                s[f, jj] = e
                total += e
            al = exp2_f32((m_i[f] - shift) * LOG2E)
            alpha[f] = al
            l_i[f] = l_i[f] * al + total
            m_i[f] = m_new
            if al != f32(1.0):
                for d in range(Dv):
                    acc[f // R, f % R, d] *= al
        j0 = 0
        while j0 < n:
            j1 = min(n, j0 + P - slots[j0])
            for a in range(A):
                for jj in range(j0, j1):
                    p, page, slot = start + jj, pages[jj], slots[jj]
                    for r in range(R):
                        f = a * R + r
                        if lo[f] <= p < hi[f]:           # an excluded key's value is never read
                            w = s[f, jj]
                            for d in range(Dv):
                                acc[a, r, d] += w * vc[page, hk + a, slot, d]
            j0 = j1


def _with_alpha(kernel):
    def run(s, m_i, l_i, *bounds):
        alpha = np.empty_like(m_i)
        kernel(s, m_i, l_i, alpha, *bounds)
        return alpha
    return run


KERNELS = SimpleNamespace(name="numba", softmax_tile=_with_alpha(_softmax_tile),
                          softmax_tile_bounded=_with_alpha(_softmax_tile_bounded), rescale_add=rescale_add,
                          exp_from_lse=exp_from_lse, ds_tile=ds_tile, alibi_tile=alibi_tile,
                          dropout_tile=dropout_tile, decode_part=decode_part)
