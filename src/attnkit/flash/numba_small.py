"""A whole small call compiled (float32): few query rows per kv head — a decoding step
of a small model — in one call over every batch element and head, for the small
rung (:func:`attnkit.small.forward`). There the Python around NumPy's products and the
row kernels cost more than the arithmetic: a step of 4 × 8 heads (2 kv heads), 45
keys, D = 32 took 23 µs that way, 14 this way (the kernel 10).

Developers: numba's disk cache follows this file's own timestamp, not that of
:mod:`.numba_kernels`, whose bodies and flags are compiled in here: after editing those,
delete ``__pycache__/numba_small*.nb*`` (a fresh clone, as CI's, has none); the same
for :mod:`.numba_simd`.
"""

from __future__ import annotations

import numba
import numpy as np

from .numba_kernels import REDUCE, _fmax, _lse_value, _normalized, _row_done, _softmax_span, _wide, f32
from .numba_simd import address, exp_row, row_max, scale_row, scores, weighted_values, weighted_values_bounded


@numba.njit(**REDUCE)
def small_rows(q, k, v, scale, softcap, lo, hi, m_i, l_i, out, lse):
    """A whole small call with few query rows per kv head (decoding), finished: rows
    q (N, A, R, D) of batch element n and kv head a against keys k (N, A, S, D) and
    values v (N, A, S, Dv) of the same n and a (unit stride along D), into out (N, A, R, Dv)
    and lse (N, A, R). Scores scale · q kᵀ, then softcap · tanh(s / softcap) where
    softcap > 0. Flat row f = a·R + r of element n sees keys [lo[n, f], hi[n, f]) (lo
    with no columns: all S); m_i, l_i (N, A·R) hold each row's state before its keys
    (a sink's; with no columns: none, −inf and 0).

    Per head: the scores (:func:`.numba_simd.scores`, four rows by four keys per pass:
    the rows of a GQA group share each key read), the row softmax by the vector row
    passes (:func:`.numba_simd.scale_row`, ``row_max``, ``exp_row``; a row with a −inf
    score by :func:`_softmax_span`), then the weighted sum of the value rows, by
    :func:`.numba_simd.weighted_values` where every row sees every key, else each row
    over its own keys (:func:`.numba_simd.weighted_values_bounded`: four rows at a time
    over the keys they share), and key by key in a row with a −inf score, whose key is
    never read (the reference's exempt product: an inf or NaN value reaches a row only
    through a key it sees)."""
    _wide()
    N, A, R, D = q.shape
    S, Dv = k.shape[2], v.shape[3]
    s = np.empty((R, S), dtype=np.float32)
    acc = np.empty((1, R, Dv), dtype=np.float32)      # one head's output rows
    row_lo, row_hi = np.zeros(R, dtype=np.int64), np.full(R, S, dtype=np.int64)
    m_r, l_r, alpha = np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32)
    hole, cut = np.empty(S, dtype=np.bool_), np.empty(R, dtype=np.bool_)   # a row's keys with −inf scores
    for n in range(N):
        for a in range(A):
            full = True                                # no bounds or holes cut a row
            scores(address(q, (n, a, 0, 0)), q.strides[2], R, D, address(k, (n, a, 0, 0)), k.strides[2], 0, S,
                   address(s, (0, 0)), s.strides[0], 0, 0, 0)
            for r in range(R):
                scale_row(address(s, (r, 0)), S, scale)
            for r in range(R):
                f = a * R + r
                if lo.shape[1]:
                    row_lo[r], row_hi[r] = lo[n, f], hi[n, f]
                # unsigned: indexing with a signed int whose sign the compiler does not
                # know adds the wraparound of negative indexes, which stops vectorising
                j0, j1 = np.uint64(row_lo[r]), np.uint64(row_hi[r])
                if softcap > f32(0.0):
                    for j in range(j0, j1):
                        s[r, j] = softcap * np.tanh(s[r, j] / softcap)
                m_r[r], l_r[r] = (m_i[n, f], l_i[n, f]) if m_i.shape[1] else (f32(-np.inf), f32(0.0))
                p, width = address(s, (r, j0)) if j1 > j0 else 0, np.int64(j1 - j0)
                top, holes = row_max(p, width)        # holes: −inf scores (an inf in q or k)
                cut[r] = holes
                if holes:                              # their keys marked −1 after the
                    full = False                       # softmax: never read
                    for j in range(j0, j1):
                        hole[j] = s[r, j] == -np.inf
                    _softmax_span(s, r, j0, j1, m_r, l_r, alpha)
                    for j in range(j0, j1):
                        if hole[j]:
                            s[r, j] = f32(-1.0)
                else:
                    m_new = _fmax(m_r[r], top)
                    shift = f32(0.0) if m_new == -np.inf else m_new
                    _row_done(r, m_new, shift, exp_row(p, width, shift), m_r, l_r, alpha)
                full = full and j0 == 0 and j1 == S
                lse[n, a, r] = _lse_value(m_r[r], l_r[r])
            acc[:] = f32(0.0)
            if full:                                   # every row reads every value row
                weighted_values(address(s, (0, 0)), s.strides[0], R, 0, S, address(v, (n, a, 0, 0)), v.strides[2],
                                address(acc, (0, 0, 0)), acc.strides[1], Dv)
            else:                                      # each row its own keys
                weighted_values_bounded(address(s, (0, 0)), s.strides[0], R, row_lo, row_hi, cut,
                                        address(v, (n, a, 0, 0)), v.strides[2], address(acc, (0, 0, 0)),
                                        acc.strides[1], Dv)
                for r in range(R):                     # rows with −inf scores: key by key
                    if not cut[r]:
                        continue
                    for j in range(np.uint64(row_lo[r]), np.uint64(row_hi[r])):
                        w = s[r, j]
                        if not w < f32(0.0):
                            for d in range(Dv):
                                acc[0, r, d] += w * v[n, a, j, d]
            for r in range(R):
                for d in range(Dv):
                    out[n, a, r, d] = _normalized(acc[0, r, d], l_r[r])
