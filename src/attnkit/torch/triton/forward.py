"""The forward kernel: one program per (query block, batch element or sequence · head),
online softmax over key tiles (FlashAttention-2; names from the paper: m_i, l_i, acc,
BLOCK_M, BLOCK_N). Writes out (q's dtype) and lse (float32, natural log).

Fully masked rows give out 0 and lse -inf without NaN: while a row has seen only -inf
scores the running max uses a finite stand-in (0). The sink joins after the last
tile as one more logit with value 0 (denominator only). Padding rows (i >=
q_lengths[b]) are written as out 0, lse -inf, sink or not.
"""

from .device import (
    LOG2E,
    _bound,
    _cast,
    _dropout_scale,
    _exempt,
    _finish,
    _finite_skip,
    _join_sink,
    _key_range,
    _mask_tiles,
    _mm,
    _mm_lowp,
    _nan_through,
    _online_softmax,
    _rng,
    _sequence,
    _tile_scores,
)
from .jit import constexpr, tl

JIT = ("_fwd_inner", "_attn_fwd")


def _fwd_inner(acc, l_i, m_i, q, k_tile, v_tile, offs_m, offs_d, offs_dv, geo, masks, scal, rng, start, end,
               HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_N: constexpr, INDEX_MASK: constexpr,
               HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
               HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr, HAS_DROPOUT: constexpr,
               HAS_KSTART: constexpr, CAREFUL: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
               PRECISION: constexpr):
    """Online softmax over key tiles [start, end) (local keys of the sequence)."""
    k_ptr, stride_kn, stride_kd = k_tile
    v_ptr, stride_vn, stride_vd = v_tile
    Lk = geo[1]
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_N):
        cols = start_n + offs_n
        kT = tl.load(k_ptr + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=(cols[None, :] < Lk) & (offs_d[:, None] < HEAD_D), other=0.0)
        qk = _mm(q, kT, None, INTERPRET, PRECISION)
        s, _ = _tile_scores(qk, offs_m[:, None], cols[None, :], geo, masks, scal, INDEX_MASK, HAS_LEFT,
                            HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, HAS_ALIBI, HAS_KSTART)
        p, alpha, m_new, l_i = _online_softmax(s, m_i, l_i)   # l_i: normalised before dropout
        if HAS_DROPOUT:
            p = p * _dropout_scale(offs_m[:, None], cols[None, :], rng)
        v = tl.load(v_ptr + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=(cols[:, None] < Lk) & (offs_dv[None, :] < HEAD_DV), other=0.0)
        acc = acc * alpha[:, None]
        if CAREFUL:                                   # some v is not finite: excluded keys never read it
            v, bad = _exempt(v, INTERPRET)
            acc = _nan_through(_mm_lowp(p, v, acc, SPLIT, INTERPRET, PRECISION), s != float("-inf"), bad,
                               INTERPRET, PRECISION)
        else:
            acc = _mm_lowp(p, v, acc, SPLIT, INTERPRET, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _attn_fwd(q_op, k_op, v_op, out_op, lse_op, keep_op, drop_op, bias_op, slopes_op, sinks_op, qlen_op, klen_op,
              kstart_op, CuQ, CuK, Finite, H, L, S, N0, SEQ0, sm_scale, softcap, OFFSET, ROW0, COL0, LEFT, RIGHT,
              seed_lo, seed_hi, drop_threshold, drop_scale,
              GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
              BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
              HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr,
              HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr, HAS_SINKS: constexpr,
              HAS_DROPOUT: constexpr, HAS_QLEN: constexpr, HAS_KLEN: constexpr, HAS_KSTART: constexpr,
              PACKED: constexpr, BOTTOM_RIGHT: constexpr, CAREFUL: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
              PRECISION: constexpr):
    """out and lse for one query block of one (batch element or sequence, head). Each
    ``*_op`` is a tensor's (pointer, strides) (``launch.op``)."""
    Q, stride_qb, stride_qh, stride_qm, stride_qd = q_op
    K, stride_kb, stride_kh, stride_kn, stride_kd = k_op
    V, stride_vb, stride_vh, stride_vn, stride_vd = v_op
    Out, stride_ob, stride_oh, stride_om, stride_od = out_op
    Lse, stride_lb, stride_lh, stride_lm = lse_op
    Keep, stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n = keep_op
    Drop, stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n = drop_op
    Bias, stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n = bias_op
    Slopes, stride_slope_b, stride_slope_h = slopes_op
    Sinks, stride_sink_b, stride_sink_h, stride_sink_m = sinks_op
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
    off_hk = off_h // GROUP                         # GQA: head h reads kv head h // group
    offs_m = r0 + tl.arange(0, BLOCK_M)             # rows of the sequence (local)
    offs_d = tl.arange(0, BLOCK_D)                  # head dims padded to a power of two
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Lq
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh + q0 * stride_qm       # 64-bit base offsets
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    k_tile = (K + off_b * stride_kb + off_hk * stride_kh + k0 * stride_kn, stride_kn, stride_kd)
    v_tile = (V + off_b * stride_vb + off_hk * stride_vh + k0 * stride_vn, stride_vn, stride_vd)
    masks = _mask_tiles(Keep, Drop, Bias, (stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n),
                        (stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n),
                        (stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n), off_b, off_h, q0, k0)
    geo = (Lq, Lk, offset, LEFT, RIGHT, ks)
    slope = sm_scale * 0.0
    if HAS_ALIBI:
        slope = tl.load(Slopes + off_b * stride_slope_b + off_h * stride_slope_h) * LOG2E
    scal = (sm_scale, softcap, slope)
    rng = _rng(seed_lo, seed_hi, drop_threshold, drop_scale, (N0 + off_b) * H + off_h, q0 + ROW0, k0 + COL0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(r0, geo, BLOCK_M, BLOCK_N, HAS_LEFT, HAS_RIGHT, HAS_KSTART)
    for part in tl.static_range(3):                 # edge tiles, tiles inside the band, edge tiles
        start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
        end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_tile, v_tile, offs_m, offs_d, offs_dv, geo, masks,
                                   scal, rng, start, end, HEAD_D, HEAD_DV, BLOCK_N, part != 1, HAS_LEFT,
                                   HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, HAS_ALIBI,
                                   HAS_DROPOUT, HAS_KSTART, CAREFUL, SPLIT, INTERPRET, PRECISION)

    if HAS_SINKS:                                   # one more logit, value 0: the denominator only
        sink = tl.load(Sinks + off_b * stride_sink_b + off_h * stride_sink_h + (q0 + offs_m) * stride_sink_m,
                       mask=row_ok, other=float("-inf")) * LOG2E
        acc, l_i, m_i = _join_sink(acc, l_i, m_i, sink)
    out, lse = _finish(acc, l_i, m_i)               # fully masked rows (no sink): out 0, lse -inf
    if HAS_QLEN:                                    # padding rows: out 0 and lse -inf, sink or not
        out = tl.where(row_ok[:, None], out, 0.0)
        lse = tl.where(row_ok, lse, float("-inf"))
    rows = offs_m < L                               # dense: the padding rows are written too
    if PACKED:
        rows = row_ok                               # packed: the next rows are the next sequence's
    tl.store(Out + off_b * stride_ob + off_h * stride_oh + q0 * stride_om
             + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
             _cast(out, Out.dtype.element_ty, INTERPRET), mask=rows[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + (q0 + offs_m) * stride_lm, lse, mask=rows)
