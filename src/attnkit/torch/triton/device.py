"""Device functions shared by the forward and backward kernels: tile scores in the
contract's order, the band's tile ranges, per-sequence geometry, dropout's Philox
bits, the exempt products of the NaN rule and the rounding helpers.

Tiles are described by small tuples built inside the kernels, so device functions
take one argument per concept:

    geo    (Lq, Lk, offset, LEFT, RIGHT, KS): the sequence's query rows and keys (local
           coordinates, row 0 / key 0 = the sequence's first) and its diagonal
           diag(i) = i + offset with the band diag(i) − LEFT <= j <= diag(i) + RIGHT;
           keys j < KS are not the sequence's (kv_starts: left padding; 0 without)
    masks  ((keep, m, n), (drop, m, n), (bias, m, n)): each a pointer to the tile's
           (0, 0) entry and its row and key strides
    scal   (sm_scale, softcap, slope): slope is ALiBi's, already in log2 units
    rng    (key0, key1, head0, head1, threshold, scale, q0, k0): dropout's Philox key
           and counter words, threshold floor(p·2³²), 1/(1−p), and the sequence's
           first row and key (dropout counts packed rows and keys)
"""

from ...philox import M0, M1, ROUNDS, W0, W1
from .jit import const, constexpr, tl

LOG2E = const(1.4426950408889634)          # log2(e): exp(x) = exp2(x · LOG2E)
LN2 = const(0.6931471805599453)            # ln(2): lse in natural log from log2 units
NEG_2_LOG2E = const(-2.8853900817779268)   # −2·log2(e): exp(−2|x|) as an exp2
PHILOX_M0, PHILOX_M1 = const(M0), const(M1)   # Philox4x32 round multipliers
PHILOX_W0, PHILOX_W1 = const(W0), const(W1)   # and key-schedule increments
PHILOX_ROUNDS = const(ROUNDS)

JIT = ("_max_combine", "_sum_combine", "_tanh", "_mm", "_bound", "_cast", "_mm_lowp", "_tile_scores",
       "_key_range", "_query_range", "_sequence", "_finite_skip", "_philox_word", "_dropout_scale",
       "_exempt", "_nan_through", "_mask_tiles", "_rng", "_online_softmax", "_join_sink", "_finish",
       "_weights")


def _max_combine(a, b):
    """Reduction step for a row max (stand-in when tl.standard lacks its own)."""
    return tl.maximum(a, b)


def _sum_combine(a, b):
    """Reduction step for a row sum (stand-in when tl.standard lacks its own)."""
    return a + b


def _tanh(x):
    """tanh from one exp2: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], so it never
    overflows (Triton 3.6 has no portable tanh)."""
    e = tl.exp2(tl.abs(x) * NEG_2_LOG2E)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


def _mm(a, b, acc, INTERPRET: constexpr, PRECISION: constexpr):
    """acc + a @ b with float32 accumulation (a fresh float32 product when acc is None)."""
    if INTERPRET:
        # the interpreter keeps bfloat16 as raw uint16 and its dot would multiply the
        # bit patterns; half-precision products are exact in float32, so a float32
        # dot is what the tensor cores compute
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


def _bound(x, INTERPRET: constexpr):
    """x as a loop bound. Triton's interpreter keeps program ids (and what is computed
    from them) as 1-element arrays, and before Triton 3.7 turns them into a loop bound
    with int(array), which NumPy >= 2.4 refuses; under the interpreter the value is
    taken out here instead. Compiled, x is returned as it is. Call it inside the
    ``range(...)``: Triton 3.6's interpreter makes a tensor again of a value assigned
    to a kernel variable."""
    if INTERPRET:
        data = getattr(getattr(x, "handle", None), "data", None)
        if data is not None:
            return int(data.reshape(-1)[0])
    return x


def _cast(x, dtype, INTERPRET: constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does. The interpreter's
    float32 -> bfloat16 conversion truncates instead, so there the rounding is done
    on the bits and the value is returned as float32 (exactly a bfloat16 value; a
    store or _mm takes it from there)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000   # round half to even at bit 16
            return bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def _mm_lowp(x, y, acc, SPLIT: constexpr, INTERPRET: constexpr, PRECISION: constexpr):
    """acc + x @ y for float32 x (weights p or score gradients dS) and y in the input
    dtype: x is rounded to y's dtype for the tensor cores, as FlashAttention does.
    With SPLIT, x = hi + lo with both parts in y's dtype and one more dot: twice the
    mantissa bits, so the backward's error stays within DESIGN.md's 2× rule (rounding
    p and dS once to bfloat16/float16 exceeds it on random inputs)."""
    hi = _cast(x, y.dtype, INTERPRET)
    acc = _mm(hi, y, acc, INTERPRET, PRECISION)
    if SPLIT:
        lo = _cast(x - hi.to(tl.float32), y.dtype, INTERPRET)   # the rounding error of hi, rounded
        acc = _mm(lo, y, acc, INTERPRET, PRECISION)
    return acc


# ---- the online softmax ---------------------------------------------------------------
def _online_softmax(s, m_i, l_i):
    """One key tile of the online softmax (scores s in log2 units, rows × keys):
    (p, alpha, m_new, l_new), p the tile's weights relative to the new running max and
    alpha the factor that rescales the old sums. While a row has seen only -inf
    scores the max uses a finite stand-in (0): no -inf − -inf, p = 0, l stays 0."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # finite stand-in: no -inf - -inf
    alpha = tl.exp2(m_i - m_safe)                   # rescales the old sums; 0 while m_i = -inf
    p = tl.exp2(s - m_safe[:, None])                # excluded keys: exp2(-inf) = 0
    return p, alpha, m_new, l_i * alpha + tl.reduce(p, 1, _sum_combine)


def _join_sink(acc, l_i, m_i, sink):
    """(acc, l_i, m_i) with one more logit ``sink`` (log2 units, per row) whose value
    is 0: it joins the denominator only; a NaN sink makes the row NaN."""
    m_all = tl.where(sink != sink, sink, tl.maximum(m_i, sink))
    m_all_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    alpha = tl.exp2(m_i - m_all_safe)               # 0 when no key was visible (m_i = -inf)
    return acc * alpha[:, None], l_i * alpha + tl.exp2(sink - m_all_safe), m_all


def _finish(acc, l_i, m_i):
    """(out, lse in natural log) from the running sums: a row with no visible key and
    no sink (l_i = 0) gives out 0 and lse -inf, never 0 / 0."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), m_i * LN2 + tl.log(l_safe))   # log2 units -> natural log
    return acc / l_safe[:, None], lse


def _weights(s, lse2, vis):
    """The backward's weights exp(scores - lse) of a tile (s and lse2 in log2 units),
    0 where not ``vis``. A weight is at most 1, but s and lse round differently where
    scores are huge (|s| ~ 1e20: lse's last bit is worth 1e13), so s - lse2 can come
    out above 0 and its exp2 overflow to inf: the difference is capped at 0. NaN
    passes (NaN > 0 is False)."""
    d = s - lse2
    return tl.where(vis, tl.exp2(tl.where(d > 0.0, 0.0, d)), 0.0)


# ---- the NaN rule: exempt products ---------------------------------------------------
def _finite_skip(Finite, CAREFUL: constexpr):
    """True when this launch has nothing to do. Every kernel runs twice per call: the
    plain variant (CAREFUL off) computes when the operands of its products are all
    finite, the careful one when some are not; ``Finite`` holds their largest
    magnitude (NaN or inf when one is not finite), computed on the device, so no host
    sync decides."""
    finite = tl.load(Finite) < float("inf")         # NaN compares False
    if CAREFUL:
        return finite
    return finite == 0


def _exempt(y, INTERPRET: constexpr):
    """(y with its non-finite entries set to 0, the 0/1 tile of where they were), the
    right operand of an exempt product x @ y (attnkit.nonfinite.exempt_matmul): x is 0
    outside the visible pairs, and 0 · NaN must not reach the result."""
    yf = y.to(tl.float32)
    bad = (yf != yf) | (tl.abs(yf) == float("inf"))
    return tl.where(bad, 0.0, y), _cast(bad.to(tl.float32), y.dtype, INTERPRET)


def _nan_through(acc, vis, bad, INTERPRET: constexpr, PRECISION: constexpr):
    """acc with NaN where a non-finite operand entry (``bad``, from _exempt) reaches
    it through a visible pair: (vis @ bad) > 0. An inf gives NaN too, as in
    attnkit.nonfinite."""
    hits = _mm(_cast(vis.to(tl.float32), bad.dtype, INTERPRET), bad, None, INTERPRET, PRECISION)
    return tl.where(hits > 0, float("nan"), acc)


# ---- dropout ---------------------------------------------------------------------------
def _philox_word(i, j, head0, head1, key0, key1):
    """attnkit.philox's word for rows i and keys j (int index tensors that broadcast
    to the tile; packed indices): Philox4x32-10 with counter (j >> 2, i, head0, head1)
    and key (key0, key1), output word j & 3. Every element runs the ten rounds (the
    four words of a counter are not shared between neighbouring keys)."""
    zero = (i * 0 + j * 0).to(tl.uint32)
    c0 = zero + (j >> 2).to(tl.uint32)
    c1 = zero + i.to(tl.uint32)
    c2 = zero + head0
    c3 = zero + head1
    k0 = key0
    k1 = key1
    for _ in tl.static_range(PHILOX_ROUNDS):
        hi0 = tl.umulhi(c0, PHILOX_M0)              # the 64-bit products' high and low words
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + PHILOX_W0                         # uint32: wraps mod 2³²
        k1 = k1 + PHILOX_W1
    lane = j & 3
    return tl.where(lane == 0, c0, tl.where(lane == 1, c1, tl.where(lane == 2, c2, c3)))


def _dropout_scale(i, j, rng):
    """kept / (1 − p) for local rows i and keys j of the sequence: 1/(1 − p) where the
    weight survives dropout, 0 where it is dropped (attnkit.philox.kept)."""
    key0, key1, head0, head1, threshold, scale, q0, k0 = rng
    word = _philox_word(q0 + i, k0 + j, head0, head1, key0, key1)
    return tl.where(word >= threshold, scale, 0.0)


def _rng(seed_lo, seed_hi, drop_threshold, drop_scale, head, q0, k0):
    """The rng tuple for flat head index ``head`` = n·H + h (int64) and a sequence
    starting at row q0, key k0. 32-bit scalars arrive as signed int32 and are
    reinterpreted as uint32 here (tl.cast also takes a value Triton made a constant)."""
    return (tl.cast(seed_lo, tl.uint32, bitcast=True), tl.cast(seed_hi, tl.uint32, bitcast=True),
            head.to(tl.uint32), (head >> 32).to(tl.uint32), tl.cast(drop_threshold, tl.uint32, bitcast=True),
            drop_scale, q0, k0)


# ---- scores and tile ranges ------------------------------------------------------------
def _tile_scores(qk, i, j, geo, masks, scal, INDEX_MASK: constexpr, HAS_LEFT: constexpr,
                 HAS_RIGHT: constexpr, HAS_KEEP: constexpr, HAS_DROP: constexpr, HAS_BIAS: constexpr,
                 HAS_SOFTCAP: constexpr, HAS_ALIBI: constexpr, HAS_KSTART: constexpr):
    """Final scores of one tile in log2 units (exp2(s) = exp(score)), -inf where
    excluded, and tanh(scale·qk/softcap) for the softcap backward (qk without softcap).

    ``i`` (query rows) and ``j`` (keys) are 2-D local index tensors that broadcast to
    qk's shape, so the same code serves (rows, keys) and (keys, rows) tiles. Order
    of DESIGN.md §2: scale, softcap, bias, ALiBi, then keep / drop / band / lengths."""
    Lq, Lk, offset, left, right, ks = geo
    keep, drop, bias = masks
    sm_scale, softcap, slope = scal
    if HAS_SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        s = t * (softcap * LOG2E)                   # softcap·tanh(·), times log2(e) for exp2
    else:
        t = qk
        s = qk * (sm_scale * LOG2E)                 # scale and log2(e) folded into one multiply
    if HAS_BIAS or HAS_KEEP or HAS_DROP:
        inside = (i < Lq) & (j < Lk)                # mask loads: never outside the sequence
    if HAS_BIAS:
        b = tl.load(bias[0] + i * bias[1] + j * bias[2], mask=inside, other=0.0)
        s = s + b.to(tl.float32) * LOG2E
    if HAS_ALIBI:
        s = s - slope * tl.abs(i + offset - j).to(tl.float32)   # −slope·|diag(i) − j|, per tile
    if INDEX_MASK:
        out = (i >= Lq) | (j >= Lk)                 # rows / keys past the sequence or the tile
        if HAS_KSTART:
            out = out | (j < ks)                    # keys before the sequence's first
        if HAS_RIGHT:
            out = out | (j > i + offset + right)    # causal / window right edge
        if HAS_LEFT:
            out = out | (j < i + offset - left)     # window left edge
        s = tl.where(out, float("-inf"), s)
    if HAS_KEEP:
        kp = tl.load(keep[0] + i * keep[1] + j * keep[2], mask=inside, other=1)
        s = tl.where(kp != 0, s, float("-inf"))
    if HAS_DROP:
        dp = tl.load(drop[0] + i * drop[1] + j * drop[2], mask=inside, other=0)
        s = tl.where(dp != 0, float("-inf"), s)
    return s, t


def _key_range(r0, geo, BLOCK_M: constexpr, BLOCK_N: constexpr, HAS_LEFT: constexpr,
               HAS_RIGHT: constexpr, HAS_KSTART: constexpr):
    """For query rows [r0, r0 + BLOCK_M): key tiles [lo, hi) that the band can leave
    visible, split as [lo, mid_lo) edge, [mid_lo, mid_hi) wholly inside the band and
    the key range (no index mask), [mid_hi, hi) edge. lo, mid_lo, mid_hi are
    multiples of BLOCK_N (or hi); empty when no row of the block is in the sequence
    (r0 >= Lq). Values are clamped at 0 before dividing because integer division of
    negatives differs between Triton and Python. Keys before the sequence's first (KS)
    lie in edge tiles or in none."""
    Lq, Lk, offset, left, right, ks = geo
    zero = r0 * 0
    lo = zero
    hi = zero + Lk
    full_lo = zero
    full_hi = zero + (Lk // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(r0 + offset - left, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(r0 + BLOCK_M - 1 + offset - left, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if HAS_KSTART:
        lo = tl.maximum(lo, ks // BLOCK_N * BLOCK_N)
        full_lo = tl.maximum(full_lo, (ks + BLOCK_N - 1) // BLOCK_N * BLOCK_N)
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(r0 + BLOCK_M + offset + right, 0), Lk)
        full_hi = tl.minimum(full_hi, tl.maximum(r0 + offset + right + 1, 0) // BLOCK_N * BLOCK_N)
    hi = tl.where(r0 < Lq, hi, lo)                  # padding rows only: nothing to read
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


def _query_range(c0, geo, BLOCK_M: constexpr, BLOCK_N: constexpr, HAS_LEFT: constexpr,
                 HAS_RIGHT: constexpr, HAS_KSTART: constexpr):
    """For keys [c0, c0 + BLOCK_N): query tiles [lo, hi) that can see any of them,
    split like _key_range; the middle part is inside the band and the row range;
    empty when no key of the block is in the sequence (c0 >= Lk, or c0 + BLOCK_N <= KS).
    The block's keys before KS are not the sequence's: the kernel writes their
    gradients as 0, whatever the rows added to them."""
    Lq, Lk, offset, left, right, ks = geo
    zero = c0 * 0
    lo = zero
    hi = zero + Lq
    full_lo = zero
    full_hi = zero + (Lq // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = tl.maximum(c0 - offset - right, 0) // BLOCK_M * BLOCK_M
        full_lo = (tl.maximum(c0 + BLOCK_N - 1 - offset - right, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(tl.maximum(c0 + BLOCK_N - offset + left, 0), Lq)
        full_hi = tl.minimum(full_hi, tl.maximum(c0 - offset + left + 1, 0) // BLOCK_M * BLOCK_M)
    hi = tl.where(c0 < Lk, hi, lo)                  # keys past the sequence only: nothing to read
    if HAS_KSTART:
        hi = tl.where(c0 + BLOCK_N > ks, hi, lo)    # keys before its first only: nothing either
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.minimum(tl.maximum(full_hi, mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


def _mask_tiles(Keep, Drop, Bias, keep_st, drop_st, bias_st, off_b, off_h, q0, k0):
    """The masks tuple: keep, drop and bias at the (0, 0) entry of the sequence for
    batch element off_b, query head off_h, from their (b, h, m, n) strides (0 on
    broadcast dims)."""
    return ((Keep + off_b * keep_st[0] + off_h * keep_st[1] + q0 * keep_st[2] + k0 * keep_st[3],
             keep_st[2], keep_st[3]),
            (Drop + off_b * drop_st[0] + off_h * drop_st[1] + q0 * drop_st[2] + k0 * drop_st[3],
             drop_st[2], drop_st[3]),
            (Bias + off_b * bias_st[0] + off_h * bias_st[1] + q0 * bias_st[2] + k0 * bias_st[3],
             bias_st[2], bias_st[3]))


def _sequence(pid, heads, L, S, OFFSET, ORIGIN, lengths, cu, SEQ0, HAS_QLEN: constexpr, HAS_KLEN: constexpr,
              HAS_KSTART: constexpr, PACKED: constexpr, BOTTOM_RIGHT: constexpr):
    """(off_b, off_h, q0, k0, Lq, Lk, offset, ks) of program axis-1 index ``pid`` over
    (batch element or sequence, head) with ``heads`` heads: the sequence's query rows
    [q0, q0 + Lq) and keys [k0 + ks, k0 + Lk), read on the device (q_lengths /
    kv_lengths / kv_starts: one per batch element; packed: cu_seqlens offsets of
    sequence SEQ0 + pid // heads, ks = 0). ``offset`` is
    attnkit.spec.geometry.Segment's diagonal in sequence-local coordinates, q0 + sigma
    − k0. A dense call's keys keep their places (k0 = 0): its first key ks =
    kv_starts[b] is a bound, so the keys before it get gradients of 0 in place.

    Dense calls may be a block of a larger problem (``Spec.origin`` = ORIGIN = (ROW0,
    COL0), geometry.segments): lengths are the global ones, translated here to the
    block, Lq = clamp(q_len − ROW0, 0, L), Lk = clamp(kv_len − COL0, 0, S), and the
    diagonal is the global sequence's shifted by ROW0 − COL0. OFFSET (host, from the
    same Segment) holds every part of it not read here: the whole diagonal without
    lengths; with them, bottom-right, offset = OFFSET + kv_len − q_len (a length not
    given is a global size, counted in OFFSET); top-left, the kernels add kv_starts[b]
    (the global diagonal's sigma). Packed: Lk − Lq bottom-right, 0 top-left (no blocks)."""
    off_h = (pid % heads).to(tl.int64)
    if PACKED:
        cu_q, cu_k = cu
        seq = SEQ0 + pid // heads
        q0 = tl.load(cu_q + seq)
        k0 = tl.load(cu_k + seq)
        Lq = tl.load(cu_q + seq + 1) - q0
        Lk = tl.load(cu_k + seq + 1) - k0
        off_b = (pid * 0).to(tl.int64)              # packed: one batch element
        q0 = q0.to(tl.int64)
        k0 = k0.to(tl.int64)
        offset = pid * 0
        ks = pid * 0
        if BOTTOM_RIGHT:
            offset = Lk - Lq
    else:
        qlen, klen, kstart = lengths
        row0, col0 = ORIGIN
        off_b = (pid // heads).to(tl.int64)
        q0 = off_b * 0
        k0 = off_b * 0
        Lq = L + (pid * 0)
        Lk = S + (pid * 0)
        offset = OFFSET + (pid * 0)
        if HAS_QLEN:
            q_len = tl.load(qlen[0] + off_b * qlen[1])
            Lq = tl.minimum(tl.maximum(q_len - row0, 0), L)     # the block's rows of the sequence
            if BOTTOM_RIGHT:
                offset = offset - q_len
        if HAS_KLEN:
            kv_len = tl.load(klen[0] + off_b * klen[1])
            Lk = tl.minimum(tl.maximum(kv_len - col0, 0), S)    # the block's keys of the sequence
            if BOTTOM_RIGHT:
                offset = offset + kv_len
        ks = pid * 0
        if HAS_KSTART:
            kv_start = tl.load(kstart[0] + off_b * kstart[1])
            ks = tl.minimum(tl.maximum(kv_start - col0, 0), S)  # the block's first key of the sequence
            if not BOTTOM_RIGHT:
                offset = offset + kv_start                     # top-left: the first query on it
    return off_b, off_h, q0, k0, Lq, Lk, offset, ks
