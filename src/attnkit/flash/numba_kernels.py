"""float32 tile kernels compiled by numba (see :mod:`.kernels` for what each computes):
one pass for the row max, one fused pass for exp and the row sum, with a polynomial
exp that the compiler vectorises. Compiled on first use and cached on disk
(``cache=True``), so later processes load them instead of compiling.

Fast-math without reassociation keeps every sum in its source order; the row max and
row sum allow it (the order is then fixed at compile time, so the bits stay the same
run to run and thread to thread). The kernels ask LLVM for 512-bit vectors where the
machine has them (``_wide``): the row softmax, the causal diagonal and decoding ran
5–20% faster on an AVX-512 Xeon than with LLVM's default 256-bit ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .numba_products import copy_row, scores, weighted_values
from .numba_simd import EXP2_MIN as _EXP2_MIN
from .numba_simd import EXP2_POLY, ORDERED, REDUCE, address, prefetch_bytes
from .numba_simd import LOG2E as _LOG2E

f32 = np.float32
LOG2E = f32(_LOG2E)                                      # exp(x) = 2^(x · log2 e)
EXP2_MIN = f32(_EXP2_MIN)                                # below 2^-125 the result is 0


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


WIDE_ATTRIBUTES = ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"')


@intrinsic
def _wide(typingctx):
    # LLVM vectorises with 256-bit registers on AVX-512 machines unless the function
    # asks for 512 (clang's -mprefer-vector-width=512); numba has no option for it, so
    # the kernels below add the attributes to their own LLVM function. llvmlite checks
    # attribute names against a fixed list, hence set.add; on another llvmlite, or a
    # machine without AVX-512, the kernels stay as they were (same code, narrower)
    def codegen(context, builder, signature, args):
        try:
            for attr in WIDE_ATTRIBUTES:                 # read at compile time (kernels._probed)
                set.add(builder.function.attributes, attr)
        except TypeError:
            pass
        return context.get_dummy_value()
    return types.none(), codegen


@numba.njit(**ORDERED)
def exp2_f32(t):
    # 2^t = 2^n · 2^r with n = round(t), r = t − n exact, |r| ≤ 1/2, by numba_simd's
    # EXP2_POLY (the rule its vector exp2v follows too); callers fold log2(e) into t
    # (exp(x − c) = 2^(x·log2 e − c·log2 e)). t ≤ 0 here (scores minus their max).
    n = np.floor(t + f32(0.5))
    r = t - n
    p = f32(EXP2_POLY[0])
    p = p * r + f32(EXP2_POLY[1])
    p = p * r + f32(EXP2_POLY[2])
    p = p * r + f32(EXP2_POLY[3])
    p = p * r + f32(EXP2_POLY[4])
    p = p * r + f32(EXP2_POLY[5])
    y = p * r + f32(1.0)
    y = y * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)  # 2^n from its exponent bits
    # below 2^−125 (and for −inf) the bits above are garbage: the result is exactly 0
    # there; a NaN t fails the test and stays NaN through r
    return f32(0.0) if t < EXP2_MIN else y


@numba.njit(**REDUCE, inline="always")
def _all_finite(x):
    # every element of a 2-D array finite: x · 0 is 0 only for finite x, and a sum
    # (unlike a loop that stops at the first NaN) vectorises — the forward loop's check
    # of each p v product took 4 of a BERT batch's 21 ms on one thread element by element
    z = f32(0.0)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            z += x[i, j] * f32(0.0)
    return z == f32(0.0)


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


# The kernels that the compiled tile loop (numba_loop) also runs are written once as
# inline="always" bodies (inlined by numba, not LLVM): a call from one compiled kernel
# into another may run either function's own machine code depending on which was
# loaded first in the process, and the fast-math reductions here rounded differently
# in the two (seen as different bits of the same tile loop). Worse, a kernel first
# compiled for a caller's argument types is compiled with the caller's fast-math flags
# and cached so: the loop calls no kernel at all.
@numba.njit(**REDUCE)
def _softmax_tile(s, m_i, l_i, alpha):
    _wide()
    _softmax_rows(s, m_i, l_i, alpha)


@numba.njit(**REDUCE, inline="always")
def _softmax_rows(s, m_i, l_i, alpha):
    for i in range(s.shape[0]):
        _softmax_span(s, i, 0, s.shape[1], m_i, l_i, alpha)


@numba.njit(**REDUCE)
def _softmax_tile_bounded(s, m_i, l_i, alpha, lo, hi, c0):
    _wide()
    _softmax_rows_bounded(s, m_i, l_i, alpha, lo, hi, c0)


@numba.njit(**REDUCE, inline="always")
def _softmax_rows_bounded(s, m_i, l_i, alpha, lo, hi, c0):
    # row i limited to the keys [lo[i], hi[i]); the other columns get weight 0 and never
    # reach the max or the sum (NaN or inf there cannot leak into the row). Each row's
    # visible columns are taken as a view, looped from 0: a loop from a bound read per
    # row (numba checks such an index for wraparound) was left scalar and ran 4–13×
    # slower, and a select over the whole tile width did twice the work of a plain row
    # (measured on 1024 × 256 and 128 × 512 tiles: the view is 1.6–2.4× faster).
    w = s.shape[1]
    for i in range(s.shape[0]):
        a0 = min(max(lo[i] - c0, 0), w)
        a1 = min(max(hi[i] - c0, a0), w)
        row = s[i, a0:a1]
        m_new = m_i[i]
        for j in range(row.shape[0]):
            m_new = _fmax(m_new, row[j])
        shift = f32(0.0) if m_new == -np.inf else m_new  # all −inf so far: shift by 0, no NaN
        total = f32(0.0)
        for j in range(row.shape[0]):
            e = exp2_f32((row[j] - shift) * LOG2E)
            row[j] = e
            total += e
        for j in range(a0):
            s[i, j] = f32(0.0)
        tail = s[i, a1:]
        for j in range(tail.shape[0]):
            tail[j] = f32(0.0)
        _row_done(i, m_new, shift, total, m_i, l_i, alpha)


@numba.njit(**ORDERED)
def rescale_add(o, alpha, pv):
    _wide()
    _rescale_add(o, alpha, pv)


@numba.njit(**ORDERED, inline="always")
def _rescale_add(o, alpha, pv):
    n = o.shape[1]
    for i in range(o.shape[0]):                          # (element-wise indexing: no row views)
        a = alpha[i]
        if a == f32(1.0):
            for j in range(n):
                o[i, j] += pv[i, j]
        else:
            for j in range(n):
                o[i, j] = o[i, j] * a + pv[i, j]


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")   # exact division, as NumPy's
def _normalized(x, li):
    # one element of a row with sum li: 0 without a key or sink (li = 0), an infinite
    # quotient (an inf value the row sees) NaN
    if li == f32(0.0):
        return f32(0.0)
    y = x / li
    return f32(np.nan) if np.isinf(y) else y


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _lse_value(mi, li):
    return (-np.inf if li == f32(0.0) else np.log(li)) + mi   # NaN stays NaN


@numba.njit(nogil=True, cache=True, error_model="numpy")
def finish_into(acc, m_i, l_i, out, lse):
    # out (F, R, Dv) and lse (F, R), any strides: row i = f·R + r of acc. Never out =
    # acc: the compiler then cannot rule out an overlap and takes its scalar loop (10×
    # slower); in place is normalize's
    _wide()
    F, R, Dv = out.shape
    for f in range(F):
        for r in range(R):
            i = f * R + r
            li = l_i[i]
            lse[f, r] = _lse_value(m_i[i], li)
            for d in range(Dv):
                out[f, r, d] = _normalized(acc[i, d], li)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def normalize(acc, l_i):
    _wide()
    for i in range(acc.shape[0]):
        li = l_i[i]
        for d in range(acc.shape[1]):
            acc[i, d] = _normalized(acc[i, d], li)


@numba.njit(**ORDERED)
def exp_from_lse(s, lse):
    _wide()
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
    _wide()
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
CHUNK = 32                                               # keys per pass over the rows (pages of 16:
                                                         # 3% faster than 64 from memory, B = 8 and 1)
CHUNK_LONG = 256                                         # the same where pages hold at least this many keys
GATHER_P = 2                                             # pages of fewer keys (one): a chunk's rows copied into one run


@numba.njit(**REDUCE, inline="always")
def _prefetch_row(x, page, h, slot):
    # every 64-byte line of the row x[page, h, slot, :], into L2
    prefetch_bytes(address(x, (page, h, slot, 0)), 4 * x.shape[3])


@numba.njit(**REDUCE, inline="always")
def _prefetch_next(kc, vc, page, slot, a, A, h, hk, jj, n_next, n_pages, n_slots):
    # key jj's key and value rows for the next pass over the keys (the next head's in this
    # chunk, or the first head's in the next), which no hardware prefetcher predicts on
    # short pages: the value rows a whole pass ahead too, not during the scores just
    # before them (pages of 16 from memory 1.04–1.15× faster; the same for pages of 64
    # and 128, whose runs fill a chunk, ran 0.93×: docs/decisions.md)
    if a + 1 < A:
        _prefetch_row(kc, page, h + 1, slot)
        _prefetch_row(vc, page, h + 1, slot)
    elif jj < n_next:
        _prefetch_row(kc, n_pages[jj], hk, n_slots[jj])
        _prefetch_row(vc, n_pages[jj], hk, n_slots[jj])


@numba.njit(**REDUCE, inline="always")
def _walk(table, row, P, start, n, pages, slots):
    # page and slot of keys start … start + n − 1 (walked along: no division per key)
    pi, slot = start // P, start % P
    for jj in range(n):
        pages[jj], slots[jj] = table[row, pi], slot
        slot += 1
        if slot == P:
            pi, slot = pi + 1, 0


@numba.njit(**REDUCE)
def decode_part(q, kc, vc, table, row, hk, P, c0, c1, lo, hi, softcap, slopes, diag, m_i, l_i, acc):
    """Rows q (A, R, D) — already times scale (and / softcap) — of kv heads hk … hk + A − 1
    (R rows each) against keys [c0, c1) of one sequence, key p of kv head hk + a at
    ``kc[table[row, p // P], hk + a, p % P]`` (a contiguous cache is one page per
    sequence: table[row] = [row], P = S). Flat row f = a·R + r sees keys [lo[f], hi[f]);
    ALiBi subtracts slopes[f]·|diag[f] − p| when slopes has rows; softcap > 0 caps.
    Updates the online softmax state m_i, l_i (A·R,) and acc (A, R, Dv) in place.

    Keys go in chunks of CHUNK (CHUNK_LONG where a page holds at least that many), in
    three passes: the scores (:func:`.numba_products.scores`: four rows by four keys —
    two at a time on AVX2 — per pass over their vector accumulators — a GQA group's heads share each key read —
    while the same keys' value rows are prefetched, on runs of a chunk); the softmax of the chunk row by
    row (caps, ALiBi and bounds over whole rows: vectorised, and no call of tanh inside
    the score loop, whose registers it would spill); the values
    (:func:`.numba_products.weighted_values`: four output rows by as many lanes as the
    machine's registers hold, across the keys) — where some row's bounds cut the chunk, or a score inside them is
    −inf (an infinite q or k entry), key by key and only the keys each row sees (an
    excluded key's value is never read). Each kv head takes the three passes in turn
    (what a pass prefetches then stays in L2). On pages of one key (under GATHER_P) a
    head's key rows of the chunk, then its value rows, are copied into one run before
    its passes (a scores and a values call per key cost pages of one 1.1–1.6× at 32k
    keys, B = 8 or 4 queries; docs/decisions.md). On pages of fewer keys than a chunk the
    value pass prefetches the next pass's key and value rows; longer runs (a dense cache,
    pages of 32 keys and more) the hardware prefetcher follows (prefetching them too ran
    4–7% slower on an Intel host: dense, pages of 256 and 1,024; pages of 32 and 64 the
    same within noise). q, and each cache row, must have unit stride along D. Against
    LLVM's own vectorisation of the same loops (the kernel before, docs/decisions.md):
    1.5× less compute per key from cache; B = 8 from memory 12.4–13.6 → 11.1–11.9 ms on
    two threads of an Intel host."""
    _wide()
    A, R, D = q.shape
    Dv = acc.shape[2]
    chunk = CHUNK_LONG if P >= CHUNK_LONG else CHUNK
    s = np.empty((R, chunk), dtype=np.float32)            # one head's scores, then weights
    use_alibi = slopes.shape[0] == A * R
    pages, slots = np.empty(chunk, dtype=np.int64), np.empty(chunk, dtype=np.int64)
    n_pages, n_slots = np.empty(chunk, dtype=np.int64), np.empty(chunk, dtype=np.int64)
    kst, vst, sst = kc.strides[2], vc.strides[2], s.strides[0]
    gather = P < GATHER_P                                 # short pages: each head's rows of the chunk
    kbuf = np.empty((chunk if gather else 0, D), dtype=np.float32)    # copied into one run
    vbuf = np.empty((chunk if gather else 0, Dv), dtype=np.float32)
    # one kv head at a time through the three passes, so that the rows a pass prefetches
    # (a chunk of one head's keys or values) stay in L2 until read: all eight heads' of
    # a dense chunk (1 MiB each way) did not (B = 8 from memory 18.7 → 15.1 ms on an
    # Intel host), and all heads of pages of 16 together ran 1.2× slower than one at a
    # time (docs/decisions.md)
    _walk(table, row, P, c0, min(chunk, c1 - c0), n_pages, n_slots)
    for start in range(c0, c1, chunk):
        n = min(chunk, c1 - start)
        pages, n_pages, slots, n_slots = n_pages, pages, n_slots, slots
        n_next = max(0, min(chunk, c1 - start - chunk))
        _walk(table, row, P, start + chunk, n_next, n_pages, n_slots)
        for a in range(A):
            h = hk + a
            if gather:                                     # (key rows prefetched the pass before)
                for jj in range(n):
                    copy_row(address(kbuf, (jj, 0)), address(kc, (pages[jj], h, slots[jj], 0)), D)
                    _prefetch_row(vc, pages[jj], h, slots[jj])
                scores(address(q, (a, 0, 0)), q.strides[1], R, D, address(kbuf, (0, 0)), kbuf.strides[0], 0, n,
                       address(s, (0, 0)), sst, 0, 0, 0)
            j0 = 0
            while j0 < n and not gather:                   # a run of keys in one page
                j1 = min(n, j0 + P - slots[j0])
                kp = address(kc, (pages[j0], h, slots[j0], 0)) - j0 * kst
                vp = address(vc, (pages[j0], h, slots[j0], 0)) - j0 * vst
                scores(address(q, (a, 0, 0)), q.strides[1], R, D, kp, kst, j0, j1, address(s, (0, 0)), sst,
                       vp, vst, 0 if P < chunk else 4 * Dv)    # (short pages: the pass before did)
                j0 = j1
            full = True                                    # every row sees every key of the chunk
            for r in range(R):
                f = a * R + r
                if softcap > f32(0.0):
                    for jj in range(n):
                        s[r, jj] = softcap * np.tanh(s[r, jj])
                if use_alibi:
                    slope, dg = slopes[f], diag[f] - start
                    for jj in range(n):
                        s[r, jj] -= slope * f32(abs(dg - jj))
                a0 = min(max(lo[f] - start, 0), n)
                a1 = min(max(hi[f] - start, a0), n)
                full = full and a0 == 0 and a1 == n
                m_new = m_i[f]
                for jj in range(n):
                    x = s[r, jj] if a0 <= jj < a1 else f32(-np.inf)
                    s[r, jj] = x
                    m_new = _fmax(m_new, x)
                low = f32(np.inf)                          # the least score inside the bounds
                for jj in range(np.uint64(a0), np.uint64(a1)):   # (unsigned: no wraparound check;
                    low = -_fmax(-low, -s[r, jj])          # min() would stay scalar)
                shift = f32(0.0) if m_new == -np.inf else m_new
                total = f32(0.0)
                if low == -np.inf:                         # a −inf score (inf in q or k) excludes its
                    full = False                           # key: its weight marked −1, and the
                    for jj in range(n):                    # key-by-key value pass below skips it
                        x = s[r, jj]
                        e = f32(0.0) if x == -np.inf else exp2_f32((x - shift) * LOG2E)
                        total += e
                        s[r, jj] = f32(-1.0) if x == -np.inf and a0 <= jj < a1 else e
                else:
                    for jj in range(n):
                        x = s[r, jj]
                        e = f32(0.0) if x == -np.inf else exp2_f32((x - shift) * LOG2E)
                        s[r, jj] = e
                        total += e
                al = exp2_f32((m_i[f] - shift) * LOG2E)
                l_i[f] = l_i[f] * al + total
                m_i[f] = m_new
                if al != f32(1.0):
                    for d in range(Dv):
                        acc[a, r, d] *= al
            if gather and full:
                for jj in range(n):
                    copy_row(address(vbuf, (jj, 0)), address(vc, (pages[jj], h, slots[jj], 0)), Dv)
                    _prefetch_next(kc, vc, pages[jj], slots[jj], a, A, h, hk, jj, n_next, n_pages, n_slots)
                weighted_values(address(s, (0, 0)), sst, R, 0, n, address(vbuf, (0, 0)), vbuf.strides[0],
                                address(acc, (a, 0, 0)), acc.strides[1], Dv)
            j0 = 0
            while j0 < n and not (gather and full):
                j1 = min(n, j0 + P - slots[j0])
                page, sl0 = pages[j0], slots[j0] - j0      # key jj of the run at slot sl0 + jj
                if P < chunk:                              # short pages: the next pass's rows
                    for jj in range(j0, j1):
                        _prefetch_next(kc, vc, page, slots[jj], a, A, h, hk, jj, n_next, n_pages, n_slots)
                if full:
                    vp = address(vc, (page, h, sl0 + j0, 0)) - j0 * vst
                    weighted_values(address(s, (0, 0)), sst, R, j0, j1, vp, vst, address(acc, (a, 0, 0)),
                                    acc.strides[1], Dv)
                else:                                      # some row's edge in the chunk, or a
                    for jj in range(j0, j1):               # −inf score (weight −1): key by key,
                        sl = sl0 + jj                      # an excluded key's value never read
                        for r in range(R):
                            f = a * R + r
                            w = s[r, jj]
                            if lo[f] <= start + jj < hi[f] and not w < 0:
                                for d in range(Dv):
                                    acc[a, r, d] += w * vc[page, h, sl, d]
                j0 = j1


def _with_alpha(kernel):
    def run(s, m_i, l_i, *bounds):
        alpha = np.empty_like(m_i)
        kernel(s, m_i, l_i, alpha, *bounds)
        return alpha
    return run


KERNELS = SimpleNamespace(name="numba", softmax_tile=_with_alpha(_softmax_tile),
                          softmax_tile_bounded=_with_alpha(_softmax_tile_bounded), rescale_add=rescale_add,
                          finish_into=finish_into, normalize=normalize,
                          exp_from_lse=exp_from_lse, ds_tile=ds_tile, alibi_tile=alibi_tile,
                          dropout_tile=dropout_tile, decode_part=decode_part,
                          tile_tasks=None, backward_tasks=None, small_rows=None,
                          small_rows_at=None, kvcache_rows_at=None, small_units=None)   # (kernels._probed)
