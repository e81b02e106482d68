"""The backward kernels, from the given out and lse (FlashAttention-2 structure)::

    _bwd_preprocess  delta = rowsum(dout ∘ out) per query row
    _attn_bwd_dkdv   one program per (key block, batch element or sequence · kv head):
                     loops over the query heads of its GQA group and over query
                     blocks, writes dk, dv
    _attn_bwd_dq     one program per (query block, batch element or sequence · head):
                     loops over key blocks, writes dq and, when asked, dS (the
                     gradient of the final scores, which is dbias)

Weights are recomputed as exp(scores − lse), 0 wherever the score is −inf (even when
lse is NaN), and the score gradient is masked to 0 there, so excluded pairs give
exactly 0 to dq, dk, dv and dbias. Dropout's mask is regenerated from the same
Philox counters as the forward's.
"""

from .device import (
    LOG2E,
    _bound,
    _cast,
    _dropout_scale,
    _exempt,
    _finite_skip,
    _key_range,
    _mask_tiles,
    _mm,
    _mm_lowp,
    _nan_through,
    _query_range,
    _rng,
    _sequence,
    _sum_combine,
    _tile_scores,
    _weights,
)
from .jit import constexpr, tl

JIT = ("_bwd_preprocess", "_dkdv_inner", "_attn_bwd_dkdv", "_dq_inner", "_attn_bwd_dq")


def _bwd_preprocess(out_op, do_op, delta_op, H, L, HEAD_DV: constexpr, BLOCK_M: constexpr, BLOCK_DV: constexpr):
    """delta = rowsum(dout ∘ out) in float32: the softmax Jacobian term Σ_j w·dw."""
    Out, stride_ob, stride_oh, stride_om, stride_od = out_op
    DO, stride_dob, stride_doh, stride_dom, stride_dod = do_op
    Delta, stride_lb, stride_lh, stride_lm = delta_op
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < L) & (offs_dv[None, :] < HEAD_DV)
    o = tl.load(Out + off_b * stride_ob + off_h * stride_oh
                + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod, mask=mask, other=0.0)
    delta = tl.reduce(o.to(tl.float32) * do.to(tl.float32), 1, _sum_combine)
    tl.store(Delta + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, delta,
             mask=offs_m < L)


def _dkdv_inner(dk, dv, k, v, q_tile, do_tile, lse_ptr, delta_ptr, stride_lm, cols, offs_d, offs_dv,
                geo, masks, scal, rng, start, end,
                HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_M: constexpr, INDEX_MASK: constexpr,
                HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
                HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr, HAS_DROPOUT: constexpr,
                HAS_KSTART: constexpr, CAREFUL: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
                PRECISION: constexpr):
    """dk, dv of one key block from query tiles [start, end), in (keys, rows) layout."""
    q_ptr, stride_qm, stride_qd = q_tile
    do_ptr, stride_dom, stride_dod = do_tile
    Lq = geo[0]
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < Lq
        qT = tl.load(q_ptr + rows[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        qkT = _mm(k, qT, None, INTERPRET, PRECISION)
        sT, tT = _tile_scores(qkT, rows[None, :], cols[:, None], geo, masks, scal, INDEX_MASK, HAS_LEFT,
                              HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, HAS_ALIBI, HAS_KSTART)
        lse = tl.load(lse_ptr + rows * stride_lm, mask=row_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # lse -inf: weights 0
        visT = sT != float("-inf")
        pT = _weights(sT, lse2[None, :], visT)       # weights = exp(scores - lse); 0 if excluded
        do = tl.load(do_ptr + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        if HAS_DROPOUT:
            zT = _dropout_scale(rows[None, :], cols[:, None], rng)
            pzT = pT * zT                           # out = dropout(weights) v
        else:
            pzT = pT
        if CAREFUL:                                 # some dout is not finite: excluded pairs never read it
            do_c, bad = _exempt(do, INTERPRET)
            dv = _nan_through(_mm_lowp(pzT, do_c, dv, SPLIT, INTERPRET, PRECISION), visT, bad, INTERPRET,
                              PRECISION)
        else:
            dv = _mm_lowp(pzT, do, dv, SPLIT, INTERPRET, PRECISION)
        Di = tl.load(delta_ptr + rows * stride_lm, mask=row_ok, other=0.0)
        dpT = _mm(v, tl.trans(do), None, INTERPRET, PRECISION)
        if HAS_DROPOUT:
            dpT = dpT * zT
        dsT = tl.where(visT, pT * (dpT - Di[None, :]), 0.0)   # softmax Jacobian: w ∘ (dw - Σ w·dw)
        if HAS_SOFTCAP:
            # d/dx c·tanh(x/c) = 1 - tanh², inside the mask: an excluded pair's tanh may be
            # NaN (inf · 0 from an infinite q or k entry, or a tile's zero padding)
            dsT = tl.where(visT, dsT * (1.0 - tT * tT), 0.0)
        if CAREFUL:
            qT_c, badT = _exempt(qT, INTERPRET)
            dk = _nan_through(_mm_lowp(dsT, tl.trans(qT_c), dk, SPLIT, INTERPRET, PRECISION), visT,
                              tl.trans(badT), INTERPRET, PRECISION)
        else:
            dk = _mm_lowp(dsT, tl.trans(qT), dk, SPLIT, INTERPRET, PRECISION)
    return dk, dv


def _attn_bwd_dkdv(q_op, k_op, v_op, do_op, lse_op, Delta, dk_op, dv_op, keep_op, drop_op, bias_op, slopes_op,
                   qlen_op, klen_op, kstart_op, CuQ, CuK, Finite, HKV, L, S, N0, SEQ0,
                   sm_scale, softcap, OFFSET, ROW0, COL0, LEFT, RIGHT, seed_lo, seed_hi, drop_threshold, drop_scale,
                   GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
                   BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
                   HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
                   HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr,
                   HAS_DROPOUT: constexpr, HAS_QLEN: constexpr, HAS_KLEN: constexpr, HAS_KSTART: constexpr,
                   PACKED: constexpr, BOTTOM_RIGHT: constexpr, CAREFUL: constexpr, SPLIT: constexpr,
                   INTERPRET: constexpr, PRECISION: constexpr):
    """dk, dv for one key block of one (batch element or sequence, kv head), summed
    over its GQA group. Each ``*_op`` is a tensor's (pointer, strides) (``launch.op``)."""
    Q, stride_qb, stride_qh, stride_qm, stride_qd = q_op
    K, stride_kb, stride_kh, stride_kn, stride_kd = k_op
    V, stride_vb, stride_vh, stride_vn, stride_vd = v_op
    DO, stride_dob, stride_doh, stride_dom, stride_dod = do_op
    Lse, stride_lb, stride_lh, stride_lm = lse_op   # Delta has lse's strides
    DK, stride_dkb, stride_dkh, stride_dkn, stride_dkd = dk_op
    DV, stride_dvb, stride_dvh, stride_dvn, stride_dvd = dv_op
    Keep, stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n = keep_op
    Drop, stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n = drop_op
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n = bias_op
    Slopes, stride_slope_b, stride_slope_h = slopes_op
    QLen, stride_qlen = qlen_op
    KLen, stride_klen = klen_op
    KStart, stride_kstart = kstart_op
    if _finite_skip(Finite, CAREFUL):
        return
    start_n = tl.program_id(0)
    off_b, off_hk, q0, k0, Lq, Lk, offset, ks = _sequence(
        tl.program_id(1), HKV, L, S, OFFSET, (ROW0, COL0),
        ((QLen, stride_qlen), (KLen, stride_klen), (KStart, stride_kstart)), (CuQ, CuK), SEQ0,
        HAS_QLEN, HAS_KLEN, HAS_KSTART, PACKED, BOTTOM_RIGHT)
    c0 = start_n * BLOCK_N
    if PACKED:
        if c0 >= Lk:                                # a shorter sequence than the grid's longest
            return
    cols = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < Lk
    if HAS_KSTART:
        col_ok = col_ok & (cols >= ks)              # the sequence's keys start at ks
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh + k0 * stride_kn
                + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh + k0 * stride_vn
                + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    geo = (Lq, Lk, offset, LEFT, RIGHT, ks)
    lo, mid_lo, mid_hi, hi = _query_range(c0, geo, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_KSTART)
    for g in range(GROUP):                          # the query heads sharing this kv head, in order
        off_h = off_hk * GROUP + g
        q_tile = (Q + off_b * stride_qb + off_h * stride_qh + q0 * stride_qm, stride_qm, stride_qd)
        do_tile = (DO + off_b * stride_dob + off_h * stride_doh + q0 * stride_dom, stride_dom, stride_dod)
        lse_ptr = Lse + off_b * stride_lb + off_h * stride_lh + q0 * stride_lm
        delta_ptr = Delta + off_b * stride_lb + off_h * stride_lh + q0 * stride_lm
        masks = _mask_tiles(Keep, Drop, Bias, (stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n),
                            (stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n),
                            (stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n), off_b, off_h, q0, k0)
        slope = sm_scale * 0.0
        if HAS_ALIBI:
            slope = tl.load(Slopes + off_b * stride_slope_b + off_h * stride_slope_h) * LOG2E
        scal = (sm_scale, softcap, slope)
        rng = _rng(seed_lo, seed_hi, drop_threshold, drop_scale, (N0 + off_b) * (HKV * GROUP) + off_h,
                   q0 + ROW0, k0 + COL0)     # dropout counts global rows and keys
        for part in tl.static_range(3):             # edge tiles, tiles inside the band, edge tiles
            start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
            end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_tile, do_tile, lse_ptr, delta_ptr, stride_lm, cols, offs_d,
                                 offs_dv, geo, masks, scal, rng, start, end, HEAD_D, HEAD_DV, BLOCK_M,
                                 part != 1, HAS_LEFT, HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP,
                                 HAS_ALIBI, HAS_DROPOUT, HAS_KSTART, CAREFUL, SPLIT, INTERPRET, PRECISION)
    dk = dk * sm_scale                              # scores = scale · q kᵀ
    keys = cols < S                                 # dense: keys outside [kv_starts[b], kv_lengths[b]) get zeros
    if HAS_KLEN or HAS_KSTART:
        dk = tl.where(col_ok[:, None], dk, 0.0)
        dv = tl.where(col_ok[:, None], dv, 0.0)
    if PACKED:
        keys = col_ok                               # packed: the next keys are the next sequence's
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh + k0 * stride_dkn
             + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             _cast(dk, DK.dtype.element_ty, INTERPRET), mask=keys[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh + k0 * stride_dvn
             + cols[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             _cast(dv, DV.dtype.element_ty, INTERPRET), mask=keys[:, None] & (offs_dv[None, :] < HEAD_DV))


def _dq_inner(dq, q, do, lse2, Di, k_tile, v_tile, ds_tile, offs_m, offs_d, offs_dv, geo, masks, scal, rng,
              start, end,
              HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_N: constexpr, INDEX_MASK: constexpr,
              HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
              HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr, HAS_DROPOUT: constexpr,
              HAS_KSTART: constexpr, WRITE_DS: constexpr, CAREFUL: constexpr, SPLIT: constexpr,
              INTERPRET: constexpr, PRECISION: constexpr):
    """dq of one query block from key tiles [start, end); writes dS tiles if asked."""
    k_ptr, stride_kn, stride_kd = k_tile
    v_ptr, stride_vn, stride_vd = v_tile
    ds_ptr, stride_ds_m, stride_ds_n = ds_tile
    Lq = geo[0]
    Lk = geo[1]
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < Lk
        kT = tl.load(k_ptr + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        vT = tl.load(v_ptr + cols[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=col_ok[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)
        qk = _mm(q, kT, None, INTERPRET, PRECISION)
        s, t = _tile_scores(qk, offs_m[:, None], cols[None, :], geo, masks, scal, INDEX_MASK, HAS_LEFT,
                            HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, HAS_ALIBI, HAS_KSTART)
        vis = s != float("-inf")
        p = _weights(s, lse2[:, None], vis)         # weights = exp(scores - lse)
        dp = _mm(do, vT, None, INTERPRET, PRECISION)
        if HAS_DROPOUT:
            dp = dp * _dropout_scale(offs_m[:, None], cols[None, :], rng)
        ds = tl.where(vis, p * (dp - Di[:, None]), 0.0)      # gradient of the final scores (= dbias)
        if WRITE_DS:
            tl.store(ds_ptr + offs_m[:, None] * stride_ds_m + cols[None, :] * stride_ds_n,
                     _cast(ds, ds_ptr.dtype.element_ty, INTERPRET),
                     mask=(offs_m[:, None] < Lq) & col_ok[None, :])
        if HAS_SOFTCAP:
            ds = tl.where(vis, ds * (1.0 - t * t), 0.0)      # (inside the mask, as in _dkdv_inner)
        if CAREFUL:                                 # some k is not finite: excluded keys never read it
            kT_c, badT = _exempt(kT, INTERPRET)
            dq = _nan_through(_mm_lowp(ds, tl.trans(kT_c), dq, SPLIT, INTERPRET, PRECISION), vis,
                              tl.trans(badT), INTERPRET, PRECISION)
        else:
            dq = _mm_lowp(ds, tl.trans(kT), dq, SPLIT, INTERPRET, PRECISION)
    return dq


def _attn_bwd_dq(q_op, k_op, v_op, do_op, lse_op, Delta, dq_op, ds_op, keep_op, drop_op, bias_op, slopes_op,
                 qlen_op, klen_op, kstart_op, CuQ, CuK, Finite, H, L, S, N0, SEQ0,
                 sm_scale, softcap, OFFSET, ROW0, COL0, LEFT, RIGHT, seed_lo, seed_hi, drop_threshold, drop_scale,
                 GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
                 BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
                 HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
                 HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr,
                 HAS_DROPOUT: constexpr, HAS_QLEN: constexpr, HAS_KLEN: constexpr, HAS_KSTART: constexpr,
                 PACKED: constexpr, BOTTOM_RIGHT: constexpr, WRITE_DS: constexpr, CAREFUL: constexpr, SPLIT: constexpr,
                 INTERPRET: constexpr, PRECISION: constexpr):
    """dq (and dS) for one query block of one (batch element or sequence, head). Each
    ``*_op`` is a tensor's (pointer, strides) (``launch.op``)."""
    Q, stride_qb, stride_qh, stride_qm, stride_qd = q_op
    K, stride_kb, stride_kh, stride_kn, stride_kd = k_op
    V, stride_vb, stride_vh, stride_vn, stride_vd = v_op
    DO, stride_dob, stride_doh, stride_dom, stride_dod = do_op
    Lse, stride_lb, stride_lh, stride_lm = lse_op   # Delta has lse's strides
    DQ, stride_dqb, stride_dqh, stride_dqm, stride_dqd = dq_op
    DS, stride_ds_b, stride_ds_h, stride_ds_m, stride_ds_n = ds_op
    Keep, stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n = keep_op
    Drop, stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n = drop_op
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n = bias_op
    Slopes, stride_slope_b, stride_slope_h = slopes_op
    QLen, stride_qlen = qlen_op
    KLen, stride_klen = klen_op
    KStart, stride_kstart = kstart_op
    if _finite_skip(Finite, CAREFUL):
        return
    start_m = tl.program_id(0)
    off_b, off_h, q0, k0, Lq, Lk, offset, ks = _sequence(
        tl.program_id(1), H, L, S, OFFSET, (ROW0, COL0),
        ((QLen, stride_qlen), (KLen, stride_klen), (KStart, stride_kstart)), (CuQ, CuK), SEQ0,
        HAS_QLEN, HAS_KLEN, HAS_KSTART, PACKED, BOTTOM_RIGHT)
    r0 = start_m * BLOCK_M
    if PACKED:
        if r0 >= Lq:                                # a shorter sequence than the grid's longest
            return
    off_hk = off_h // GROUP
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + q0 * stride_qm
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + q0 * stride_dom
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + (q0 + offs_m) * stride_lm,
                  mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)  # lse -inf: weights 0
    Di = tl.load(Delta + off_b * stride_lb + off_h * stride_lh + (q0 + offs_m) * stride_lm,
                 mask=row_ok, other=0.0)
    k_tile = (K + off_b * stride_kb + off_hk * stride_kh + k0 * stride_kn, stride_kn, stride_kd)
    v_tile = (V + off_b * stride_vb + off_hk * stride_vh + k0 * stride_vn, stride_vn, stride_vd)
    ds_tile = (DS + off_b * stride_ds_b + off_h * stride_ds_h + q0 * stride_ds_m + k0 * stride_ds_n,
               stride_ds_m, stride_ds_n)
    masks = _mask_tiles(Keep, Drop, Bias, (stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n),
                        (stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n),
                        (stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n), off_b, off_h, q0, k0)
    geo = (Lq, Lk, offset, LEFT, RIGHT, ks)
    slope = sm_scale * 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + off_b * stride_slope_b + off_h * stride_slope_h) * LOG2E
    scal = (sm_scale, softcap, slope)
    rng = _rng(seed_lo, seed_hi, drop_threshold, drop_scale, (N0 + off_b) * H + off_h, q0 + ROW0, k0 + COL0)
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(r0, geo, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_KSTART)
    for part in tl.static_range(3):                 # edge tiles, tiles inside the band, edge tiles
        start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
        end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
        dq = _dq_inner(dq, q, do, lse2, Di, k_tile, v_tile, ds_tile, offs_m, offs_d, offs_dv, geo, masks, scal,
                       rng, start, end, HEAD_D, HEAD_DV, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT, HAS_KEEP,
                       HAS_DROP, HAS_BIAS, HAS_SOFTCAP, HAS_ALIBI, HAS_DROPOUT, HAS_KSTART, WRITE_DS, CAREFUL,
                       SPLIT, INTERPRET, PRECISION)
    dq = dq * sm_scale                              # scores = scale · q kᵀ
    rows = offs_m < L                               # dense: padding rows get zeros
    if HAS_QLEN:
        dq = tl.where(row_ok[:, None], dq, 0.0)
    if PACKED:
        rows = row_ok                               # packed: the next rows are the next sequence's
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh + q0 * stride_dqm
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             _cast(dq, DQ.dtype.element_ty, INTERPRET), mask=rows[:, None] & (offs_d[None, :] < HEAD_D))
