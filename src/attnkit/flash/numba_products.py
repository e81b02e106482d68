"""The decoding kernels' products and softmax row passes, written with the explicit
vectors of :mod:`.numba_simd`: scores (rows of q against key rows), weighted sums of
value rows, and the row passes (scale, max, exp and sum over a row of a few dozen keys,
where LLVM's own vector loops never ran).

LLVM vectorises a plain loop over the head dim with one accumulator per row and key,
summed across its lanes after every key: four rows against one key cost 4 horizontal
sums, and chains of dependent multiply-adds (57 cycles a key where 32 multiply-adds
take 16). Here the code says what the vectors hold: four rows by :data:`KEYS` keys of
scores from one pass over their accumulators, summed across lanes together (4·KEYS − 1
shuffle steps for 4·KEYS sums); the value pass keeps four output rows by :data:`VALUE_LANES` lanes
in registers across its keys (by two vectors where no more are left: a head dim of 32
does no work on empty lanes). Both tiles are sized to the machine's vector registers
(:data:`.numba_simd.LANES`): AVX-512's 32 hold four rows by four keys (16 accumulators
and 8 loads) and by four vectors; AVX2's 16 hold four rows by two keys (8 and 6) and by
two vectors. Decoding from memory then waits less on arithmetic (docs/decisions.md).

Operands are addresses (``address(arr, idx)``) with byte strides between rows; rows
are float32 with unit stride. Every sum runs in an order fixed when the kernels
compile, so results are the same whatever the thread count.

Developers: numba's disk cache follows a function's own file: after editing this one,
delete ``__pycache__/numba_kernels*.nb*``, ``numba_small*.nb*`` and
``numba_products*.nb*`` (they inline it).
"""

from __future__ import annotations

import numba
import numpy as np

from .numba_simd import (
    LANES,
    LOG2E,
    REDUCE,
    exp2v,
    fill_from,
    fma,
    get,
    hmax,
    hsum,
    is_neginf,
    load,
    load_part,
    prefetch_bytes,
    put,
    put_sums4,
    splat,
    store,
    store_part,
    sum4,
    vadd,
    vmax,
    vmul,
    vsub,
)


@numba.njit(**REDUCE, inline="always")
def _ld(p, n, full):
    # load, or load_part where the block is partial (full: known for the whole loop,
    # which the compiler unswitches on it)
    return load(p) if full else load_part(p, n)


@numba.njit(**REDUCE, inline="always")
def _st(p, x, n, full):
    if full:
        store(p, x)
    else:
        store_part(p, x, n)


# the register tiles (see the module's note): keys a pass of the scores' four rows
# takes, and lanes a pass of the value rows' four output rows keeps
KEYS = LANES // 4
VALUE_LANES = 4 * LANES if LANES == 16 else 2 * LANES


@numba.njit(**REDUCE, inline="always")
def _dot4x4(q0, qst, k0, kst, D, s0, sst):
    # at s0 + i·sst, four floats: Σ_d q_i[d]·k_j[d] for rows q_i at q0 + i·qst, keys k_j at k0 + j·kst
    q1, q2, q3 = q0 + qst, q0 + 2 * qst, q0 + 3 * qst
    k1, k2, k3 = k0 + kst, k0 + 2 * kst, k0 + 3 * kst
    z = splat(0.0)
    x00 = x01 = x02 = x03 = x10 = x11 = x12 = x13 = x20 = x21 = x22 = x23 = x30 = x31 = x32 = x33 = z
    for d in range(0, D, LANES):
        o, t = 4 * d, D - d
        full = t >= LANES
        a0, a1, a2, a3 = _ld(q0 + o, t, full), _ld(q1 + o, t, full), _ld(q2 + o, t, full), _ld(q3 + o, t, full)
        b0, b1, b2, b3 = _ld(k0 + o, t, full), _ld(k1 + o, t, full), _ld(k2 + o, t, full), _ld(k3 + o, t, full)
        x00, x01, x02, x03 = fma(a0, b0, x00), fma(a0, b1, x01), fma(a0, b2, x02), fma(a0, b3, x03)
        x10, x11, x12, x13 = fma(a1, b0, x10), fma(a1, b1, x11), fma(a1, b2, x12), fma(a1, b3, x13)
        x20, x21, x22, x23 = fma(a2, b0, x20), fma(a2, b1, x21), fma(a2, b2, x22), fma(a2, b3, x23)
        x30, x31, x32, x33 = fma(a3, b0, x30), fma(a3, b1, x31), fma(a3, b2, x32), fma(a3, b3, x33)
    put_sums4(s0, sst, x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33)


@numba.njit(**REDUCE, inline="always")
def _dot4x2(q0, qst, k0, kst, D, s0, sst):
    # as _dot4x4 for two keys (AVX2's registers)
    q1, q2, q3, k1 = q0 + qst, q0 + 2 * qst, q0 + 3 * qst, k0 + kst
    x00 = x01 = x10 = x11 = x20 = x21 = x30 = x31 = splat(0.0)
    for d in range(0, D, LANES):
        o, t = 4 * d, D - d
        full = t >= LANES
        b0, b1 = _ld(k0 + o, t, full), _ld(k1 + o, t, full)
        a = _ld(q0 + o, t, full)
        x00, x01 = fma(a, b0, x00), fma(a, b1, x01)
        a = _ld(q1 + o, t, full)
        x10, x11 = fma(a, b0, x10), fma(a, b1, x11)
        a = _ld(q2 + o, t, full)
        x20, x21 = fma(a, b0, x20), fma(a, b1, x21)
        a = _ld(q3 + o, t, full)
        x30, x31 = fma(a, b0, x30), fma(a, b1, x31)
    put_sums4(s0, sst, x00, x01, x10, x11, x20, x21, x30, x31)


_tile = _dot4x4 if KEYS == 4 else _dot4x2


@numba.njit(**REDUCE, inline="always")
def _dot4(p0, st, y, D):
    # Σ_d p_i[d]·y[d] for four rows p_i at p0 + i·st and one row y
    p1, p2, p3 = p0 + st, p0 + 2 * st, p0 + 3 * st
    x0 = x1 = x2 = x3 = splat(0.0)
    for d in range(0, D, LANES):
        o, t = 4 * d, D - d
        full = t >= LANES
        yy, a0, a1 = _ld(y + o, t, full), _ld(p0 + o, t, full), _ld(p1 + o, t, full)
        a2, a3 = _ld(p2 + o, t, full), _ld(p3 + o, t, full)
        x0, x1, x2, x3 = fma(a0, yy, x0), fma(a1, yy, x1), fma(a2, yy, x2), fma(a3, yy, x3)
    return sum4(x0, x1, x2, x3)


@numba.njit(**REDUCE, inline="always")
def _dot1(p, y, D):
    x = splat(0.0)
    for d in range(0, D, LANES):
        o, t = 4 * d, D - d
        x = fma(_ld(p + o, t, t >= LANES), _ld(y + o, t, t >= LANES), x)
    return hsum(x)


@numba.njit(**REDUCE, inline="always")
def scores(q0, qst, R, D, k0, kst, j0, j1, s0, sst, v0, vst, pf):
    """s[r, j] (at s0 + r·sst + 4j) = q_r · k_j for rows r < R (at q0 + r·qst) and keys
    j in [j0, j1) (at k0 + j·kst), four keys at a time: four rows by KEYS keys per pass,
    the rows past a multiple of four one by four keys; the first pf bytes of each key's
    value row (at v0 + j·vst) prefetched on the way."""
    R4, j4 = R - R % 4, j0 + (j1 - j0) // 4 * 4
    for jb in range(j0, j1, 4):
        for jj in range(jb, min(jb + 4, j1)):
            prefetch_bytes(v0 + jj * vst, pf)
        pk = k0 + jb * kst
        if jb < j4:
            for r in range(0, R4, 4):
                for t in range(0, 4, KEYS):
                    _tile(q0 + r * qst, qst, pk + t * kst, kst, D, s0 + r * sst + 4 * (jb + t), sst)
            for r in range(R4, R):
                x0, x1, x2, x3 = _dot4(pk, kst, q0 + r * qst, D)
                ps = s0 + r * sst + 4 * jb
                put(ps, x0), put(ps + 4, x1), put(ps + 8, x2), put(ps + 12, x3)
        else:                                            # the last keys, one by one
            for jj in range(jb, j1):
                pk = k0 + jj * kst
                for r in range(0, R4, 4):
                    x0, x1, x2, x3 = _dot4(q0 + r * qst, qst, pk, D)
                    ps = s0 + r * sst + 4 * jj
                    put(ps, x0), put(ps + sst, x1), put(ps + 2 * sst, x2), put(ps + 3 * sst, x3)
                for r in range(R4, R):
                    put(s0 + r * sst + 4 * jj, _dot1(q0 + r * qst, pk, D))


@numba.njit(**REDUCE, inline="always")
def _values4x2(s0, sst, j0, j1, v0, vst, p0, ast, n):
    # as _values4 for n ≤ 2·LANES lanes (or more, of which 2·LANES are taken): four rows
    # by two vectors, the same sums in the same order (no multiply-adds on lanes that
    # hold nothing)
    p1, p2, p3 = p0 + ast, p0 + 2 * ast, p0 + 3 * ast
    s1, s2, s3 = s0 + sst, s0 + 2 * sst, s0 + 3 * sst
    m, full, h = n - LANES, n >= 2 * LANES, 4 * LANES
    t00, t01, t10, t11 = _ld(p0, n, full), _ld(p0 + h, m, full), _ld(p1, n, full), _ld(p1 + h, m, full)
    t20, t21, t30, t31 = _ld(p2, n, full), _ld(p2 + h, m, full), _ld(p3, n, full), _ld(p3 + h, m, full)
    for j in range(j0, j1):
        pv = v0 + j * vst
        y0, y1 = _ld(pv, n, full), _ld(pv + h, m, full)
        w = splat(get(s0 + 4 * j))
        t00, t01 = fma(w, y0, t00), fma(w, y1, t01)
        w = splat(get(s1 + 4 * j))
        t10, t11 = fma(w, y0, t10), fma(w, y1, t11)
        w = splat(get(s2 + 4 * j))
        t20, t21 = fma(w, y0, t20), fma(w, y1, t21)
        w = splat(get(s3 + 4 * j))
        t30, t31 = fma(w, y0, t30), fma(w, y1, t31)
    _st(p0, t00, n, full), _st(p0 + h, t01, m, full), _st(p1, t10, n, full), _st(p1 + h, t11, m, full)
    _st(p2, t20, n, full), _st(p2 + h, t21, m, full), _st(p3, t30, n, full), _st(p3 + h, t31, m, full)


@numba.njit(**REDUCE, inline="always")
def _values4(s0, sst, j0, j1, v0, vst, p0, ast, Dv):
    # rows p_i (at p0 + i·ast, i < 4) += Σ_j s_i[j]·v_j: four rows by VALUE_LANES in
    # registers across the keys (four vectors; AVX2: two, :func:`_values4x2`), by two
    # vectors for the last 2·LANES or fewer; past Dv no lane is read or written
    p1, p2, p3 = p0 + ast, p0 + 2 * ast, p0 + 3 * ast
    s1, s2, s3 = s0 + sst, s0 + 2 * sst, s0 + 3 * sst
    h = 4 * LANES                                        # a vector's bytes
    for d in range(0, Dv, VALUE_LANES):
        o = 4 * d
        n0, n1, n2, n3 = Dv - d, Dv - d - LANES, Dv - d - 2 * LANES, Dv - d - 3 * LANES   # lanes: min(L, n)
        if VALUE_LANES == 2 * LANES or n2 <= 0:
            _values4x2(s0, sst, j0, j1, v0 + o, vst, p0 + o, ast, n0)
            continue
        full = d + 4 * LANES <= Dv
        t00, t01, t02, t03 = _ld(p0 + o, n0, full), _ld(p0 + o + h, n1, full), _ld(p0 + o + 2 * h, n2, full), \
            _ld(p0 + o + 3 * h, n3, full)
        t10, t11, t12, t13 = _ld(p1 + o, n0, full), _ld(p1 + o + h, n1, full), _ld(p1 + o + 2 * h, n2, full), \
            _ld(p1 + o + 3 * h, n3, full)
        t20, t21, t22, t23 = _ld(p2 + o, n0, full), _ld(p2 + o + h, n1, full), _ld(p2 + o + 2 * h, n2, full), \
            _ld(p2 + o + 3 * h, n3, full)
        t30, t31, t32, t33 = _ld(p3 + o, n0, full), _ld(p3 + o + h, n1, full), _ld(p3 + o + 2 * h, n2, full), \
            _ld(p3 + o + 3 * h, n3, full)
        for j in range(j0, j1):
            pv = v0 + j * vst + o
            y0, y1 = _ld(pv, n0, full), _ld(pv + h, n1, full)
            y2, y3 = _ld(pv + 2 * h, n2, full), _ld(pv + 3 * h, n3, full)
            w = splat(get(s0 + 4 * j))
            t00, t01, t02, t03 = fma(w, y0, t00), fma(w, y1, t01), fma(w, y2, t02), fma(w, y3, t03)
            w = splat(get(s1 + 4 * j))
            t10, t11, t12, t13 = fma(w, y0, t10), fma(w, y1, t11), fma(w, y2, t12), fma(w, y3, t13)
            w = splat(get(s2 + 4 * j))
            t20, t21, t22, t23 = fma(w, y0, t20), fma(w, y1, t21), fma(w, y2, t22), fma(w, y3, t23)
            w = splat(get(s3 + 4 * j))
            t30, t31, t32, t33 = fma(w, y0, t30), fma(w, y1, t31), fma(w, y2, t32), fma(w, y3, t33)
        _st(p0 + o, t00, n0, full), _st(p0 + o + h, t01, n1, full), _st(p0 + o + 2 * h, t02, n2, full)
        _st(p0 + o + 3 * h, t03, n3, full), _st(p1 + o, t10, n0, full), _st(p1 + o + h, t11, n1, full)
        _st(p1 + o + 2 * h, t12, n2, full), _st(p1 + o + 3 * h, t13, n3, full), _st(p2 + o, t20, n0, full)
        _st(p2 + o + h, t21, n1, full), _st(p2 + o + 2 * h, t22, n2, full), _st(p2 + o + 3 * h, t23, n3, full)
        _st(p3 + o, t30, n0, full), _st(p3 + o + h, t31, n1, full), _st(p3 + o + 2 * h, t32, n2, full)
        _st(p3 + o + 3 * h, t33, n3, full)


@numba.njit(**REDUCE, inline="always")
def _values1(s0, j0, j1, v0, vst, p, Dv):
    # row p += Σ_j s[j]·v_j, four vectors in registers, two for the last 2·LANES lanes or
    # fewer (as _values4, one row)
    h = 4 * LANES
    for d in range(0, Dv, 4 * LANES):
        o = 4 * d
        n0, n1, n2, n3 = Dv - d, Dv - d - LANES, Dv - d - 2 * LANES, Dv - d - 3 * LANES
        if n2 <= 0:
            full = n0 == 2 * LANES
            t0, t1 = _ld(p + o, n0, full), _ld(p + o + h, n1, full)
            for j in range(j0, j1):
                pv, w = v0 + j * vst + o, splat(get(s0 + 4 * j))
                t0, t1 = fma(w, _ld(pv, n0, full), t0), fma(w, _ld(pv + h, n1, full), t1)
            _st(p + o, t0, n0, full), _st(p + o + h, t1, n1, full)
            continue
        full = d + 4 * LANES <= Dv
        t0, t1, t2, t3 = _ld(p + o, n0, full), _ld(p + o + h, n1, full), _ld(p + o + 2 * h, n2, full), \
            _ld(p + o + 3 * h, n3, full)
        for j in range(j0, j1):
            pv, w = v0 + j * vst + o, splat(get(s0 + 4 * j))
            t0, t1 = fma(w, _ld(pv, n0, full), t0), fma(w, _ld(pv + h, n1, full), t1)
            t2, t3 = fma(w, _ld(pv + 2 * h, n2, full), t2), fma(w, _ld(pv + 3 * h, n3, full), t3)
        _st(p + o, t0, n0, full), _st(p + o + h, t1, n1, full), _st(p + o + 2 * h, t2, n2, full)
        _st(p + o + 3 * h, t3, n3, full)


@numba.njit(**REDUCE, inline="always")
def weighted_values(s0, sst, R, j0, j1, v0, vst, a0, ast, Dv):
    """Output rows r < R (at a0 + r·ast, Dv floats) += Σ_j s[r, j]·v_j over keys j in
    [j0, j1) (s[r, j] at s0 + r·sst + 4j, v_j at v0 + j·vst), four rows at a time."""
    R4 = R - R % 4
    for r in range(0, R4, 4):
        _values4(s0 + r * sst, sst, j0, j1, v0, vst, a0 + r * ast, ast, Dv)
    for r in range(R4, R):
        _values1(s0 + r * sst, j0, j1, v0, vst, a0 + r * ast, Dv)


@numba.njit(**REDUCE, inline="always")
def copy_row(p, x, n):
    """The n floats at x to p, a vector at a time."""
    for o in range(0, n, LANES):
        t = n - o
        full = t >= LANES
        _st(p + 4 * o, _ld(x + 4 * o, t, full), t, full)


# ---- row passes of the softmax (a row of n floats at p) -------------------------------
@numba.njit(**REDUCE, inline="always")
def scale_row(p, n, scale):
    """x · scale in place. (LLVM's own loops over a row of a few dozen keys ran their
    scalar remainder only: its vector loop takes 64 at a time.)"""
    c = splat(scale)
    for o in range(0, n, LANES):
        a, t = p + 4 * o, n - o
        full = t >= LANES
        _st(a, vmul(_ld(a, t, full), c), t, full)


@numba.njit(**REDUCE, inline="always")
def row_max(p, n):
    """(the row's max, −inf for n ≤ 0; whether a value is −inf)."""
    mx, h = splat(-np.inf), splat(0.0)
    for o in range(0, n, LANES):
        t = n - o
        x = _ld(p + 4 * o, t, t >= LANES)              # lanes past t: 0
        mx = vmax(mx, fill_from(x, t, -np.inf))
        h = vmax(h, is_neginf(x))
    return hmax(mx), hmax(h) > 0


@numba.njit(**REDUCE, inline="always")
def exp_row(p, n, shift):
    """x → exp(x − shift) in place (2^((x − shift) · log2 e), :func:`exp2v`); their sum."""
    c, l2e, tot = splat(shift), splat(LOG2E), splat(0.0)
    for o in range(0, n, LANES):
        a, t = p + 4 * o, n - o
        full = t >= LANES
        e = fill_from(exp2v(vmul(vsub(_ld(a, t, full), c), l2e)), t, 0.0)
        _st(a, e, t, full)
        tot = vadd(tot, e)
    return hsum(tot)


@numba.njit(**REDUCE, inline="always")
def weighted_values_bounded(s0, sst, R, lo, hi, skip, v0, vst, a0, ast, Dv):
    """As :func:`weighted_values` with row r over its own keys [lo[r], hi[r]), rows with
    skip[r] left alone: four rows at a time over the keys all four see, then each row
    alone over the rest of its keys (a causal band's rows see nearly the same keys)."""
    for r0 in range(0, R, 4):
        r1 = min(r0 + 4, R)
        m0, m1, four = lo[r0], hi[r0], r1 - r0 == 4
        for r in range(r0, r1):
            m0, m1, four = max(m0, lo[r]), min(m1, hi[r]), four and not skip[r]
        if not (four and m1 > m0):
            m0 = m1 = hi[r0]                             # (no shared keys: each row alone)
        else:
            _values4(s0 + r0 * sst, sst, m0, m1, v0, vst, a0 + r0 * ast, ast, Dv)
        for r in range(r0, r1):
            if not skip[r]:
                if m1 > m0:
                    _values1(s0 + r * sst, lo[r], m0, v0, vst, a0 + r * ast, Dv)
                    _values1(s0 + r * sst, m1, hi[r], v0, vst, a0 + r * ast, Dv)
                else:
                    _values1(s0 + r * sst, lo[r], hi[r], v0, vst, a0 + r * ast, Dv)
