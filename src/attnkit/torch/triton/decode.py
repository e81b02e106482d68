"""The KV-cache decoding kernels (split-KV, "Flash-Decoding")::

    _decode_split    one program per (row block, sequence · kv head, key split): the
                     query rows of the whole GQA group — its GROUP heads × L rows,
                     row r = i·GROUP + g, so a block holds consecutive query positions
                     — against one contiguous share of the sequence's visible keys,
                     each key and value tile read once for the group; writes the
                     split's partial (acc, m, l) in float32
    _decode_combine  one program per (sequence · kv head, row block): merges the
                     splits by their running max in split order (fixed, so the bits
                     do not depend on scheduling), joins the sink once, writes out
                     (q's dtype) and lse (float32, natural log)

The cache is contiguous, K (B, Hkv, S_max, D), or paged, K (num_pages, Hkv,
page_size, D) with a block table (B, max_pages): key position j of sequence b is
slot j % PAGE of page table[b, j // PAGE], gathered per key, so any page size works.
Keys at or past the sequence's length (read on the device) are never loaded, nor are
their block-table entries, nor keys before its first (``kv_starts``). Partial sums:
acc = Σ_j exp2(s_j − m) v_j (not normalised), m the split's running max of the scores
in log2 units (−inf when the split saw no visible key), l = Σ_j exp2(s_j − m).

The split of a sequence's keys is computed on the device from its length: the key
tiles the band leaves visible to the block's rows are dealt out in NUM_SPLITS
contiguous shares of whole tiles (NUM_SPLITS from the shapes alone, see
``tuning.decode_splits``), so a short sequence in a long cache still spreads over the
splits and every bit of the result is a function of the inputs.

The NaN rule: scores follow ``_tile_scores`` (NaN or inf in q or k at a visible key
makes the row NaN; excluded keys' scores are −inf). Values: a split's tiles are read
in three parts, edge tiles, tiles whose every key every row of the block can see, edge
tiles (only a window or a causal band with L > 1 leaves edge tiles, plus a causal
sequence's last partial tile). In edge tiles the non-finite entries are set to 0 before
the product p·v (0 · NaN must not reach a row that excludes the key), and only when
the tile has one, the rows that see such a key through a visible pair become NaN
(``_nan_through``). The middle tiles run unchecked: every row sees every key there, so
a non-finite value reaches its column of every row as NaN (p = 0 or a sum of ±inf) or
±inf, which the end of the split turns into NaN. One exception: an infinite q or k
entry can make a score −inf there, which excludes its key, and then 0 · NaN must not
reach the rows; middle tiles only flag such a score (elementwise), and a split that
saw one is computed again from its first tile with every tile checked. Finite caches
pay no check in the middle tiles, and no second launch or whole-cache reduction
anywhere. (An accumulator that overflows float32 from finite values becomes NaN there
too, where the reference's average stays finite: values near float32's limit only.)
"""

from .device import (
    LOG2E,
    _bound,
    _cast,
    _dropout_scale,
    _exempt,
    _finish,
    _join_sink,
    _max_combine,
    _mm,
    _mm_lowp,
    _nan_through,
    _online_softmax,
    _rng,
    _tile_scores,
)
from .jit import constexpr, tl

JIT = ("_cache_tile", "_query_length", "_decode_split", "_decode_combine")


def _cache_tile(C, Table, b, hk, cols, col_ok, offs, stride_p, stride_h, stride_n, stride_d, stride_tb, stride_tp,
                PAGE, HEAD: constexpr, KEYS_FIRST: constexpr, PAGED: constexpr):
    """The cache's tile of keys ``cols`` (1-D, masked by col_ok) and head dims ``offs``
    for sequence b, kv head hk: (keys, dims) when KEYS_FIRST, else (dims, keys)."""
    if PAGED:
        page = tl.load(Table + b * stride_tb + (cols // PAGE) * stride_tp, mask=col_ok, other=0).to(tl.int64)
        base = C + page * stride_p + hk * stride_h + (cols % PAGE) * stride_n   # gather: any page size
    else:
        base = C + b * stride_p + hk * stride_h + cols * stride_n
    if KEYS_FIRST:
        tile = tl.load(base[:, None] + offs[None, :] * stride_d, mask=col_ok[:, None] & (offs[None, :] < HEAD),
                       other=0.0)
    else:
        tile = tl.load(base[None, :] + offs[:, None] * stride_d, mask=col_ok[None, :] & (offs[:, None] < HEAD),
                       other=0.0)
    return tile                                     # one return: compiled Triton types every return alike


def _query_length(QLen, stride_qlen, b, L, HAS_QLENS: constexpr):
    """Sequence b's query rows: q_lengths[b] (rows past it are padding), else L."""
    Lq = L + b * 0
    if HAS_QLENS:
        Lq = tl.load(QLen + b * stride_qlen).to(Lq.dtype)
    return Lq


def _decode_split(q_op, k_op, v_op, table_op, lens_op, qlen_op, kstart_op, slopes_op, part_o_op, part_m_op, PartL,
                  HKV, L, BH, PAGE, NUM_SPLITS, sm_scale, softcap, LEFT, RIGHT,
                  seed_lo, seed_hi, drop_threshold, drop_scale,
                  GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
                  BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
                  HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr,
                  HAS_DROPOUT: constexpr, PAGED: constexpr, BOTTOM_RIGHT: constexpr, SPLIT: constexpr,
                  HAS_QLENS: constexpr, HAS_KSTART: constexpr, INTERPRET: constexpr, PRECISION: constexpr):
    """The partial (acc, m, l) of one key split for one block of a GQA group's rows.
    Each ``*_op`` is a tensor's (pointer, strides) (``launch.op``); PartL has PartM's."""
    Q, stride_qb, stride_qh, stride_qm, stride_qd = q_op
    K, stride_kp, stride_kh, stride_kn, stride_kd = k_op
    V, stride_vp, stride_vh, stride_vn, stride_vd = v_op
    Table, stride_tb, stride_tp = table_op
    Lens, stride_len = lens_op
    QLen, stride_qlen = qlen_op
    KStart, stride_kstart = kstart_op
    Slopes, stride_slope_b, stride_slope_h = slopes_op
    PartO, stride_pb, stride_ps, stride_pm, stride_pd = part_o_op
    PartM, stride_mb, stride_ms, stride_mm = part_m_op
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    bh = (pid // NUM_SPLITS) % BH                   # sequence · kv head
    rb = pid // NUM_SPLITS // BH                    # row block
    b = (bh // HKV).to(tl.int64)
    hk = (bh % HKV).to(tl.int64)
    M = GROUP * L                                   # the group's query rows
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < M
    i = r // GROUP                                  # query position (row r = i·GROUP + g)
    h = hk * GROUP + r % GROUP                      # query head
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * stride_qb + h[:, None] * stride_qh + i[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    Lk = tl.load(Lens + b * stride_len)             # the sequence's keys, on the device
    ks = Lk * 0                                     # and its first (kv_starts: left padding)
    if HAS_KSTART:
        ks = tl.load(KStart + b * stride_kstart).to(Lk.dtype)
    Lq = _query_length(QLen, stride_qlen, b, L, HAS_QLENS)   # its query rows (past them: padding)
    real = row_ok
    if HAS_QLENS:                                   # (without q_lengths every row is real: the same code)
        real = row_ok & (i < Lq)
    offset = pid * 0                                # diag(i) = i + offset (geometry.Segment)
    if HAS_KSTART:
        offset = ks                                 # top-left: the first query on the first key
    if BOTTOM_RIGHT:
        offset = Lk - Lq
    geo = (Lq, Lk, offset, LEFT, RIGHT, ks)
    masks = ((Q, 0, 0), (Q, 0, 0), (Q, 0, 0))      # no keep / drop / bias for a cache
    slope = sm_scale * 0.0
    if HAS_ALIBI:                                   # one slope per row's head, in log2 units
        slope = tl.load(Slopes + b * stride_slope_b + h * stride_slope_h, mask=row_ok, other=0.0)[:, None] * LOG2E
    scal = (sm_scale, softcap, slope)
    # dropout's counters: flat head n·H + h per row, query row i, key position j
    rng = _rng(seed_lo, seed_hi, drop_threshold, drop_scale, (b * HKV * GROUP + h)[:, None], 0, 0)

    # the keys the band can leave visible to rows i_lo … i_hi, in whole tiles, dealt out to the splits
    i_lo = (rb * BLOCK_M) // GROUP
    i_hi = (tl.minimum(rb * BLOCK_M + BLOCK_M, M) - 1) // GROUP
    lo = pid * 0
    hi = Lk + pid * 0
    if HAS_LEFT:
        lo = tl.maximum(i_lo + offset - LEFT, 0) // BLOCK_N * BLOCK_N
    if HAS_KSTART:
        lo = tl.maximum(lo, ks // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(i_hi + offset + RIGHT + 1, 0), Lk)
    hi = tl.maximum(hi, lo)
    per = ((hi - lo + BLOCK_N - 1) // BLOCK_N + NUM_SPLITS - 1) // NUM_SPLITS * BLOCK_N
    start = lo + split * per
    end = tl.minimum(start + per, hi)
    # the whole tiles whose keys every row of the block can see: [full_lo, full_hi)
    full_lo = start
    full_hi = end
    if HAS_LEFT:
        full_lo = (tl.maximum(i_hi + offset - LEFT, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if HAS_KSTART:
        full_lo = tl.maximum(full_lo, (ks + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        full_hi = tl.maximum(i_lo + offset + RIGHT + 1, 0) // BLOCK_N * BLOCK_N
    mid_lo = tl.minimum(tl.maximum(full_lo, start), end)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), end)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    neg = (r[:, None] < 0) & (offs_n[None, :] < 0)  # a −inf score in a middle tile (all False)
    for part in tl.static_range(4):                 # edge tiles, tiles every row sees, edge tiles,
        part_lo = start if part == 0 else (mid_lo if part == 1 else mid_hi)   # and all of them
        part_hi = mid_lo if part == 0 else (mid_hi if part == 1 else end)     # again, checked, when
        if part == 3:                               # a middle tile held a −inf score (below)
            redo = tl.reduce(tl.reduce(neg.to(tl.int32), 1, _max_combine), 0, _max_combine) > 0
            m_i = tl.where(redo, float("-inf"), m_i)
            l_i = tl.where(redo, 0.0, l_i)
            acc = tl.where(redo, 0.0, acc)
            part_lo = tl.where(redo, start, end)
        for start_n in range(_bound(part_lo, INTERPRET), _bound(part_hi, INTERPRET), BLOCK_N):
            cols = start_n + offs_n
            col_ok = cols < Lk                      # keys outside the sequence: never read
            if HAS_KSTART:
                col_ok = col_ok & (cols >= ks)
            kT = _cache_tile(K, Table, b, hk, cols, col_ok, offs_d, stride_kp, stride_kh, stride_kn, stride_kd,
                             stride_tb, stride_tp, PAGE, HEAD_D, False, PAGED)
            qk = _mm(q, kT, None, INTERPRET, PRECISION)
            s, _ = _tile_scores(qk, i[:, None], cols[None, :], geo, masks, scal, True, HAS_LEFT, HAS_RIGHT,
                                False, False, False, HAS_SOFTCAP, HAS_ALIBI, HAS_KSTART)
            p, alpha, m_i, l_i = _online_softmax(s, m_i, l_i)
            v = _cache_tile(V, Table, b, hk, cols, col_ok, offs_dv, stride_vp, stride_vh, stride_vn, stride_vd,
                            stride_tb, stride_tp, PAGE, HEAD_DV, True, PAGED)
            if part != 1:                           # non-finite values as 0: excluded keys never reach a row
                v, bad = _exempt(v, INTERPRET)
            else:                                   # an infinite q or k can still exclude a key here
                neg = neg | ((s == float("-inf")) & col_ok[None, :] & real[:, None])   # (padding rows see none)
            if HAS_DROPOUT:                         # out = dropout(weights) v; l (and lse) count every weight
                p = p * _dropout_scale(i[:, None], cols[None, :], rng)
            acc = _mm_lowp(p, v, acc * alpha[:, None], SPLIT, INTERPRET, PRECISION)
            if part != 1:
                if tl.reduce(tl.reduce(bad.to(tl.float32), 1, _max_combine), 0, _max_combine) > 0:
                    acc = _nan_through(acc, s != float("-inf"), bad, INTERPRET, PRECISION)   # visible: NaN
    # every row saw every key of the middle tiles, which ran unchecked: a non-finite value
    # there reached its column of every row as NaN, or ±inf (p > 0), made NaN here
    acc = tl.where(tl.abs(acc) < float("inf"), acc, float("nan"))
    if HAS_QLENS:                                   # padding rows see no key: no value reaches them
        acc = tl.where(real[:, None], acc, 0.0)

    part = bh.to(tl.int64) * stride_pb + split * stride_ps + r * stride_pm
    tl.store(PartO + part[:, None] + offs_dv[None, :] * stride_pd, acc,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    part = bh.to(tl.int64) * stride_mb + split * stride_ms + r * stride_mm   # PartM and PartL: the same strides
    tl.store(PartM + part, m_i, mask=row_ok)
    tl.store(PartL + part, l_i, mask=row_ok)


def _decode_combine(part_o_op, part_m_op, PartL, sinks_op, qlen_op, out_op, lse_op, HKV, L, NUM_SPLITS,
                    ROW_BLOCKS, GROUP: constexpr, HEAD_DV: constexpr, BLOCK_M: constexpr, BLOCK_DV: constexpr,
                    HAS_SINKS: constexpr, HAS_QLENS: constexpr, INTERPRET: constexpr):
    """out and lse of one block of a GQA group's rows from the splits' partials."""
    QLen, stride_qlen = qlen_op
    PartO, stride_pb, stride_ps, stride_pm, stride_pd = part_o_op
    PartM, stride_mb, stride_ms, stride_mm = part_m_op
    Sinks, stride_sink_b, stride_sink_h, stride_sink_m = sinks_op
    Out, stride_ob, stride_oh, stride_om, stride_od = out_op
    Lse, stride_lb, stride_lh, stride_lm = lse_op
    pid = tl.program_id(0)
    bh = pid // ROW_BLOCKS
    rb = pid % ROW_BLOCKS
    b = (bh // HKV).to(tl.int64)
    hk = (bh % HKV).to(tl.int64)
    M = GROUP * L
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < M
    i = r // GROUP
    h = hk * GROUP + r % GROUP
    offs_dv = tl.arange(0, BLOCK_DV)
    part = bh.to(tl.int64) * stride_pb + r * stride_pm
    part_ml = bh.to(tl.int64) * stride_mb + r * stride_mm
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(0, _bound(NUM_SPLITS, INTERPRET)):   # the largest running max over the splits
        m_i = tl.maximum(m_i, tl.load(PartM + part_ml + s * stride_ms, mask=row_ok, other=float("-inf")))
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)   # no visible key anywhere: l = 0 below
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    for s in range(0, _bound(NUM_SPLITS, INTERPRET)):   # in split order: the same bits every run
        w = tl.exp2(tl.load(PartM + part_ml + s * stride_ms, mask=row_ok, other=float("-inf")) - m_safe)
        l_i = l_i + w * tl.load(PartL + part_ml + s * stride_ms, mask=row_ok, other=0.0)   # 0 · NaN stays NaN
        o = tl.load(PartO + part[:, None] + s * stride_ps + offs_dv[None, :] * stride_pd,
                    mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        acc = acc + w[:, None] * o
    if HAS_SINKS:                                   # the sink joins once, after every split (not
        real = row_ok & (i < _query_length(QLen, stride_qlen, b, L, HAS_QLENS))   # on padding rows)
        sink = tl.load(Sinks + b * stride_sink_b + h * stride_sink_h + i * stride_sink_m, mask=real,
                       other=float("-inf")) * LOG2E
        acc, l_i, m_i = _join_sink(acc, l_i, m_i, sink)
    out, lse = _finish(acc, l_i, m_i)
    tl.store(Out + b * stride_ob + h[:, None] * stride_oh + i[:, None] * stride_om + offs_dv[None, :] * stride_od,
             _cast(out, Out.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV))
    tl.store(Lse + b * stride_lb + h * stride_lh + i * stride_lm, lse, mask=row_ok)
