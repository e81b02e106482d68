"""A whole small call compiled (float32): few query rows per kv head — a decoding step
of a small model — in one call over every batch element and head, for the small
rung (:func:`attnkit.small.forward`). There the Python around NumPy's products and the
row kernels cost more than the arithmetic: a step of 4 × 8 heads (2 kv heads), 45
keys, D = 32 took 23 µs that way, 14 this way (the kernel 10). Its (batch element, kv
head) units are claimed from a counter: :func:`small_rows_at` may hand them to torch's
OpenMP team (:func:`small_units`, a C entry every thread runs; no Python there).

Developers: numba's disk cache follows this file's own timestamp, not that of
:mod:`.numba_kernels`, whose bodies and flags are compiled in here: after editing those,
delete ``__pycache__/numba_small*.nb*`` (a fresh clone, as CI's, has none); the same
for :mod:`.numba_simd` and :mod:`.numba_products`.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.arrayobj import populate_array

from .numba_kernels import REDUCE, _fmax, _lse_value, _normalized, _row_done, _softmax_span, _wide, f32
from .numba_loop import _claim, _pointer
from .numba_products import copy_row, exp_row, row_max, scale_row, scores, weighted_values, weighted_values_bounded
from .numba_simd import ORDERED, address


@numba.njit(**REDUCE)
def small_rows(q, k, v, scale, softcap, lo, hi, m_i, l_i, out, lse, counter):
    """A whole small call with few query rows per kv head (decoding), finished: rows
    q (N, A, R, D) of batch element n and kv head a against keys k (N, A, S, D) and
    values v (N, A, S, Dv) of the same n and a (unit stride along D), into out (N, A, R, Dv)
    and lse (N, A, R) (or (N, A, 0): none wanted, no log taken). Scores scale · q kᵀ,
    then softcap · tanh(s / softcap) where softcap > 0. Flat row f = a·R + r of element
    n sees keys [lo[n, f], hi[n, f]) (lo with no columns: all S); m_i, l_i (N, A·R)
    hold each row's state before its keys (a sink's; with no columns: none, −inf and 0).
    The (n, a) units are claimed in turn from ``counter`` (int64: the next unit, then the
    units finished), which threads running the call together share (:func:`small_units`).

    Per head: the scores (:func:`.numba_products.scores`, four rows by four keys a pass:
    the rows of a GQA group share each key read; under bounds each four rows' over the
    keys one of them sees: a causal prefill computes half), the row softmax by the vector row
    passes (:func:`.numba_products.scale_row`, ``row_max``, ``exp_row``; a row with a −inf
    score by :func:`_softmax_span`), then the weighted sum of the value rows, by
    :func:`.numba_products.weighted_values` where every row sees every key, else each row
    over its own keys (:func:`.numba_products.weighted_values_bounded`: four rows at a time
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
    while True:                                        # (batch element, kv head) units, claimed in turn
        u = _claim(counter)
        if u >= N * A:
            return
        n, a = u // A, u % A
        full = True                                # no bounds or holes cut a row
        if lo.shape[1]:                            # each four rows over the keys one of them sees
            for r0 in range(0, R, 4):
                r1, c0, c1 = min(r0 + 4, R), S, 0
                for r in range(r0, r1):              # (a row that sees none may lie past S)
                    if hi[n, a * R + r] > lo[n, a * R + r]:
                        c0, c1 = min(c0, lo[n, a * R + r]), max(c1, hi[n, a * R + r])
                if c1 > c0:
                    scores(address(q, (n, a, r0, 0)), q.strides[2], r1 - r0, D, address(k, (n, a, 0, 0)),
                           k.strides[2], c0, c1, address(s, (r0, 0)), s.strides[0], 0, 0, 0)
                    for r in range(r0, r1):
                        scale_row(address(s, (r, c0)), c1 - c0, scale)
        else:
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
            if lse.shape[2]:                       # (none wanted: no log)
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
        _claim(counter[1:])                        # (one more unit done)


def _viewer(layout: str) -> Any:
    @intrinsic
    def view(typingctx, addr, shape, strides, like):
        if not (isinstance(addr, types.Integer) and isinstance(like, types.Number)
                and isinstance(shape, types.BaseTuple) and isinstance(strides, types.BaseTuple)
                and len(shape) == len(strides)):
            return None
        nd = len(shape)
        aty = types.Array(like, nd, layout)

        def codegen(context, builder, sig, args):
            intp = context.get_value_type(types.intp)
            size = intp(context.get_abi_sizeof(context.get_data_type(like)))
            shape_ty, strides_ty = sig.args[1], sig.args[2]
            shp = [context.cast(builder, x, shape_ty[i], types.intp)
                   for i, x in enumerate(cgutils.unpack_tuple(builder, args[1], nd))]
            stp = [builder.mul(context.cast(builder, x, strides_ty[i], types.intp), size)
                   for i, x in enumerate(cgutils.unpack_tuple(builder, args[2], nd))]
            data = builder.inttoptr(context.cast(builder, args[0], sig.args[0], types.intp),
                                    context.get_value_type(types.CPointer(like)))
            ary = context.make_array(aty)(context, builder)
            populate_array(ary, data=data, shape=shp, strides=stp, itemsize=size, meminfo=None)
            return ary._getvalue()
        return aty(addr, shape, strides, like), codegen
    return view


# view_at(addr, shape, strides, like): an array of like's type (a number) at address
# addr with shape and strides (tuples of ints, strides in elements), owned by nobody
# (valid while the caller's buffer is); c_view_at the same typed C-ordered (the caller's
# strides must be), which the kernels' plain loops vectorise
view_at, c_view_at = _viewer("A"), _viewer("C")


@numba.njit(inline="always")
def _batch_stride(out_shape, shape, strides):
    """The one stride (elements) that steps an operand (shape, strides: its own, batch
    dims right-aligned to the call's; a missing or size-1 dim broadcasts) through the
    call's batch dims (out_shape[:-3]) flattened, or -1 where no one stride does."""
    nb, skip = len(out_shape) - 3, len(out_shape) - len(shape)
    one, step = 0, -1
    for i in range(nb - 1, -1, -1):
        if out_shape[i] == 1:
            continue
        s = 0 if i < skip or shape[i - skip] == 1 else strides[i - skip]
        if step == -1:
            one = s
        elif s != step:
            return -1
        step = s * out_shape[i]
    return one


@numba.njit(inline="always")
def _row_step(L, G, strides):
    """The one stride that steps through a kv head's G·L rows of an (..., H, L, D)
    operand of these strides, or 0 where none does (heads inner, several rows a head)."""
    sh, sl = strides[len(strides) - 3], strides[len(strides) - 2]
    if L == 1 or G == 1 or sh == L * sl:
        return sl if L > 1 else sh
    return 0


@numba.njit(inline="always")
def _heads_at(x, N, A, G, L, D, n_step, strides):
    """An (..., H, L, D) operand at address x as (N, A, G, L, D)."""
    sh, sl = strides[len(strides) - 3], strides[len(strides) - 2]
    return view_at(x, (N, A, G, L, D), (n_step, G * sh, sh, sl, 1), f32(0.0))


# ---- a call's (batch element, kv head) units on torch's OpenMP team ------------------------
# small_rows_at's views as int64 slots that small_units reads on every thread: the
# counters' address (the next unit, the units done), N, A, R, D, S, Dv; q's, k's and
# v's address and four strides (elements); out's and lse's addresses (C-ordered; lse 0:
# none); lo's and hi's addresses and their row count w (0: none); scale's and
# softcap's float32 bits; the sink state's addresses (max, sum) and row count (0: none)
UNIT_SLOTS = 32
_PARALLEL = numba.typeof(ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint)(1))


@intrinsic
def _parallel_at(typingctx, addr):
    # libgomp's GOMP_parallel(fn, data, n, flags) at address addr
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(_PARALLEL))
    return _PARALLEL(types.int64), codegen


@numba.njit(inline="always")
def _put_view(block, i, x):
    block[i] = x.ctypes.data
    for d in range(4):
        block[i + 1 + d] = x.strides[d] // 4
    return i + 5


@numba.cfunc(types.void(types.voidptr), cache=True, error_model="numpy")
def small_units(data):
    """:func:`small_rows` on the views small_rows_at wrote at ``data`` (UNIT_SLOTS), its
    units claimed from the shared counter there: what every thread of torch's team
    runs. A unit's rows, keys and sums are those of one call over all: the same bits
    whatever the thread count."""
    a = numba.carray(data, (UNIT_SLOTS,), np.int64)
    N, A, R, D, S, Dv = a[1], a[2], a[3], a[4], a[5], a[6]
    qv = view_at(a[7], (N, A, R, D), (a[8], a[9], a[10], a[11]), f32(0.0))
    kv = view_at(a[12], (N, A, S, D), (a[13], a[14], a[15], a[16]), f32(0.0))
    vv = view_at(a[17], (N, A, S, Dv), (a[18], a[19], a[20], a[21]), f32(0.0))
    ov = c_view_at(a[22], (N, A, R, Dv), (A * R * Dv, R * Dv, Dv, 1), f32(0.0))
    nl = R if a[23] else 0
    lv = c_view_at(a[23], (N, A, nl), (A * nl, nl, 1), f32(0.0))
    w, ws = a[26], a[31]
    lo, hi = view_at(a[24], (N, w), (w, 1), np.int64(0)), view_at(a[25], (N, w), (w, 1), np.int64(0))
    scale, softcap = np.int32(a[27]).view(np.float32), np.int32(a[28]).view(np.float32)
    m0, l0 = c_view_at(a[29], (N, ws), (ws, 1), f32(0.0)), c_view_at(a[30], (N, ws), (ws, 1), f32(0.0))
    small_rows(qv, kv, vv, scale, softcap, lo, hi, m0, l0, ov, lv, numba.carray(_pointer(a[0]), (2,), np.int64))


@numba.njit(inline="always")
def _readable(out_shape, q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, out_strides):
    """Whether :func:`small_rows_at` reads operands of these shapes and strides: one
    stride through the batch dims each, rows of unit stride."""
    nd, D, Dv = len(out_shape), q_shape[len(q_shape) - 1], out_shape[len(out_shape) - 1]
    return (D == 1 or q_strides[len(q_strides) - 1] == 1) and (D == 1 or k_strides[len(k_strides) - 1] == 1) \
        and (Dv == 1 or v_strides[len(v_strides) - 1] == 1) and (Dv == 1 or out_strides[nd - 1] == 1) \
        and min(_batch_stride(out_shape, q_shape, q_strides), _batch_stride(out_shape, k_shape, k_strides),
                _batch_stride(out_shape, v_shape, v_strides), _batch_stride(out_shape, out_shape, out_strides)) >= 0


@numba.njit(**ORDERED)
def small_rows_at(out_shape, A, S, q, q_shape, q_strides, k, k_shape, k_strides, v, v_shape, v_strides, out,
                  out_strides, lse, scale, softcap, lo, hi, sinks, sink_strides, team, threads, entry):
    """:func:`small_rows` on operands given by address (a tensor library's memory, no
    NumPy arrays to make): q (..., H, L, D), k (..., A, S, D), v (..., A, S, Dv) and out
    (..., H, L, Dv) at addresses q, k, v, out with their shapes and strides in elements
    (k's and v's shapes: their key length is S's), out_shape the call's; lse (..., H, L)
    C-ordered at address lse (0: not wanted); lo, hi: the addresses of the rows' key
    bounds (:func:`small_rows`' lo and hi, int64, C-ordered; 0: none); sinks: the address
    of float32 sink logits read at (batch element, head, row) strides ``sink_strides``
    (elements; 0: none), each row's state before its keys as
    :func:`attnkit.small._sink_state` makes it. Rows that no one
    stride steps through (heads inner in memory, several rows per head, a GQA group)
    are copied. With ``team`` (libgomp's GOMP_parallel, :func:`.runtime.native_team`,
    or 0) the (batch element, kv head) units run on that many ``threads`` of torch's
    team through ``entry`` (:func:`small_units`' address). 0 when done; 1, touching
    nothing, where a batch dim has no one stride or a row of q, k, v is not of unit
    stride; 2 where a unit on the team failed (an error inside the kernel: printed by
    its thread, and the call takes the full path)."""
    nd = len(out_shape)
    H, L, Dv, D = out_shape[nd - 3], out_shape[nd - 2], out_shape[nd - 1], q_shape[len(q_shape) - 1]
    G, N = H // A, 1
    for i in range(nd - 3):
        N *= out_shape[i]
    qn, kn = _batch_stride(out_shape, q_shape, q_strides), _batch_stride(out_shape, k_shape, k_strides)
    vn, on = _batch_stride(out_shape, v_shape, v_strides), _batch_stride(out_shape, out_shape, out_strides)
    if not _readable(out_shape, q_shape, q_strides, k_shape, k_strides, v_shape, v_strides, out_strides):
        return 1
    R = G * L
    step = _row_step(L, G, q_strides)
    if step:
        qv = view_at(q, (N, A, R, D), (qn, G * q_strides[len(q_strides) - 3], step, 1), f32(0.0))
    else:
        src, qv = _heads_at(q, N, A, G, L, D, qn, q_strides), np.empty((N, A, R, D), dtype=np.float32)
        for n in range(N):
            for a in range(A):
                for g in range(G):
                    for r in range(L):
                        copy_row(address(qv, (n, a, g * L + r, 0)), address(src, (n, a, g, r, 0)), D)
    kv = view_at(k, (N, A, S, D), (kn, k_strides[len(k_strides) - 3], k_strides[len(k_strides) - 2], 1), f32(0.0))
    vv = view_at(v, (N, A, S, Dv), (vn, v_strides[len(v_strides) - 3], v_strides[len(v_strides) - 2], 1), f32(0.0))
    dense = (N == 1 or on == A * R * Dv) and (H == 1 or out_strides[nd - 3] == L * Dv) \
        and (L == 1 or out_strides[nd - 2] == Dv)
    ov = c_view_at(out, (N, A, R, Dv), (A * R * Dv, R * Dv, Dv, 1), f32(0.0)) if dense \
        else np.empty((N, A, R, Dv), dtype=np.float32)
    lv = c_view_at(lse, (N, A, R), (A * R, R, 1), f32(0.0)) if lse else np.empty((N, A, 0), dtype=np.float32)
    w, ws = A * R if lo else 0, A * R if sinks else 0
    m0, l0 = np.empty((N, ws), dtype=np.float32), np.empty((N, ws), dtype=np.float32)
    if sinks:                                      # a sink: one more score, its exp in the sum
        sn, sh, sl = sink_strides
        sv = view_at(sinks, (N, A, G, L), (sn, G * sh, sh, sl), f32(0.0))
        for n in range(N):
            for a in range(A):
                for g in range(G):
                    for r in range(L):
                        x = sv[n, a, g, r]
                        m0[n, a * R + g * L + r] = x
                        l0[n, a * R + g * L + r] = np.exp(x - (f32(0.0) if x == -np.inf else x))   # +inf, NaN: NaN
    if team and threads > 1 and N * A > 1:
        block, counter = np.zeros(UNIT_SLOTS, dtype=np.int64), np.zeros(2, dtype=np.int64)
        block[0], block[1], block[2], block[3], block[4], block[5], block[6] = counter.ctypes.data, N, A, R, D, S, Dv
        i = _put_view(block, _put_view(block, _put_view(block, 7, qv), kv), vv)
        block[i], block[i + 1], block[i + 2], block[i + 3], block[i + 4] = ov.ctypes.data, lse, lo, hi, w
        block[i + 5], block[i + 6] = np.float32(scale).view(np.int32), np.float32(softcap).view(np.int32)
        block[i + 7], block[i + 8], block[i + 9] = m0.ctypes.data, l0.ctypes.data, ws
        _parallel_at(team)(_pointer(entry), _pointer(block.ctypes.data), np.uint32(min(threads, N * A)), np.uint32(0))
        # (every unit done: a thread's error — it prints and leaves — must not pass for
        # a result; and the arrays the threads read are used after them, so that they
        # live until then: numba frees an array after its last use)
        if counter[1] != N * A or block[0] != counter.ctypes.data or qv.size + ov.size + lv.size + m0.size < 0 \
                or l0.size < 0:
            return 2
    else:
        small_rows(qv, kv, vv, scale, softcap, view_at(lo, (N, w), (w, 1), np.int64(0)),
                   view_at(hi, (N, w), (w, 1), np.int64(0)), m0, l0, ov, lv, np.zeros(2, dtype=np.int64))
    if not dense:
        dst = _heads_at(out, N, A, G, L, Dv, on, out_strides)
        for n in range(N):
            for a in range(A):
                for g in range(G):
                    for r in range(L):
                        copy_row(address(dst, (n, a, g, r, 0)), address(ov, (n, a, g * L + r, 0)), Dv)
    return 0


@numba.njit(inline="always")
def _span(addr, shape, strides):
    """[first, last) bytes that a float32 array at addr of shape and strides (elements,
    any sign) spans."""
    lo, hi = addr, addr + 4
    for i in range(len(shape)):
        step = (shape[i] - 1) * strides[i] * 4
        if step < 0:
            lo += step
        else:
            hi += step
    return lo, hi


@numba.njit(inline="always")
def _copy_used(pages, table, n, P):
    """The entries of ``table`` (B, width) that sequences of n keys use (pages of P keys)
    into ``pages``, as int64."""
    for b in range(table.shape[0]):
        for j in range((n[b] + P - 1) // P):
            pages[b, j] = table[b, j]


@numba.njit(**ORDERED)
def _table_rows(table, t_kind, t_strides, B, width, n, L_new, N, P):
    """The pages (B, width) int64 of a block table at address ``table`` (``t_kind`` 8:
    int64, 4: int32; strides in elements) that sequences of n keys use (the entries
    past them are never read: 0), or an empty array where a used entry lies outside
    [0, N) or the append (L_new > 0) writes into a page that another used entry holds
    too (a page sequences share: the full path's rule, :func:`attnkit.spec.kvcache._check_writes`)."""
    pages = np.zeros((B, width), dtype=np.int64)
    if t_kind == 8:
        _copy_used(pages, view_at(table, (B, width), t_strides, np.int64(0)), n, P)
    else:
        _copy_used(pages, view_at(table, (B, width), t_strides, np.int32(0)), n, P)
    used = 0
    for b in range(B):
        for j in range((n[b] + P - 1) // P):
            if pages[b, j] < 0 or pages[b, j] >= N:
                return np.zeros((0, 0), dtype=np.int64)
            used += 1
    if L_new:                                      # a written page held by one used entry only
        held, u = np.empty(used, dtype=np.int64), 0
        for b in range(B):
            for j in range((n[b] + P - 1) // P):
                held[u], u = pages[b, j], u + 1
        held.sort()
        for b in range(B):
            for j in range((n[b] - L_new) // P, (n[b] + P - 1) // P):
                if np.searchsorted(held, pages[b, j], "right") - np.searchsorted(held, pages[b, j]) != 1:
                    return np.zeros((0, 0), dtype=np.int64)
    return pages


@numba.njit(**ORDERED)
def kvcache_rows_at(out_shape, A, S, q, q_shape, q_strides, k, k_shape, k_strides, v, v_shape, v_strides, out,
                    out_strides, lse, scale, softcap, rel_lo, rel_hi, sinks, sink_strides, team, threads, entry,
                    lengths, kind, step, shift, L_new, k_new, kn_strides, v_new, vn_strides, table, t_kind,
                    t_strides, N, P, scratch):
    """attention_kvcache's call on a contiguous cache k (B, A, S, D), v (B, A, S, Dv)
    at addresses, the append included: sequence b holds lengths[b] keys (``kind`` 8:
    int64 at address ``lengths``, ``step`` elements apart; 4: int32; 0: ``lengths``
    itself, every sequence's); its L_new new keys and values (B, A, L_new, D[v]) at
    addresses k_new and v_new (strides kn_strides, vn_strides, elements) are written to
    its slots lengths[b] …, then q attends to the lengths[b] + L_new keys by
    :func:`small_rows_at`, the rest of whose arguments these are: query row i of
    sequence b (of L) sees keys [lo, hi) with lo = max(0, shift·n + rel_lo[i]), hi =
    max(lo, min(n, shift·n + rel_hi[i])), n its keys (the band's bounds move with n where
    the rows align bottom-right, shift 1; rel_lo, rel_hi: the addresses of int64 (L,),
    :func:`attnkit.small.kvcache_at` makes them). With ``t_kind`` (8: int64, 4: int32; 0:
    a contiguous cache) the cache is paged: k (N, A, P, D), v (N, A, P, Dv) at k_strides,
    v_strides, sequence b's key s in page table[b, s // P] (a block table (B, S / P) at
    address ``table``, strides ``t_strides``), slot s % P; each sequence's keys are
    gathered (:func:`_table_rows`) into ``scratch`` (float32, 1-D; a new array where it
    holds fewer than B·A·S·(D + Dv) elements) and attended as a contiguous cache's (the
    full path gathers them too). Returns small_rows_at's status, or 3 touching nothing where a
    length is negative or leaves no room for the new keys or a page is one the full
    path refuses or checks further (:func:`_table_rows`), or 1 where an operand's
    layout is not one it reads, the new keys or values lie in a cache's memory or the
    caches overlap but for being one (the full path then checks or runs the call); 2
    (a unit on torch's team failed) comes after the append."""
    B, H, L, D, Dv = out_shape[0], out_shape[1], out_shape[2], q_shape[3], out_shape[3]
    n = np.empty(B, dtype=np.int64)
    for b in range(B):
        if kind == 8:
            x = view_at(lengths, (B,), (step,), np.int64(0))[b]
        elif kind == 4:
            x = np.int64(view_at(lengths, (B,), (step,), np.int32(0))[b])
        else:
            x = np.int64(lengths)
        if x < 0 or x > S - L_new:
            return 3
        n[b] = x + L_new
    kept_k, kept_v = (B, A, S, D), (B, A, S, Dv)   # the caches' shapes, or (paged) their pages'
    pages = np.zeros((0, 0), dtype=np.int64)
    if t_kind:
        kept_k, kept_v = (N, A, P, D), (N, A, P, Dv)
        pages = _table_rows(table, t_kind, t_strides, B, S // P, n, L_new, N, P)
        if pages.size == 0 and B * S > 0:
            return 3
    # what small_rows_at reads: the caches, or (paged) the keys gathered into (B, A, S, D[v])
    # in the caller's scratch (kept between calls: a new array of megabytes is paged in
    # afresh at every call, 772 against 87 µs a step at 0.5M elements)
    nk, nv = (B * A * S * D, B * A * S * Dv) if t_kind else (0, 0)
    fresh = np.empty(0 if scratch.size >= nk + nv else nk + nv, dtype=np.float32)
    rk, rk_strides, rv, rv_strides = k, k_strides, v, v_strides
    if t_kind:
        rk = np.int64(scratch.ctypes.data if fresh.size == 0 else fresh.ctypes.data)
        rv = rk + 4 * nk
        rk_strides, rv_strides = (A * S * D, S * D, D, np.int64(1)), (A * S * Dv, S * Dv, Dv, np.int64(1))
    if not _readable(out_shape, q_shape, q_strides, k_shape, rk_strides, v_shape, rv_strides, out_strides) or (
            L_new and ((D > 1 and kn_strides[3] != 1) or (Dv > 1 and vn_strides[3] != 1))) or (
            t_kind and ((D > 1 and k_strides[3] != 1) or (Dv > 1 and v_strides[3] != 1))):
        return 1
    kc, vc = view_at(k, kept_k, k_strides, f32(0.0)), view_at(v, kept_v, v_strides, f32(0.0))
    if L_new:                                      # new keys in the caches' memory: written row by row,
        spans = (_span(k_new, (B, A, L_new, D), kn_strides), _span(v_new, (B, A, L_new, Dv), vn_strides))
        caches = (_span(k, kept_k, k_strides), _span(v, kept_v, v_strides))
        for c0, c1 in caches:                      # they would be read after a write (the full path
            for n0, n1 in spans:                   # copies them first)
                if n0 < c1 and c0 < n1:
                    return 1
        if caches[0][0] < caches[1][1] and caches[1][0] < caches[0][1] and not (k == v and D == Dv and
                                                                              k_strides == v_strides):
            return 1                               # (caches that overlap but not in place: the full path
                                                   # writes every key before any value, this key by key)
        kn, vn = view_at(k_new, (B, A, L_new, D), kn_strides, f32(0.0)), \
            view_at(v_new, (B, A, L_new, Dv), vn_strides, f32(0.0))
        for b in range(B):
            for a in range(A):
                for t in range(L_new):
                    s = n[b] - L_new + t
                    row, slot = (pages[b, s // P], s % P) if t_kind else (b, s)
                    copy_row(address(kc, (row, a, slot, 0)), address(kn, (b, a, t, 0)), D)
                    copy_row(address(vc, (row, a, slot, 0)), address(vn, (b, a, t, 0)), Dv)
    if t_kind:                                     # each sequence's pages in use, in its order
        gk, gv = view_at(rk, (B, A, S, D), rk_strides, f32(0.0)), view_at(rv, (B, A, S, Dv), rv_strides, f32(0.0))
        for b in range(B):
            for j in range((n[b] + P - 1) // P):
                for a in range(A):
                    for s in range(P):
                        copy_row(address(gk, (b, a, j * P + s, 0)), address(kc, (pages[b, j], a, s, 0)), D)
                        copy_row(address(gv, (b, a, j * P + s, 0)), address(vc, (pages[b, j], a, s, 0)), Dv)
    rlo, rhi = view_at(rel_lo, (L,), (1,), np.int64(0)), view_at(rel_hi, (L,), (1,), np.int64(0))
    lo, hi = np.empty((B, H * L), dtype=np.int64), np.empty((B, H * L), dtype=np.int64)
    for b in range(B):
        for i in range(L):
            first = max(np.int64(0), shift * n[b] + rlo[i])
            last = max(first, min(n[b], shift * n[b] + rhi[i]))
            for h in range(H):
                lo[b, h * L + i], hi[b, h * L + i] = first, last
    done = small_rows_at(out_shape, A, S, q, q_shape, q_strides, rk, k_shape, rk_strides, rv, v_shape, rv_strides,
                         out, out_strides, lse, scale, softcap, lo.ctypes.data, hi.ctypes.data, sinks,
                         sink_strides, team, threads, entry)
    # (the bounds and the gathered keys live until small_rows_at is done)
    return done if lo.size + hi.size + fresh.size + scratch.size >= 0 else 2
