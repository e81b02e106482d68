"""Triton kernels for attention, forward and backward, with the whole contract.

Kernels (FlashAttention-2 structure, names from the paper: m_i, l_i, acc, BLOCK_M,
BLOCK_N)::

    _attn_fwd        one program per (query block, batch·head): online softmax over key
                     blocks, writes out (q's dtype) and lse (float32, natural log)
    _bwd_preprocess  delta = rowsum(dout ∘ out) per query row
    _attn_bwd_dkdv   one program per (key block, batch·kv head): loops over the query
                     heads of its GQA group and over query blocks, writes dk, dv
    _attn_bwd_dq     one program per (query block, batch·head): loops over key blocks,
                     writes dq and, when asked, dS (the gradient of the final scores,
                     which is dbias)

Every output element is written by exactly one program and no atomics are used, so
results are bit-for-bit deterministic.

Masking, in the contract's order: scores = scale·q kᵀ, softcap·tanh(scores/softcap),
+ bias, then keep / drop / causal / window set -inf. Causal and window become one
band ``diag(i) - LEFT <= j <= diag(i) + RIGHT`` with ``diag(i) = i + OFFSET``
(``OFFSET = S - L`` bottom-right, 0 top-left; causal caps RIGHT at 0). Tiles wholly
outside the band are skipped through the loop bounds; tiles wholly inside run without
the index mask; only the tiles crossing the band edge (or the L, S boundary) compute it.
keep / drop / bias are read per tile through their broadcast strides (stride 0 on
broadcast dims): they are never expanded in memory.

Fully masked rows give out 0 and lse -inf without NaN: while a row has seen only -inf
scores the running max uses a finite stand-in (0), and the backward turns lse = -inf
into weights 0.

Head dims up to 256; D and Dv that are not powers of two are padded inside the kernel
(``tl.arange`` over the next power of two, masked loads and stores). float16, bfloat16
and float32 inputs; float32 dots run in IEEE fp32 (tf32 only when
``torch.get_float32_matmul_precision()`` is not "highest", as for torch matmuls).

Numerics: scores, softmax statistics and every accumulator are float32. In the
backward, the weights p and score gradients dS enter the half-precision tensor-core
dots as two parts, hi + lo (``SPLIT`` in triton_tuning, on by default for the backward
kinds): rounding them once, as FlashAttention-2 does, puts dq, dk and dv above
DESIGN.md's 2× rule on random inputs. The forward rounds p once (its error stays
inside the rule: the output's final rounding dominates).

CPU: with ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors through Triton's
interpreter. Triton reads that variable when ``@triton.jit`` wraps a function, so this
module keeps the kernels as plain functions and wraps them on first use, once per
interpreter setting (``_kernels()``). Triton's own ``@jit`` helpers in
``triton.language.standard`` (``tl.zeros``, ``tl.cdiv``, ``tl.max``, ...) are wrapped at
``import triton`` and fail inside an interpreted kernel when triton was imported
before the variable was set, so the kernels use only core builtins (``tl.full``,
integer arithmetic, ``tl.reduce`` with a combine step). Net effect: setting the
variable any time before the first call works, whatever imported triton earlier
(tests set it per test with monkeypatch). The interpreter truncates float32 ->
bfloat16 conversions and multiplies bfloat16 bit patterns in ``tl.dot``; under it the
kernels round to nearest even themselves and dot in float32 (``_cast``, ``_mm``), which
is what the GPU computes.

Memory: forward O(B·H·L·(D + Dv)) for out and lse, nothing L × S. Backward adds delta
(B·H·L float32) and, only when bias is given and its gradient is asked, one
(..., H, L, S) dS buffer (in bias's dtype when bias is full size, else float32, summed
to bias's shape afterwards). dq/dk/dv get a float32 (..., H|Hkv, L|S, D) buffer only
when q/k/v are broadcast over batch dims (the sum over them is then a torch reduction).
"""

import itertools
import math
import os
import threading
import types

try:
    import triton
    import triton.language as tl
    constexpr = tl.constexpr
    _IMPORT_ERROR = None
except (ImportError, OSError, RuntimeError) as e:   # missing or broken install
    triton = tl = None
    constexpr = "constexpr"                         # annotation stand-in; kernels are never wrapped
    _IMPORT_ERROR = f"{type(e).__name__}: {e}"

from ...spec import band as _spec_band
from . import tuning as triton_tuning

MAX_HEAD_DIM = 256
DTYPES = ("float16", "bfloat16", "float32")
# Fused multiply-add contraction on, as Triton has always defaulted to; said explicitly
# because Triton 3.9 warns that its default will change in 3.10.
_FP_FUSION = {"enable_fp_fusion": True}


# ---- device functions ------------------------------------------------------------
def _max_combine(a, b):
    """Reduction step for a row max (stand-in when tl.standard lacks its own)."""
    return tl.maximum(a, b)


def _sum_combine(a, b):
    """Reduction step for a row sum (stand-in when tl.standard lacks its own)."""
    return a + b


def _tanh(x):
    """tanh from one exp2: (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 1], so it never
    overflows (Triton 3.6 has no portable tanh)."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)    # -2·log2(e): exp(-2|x|) as an exp2
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
    taken out here instead. Compiled, x is returned as it is."""
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


def _tile_scores(qk, i, j, L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                 keep_ptr, stride_keep_m, stride_keep_n,
                 drop_ptr, stride_drop_m, stride_drop_n,
                 bias_ptr, stride_bias_m, stride_bias_n,
                 INDEX_MASK: constexpr, HAS_LEFT: constexpr, HAS_RIGHT: constexpr,
                 HAS_KEEP: constexpr, HAS_DROP: constexpr, HAS_BIAS: constexpr,
                 HAS_SOFTCAP: constexpr):
    """Final scores of one tile in log2 units (exp2(s) = exp(score)), -inf where
    excluded, and tanh(scale·qk/softcap) for the softcap backward (qk without softcap).

    ``i`` (query rows) and ``j`` (keys) are 2-D index tensors that broadcast to qk's
    shape, so the same code serves (rows, keys) and (keys, rows) tiles."""
    if HAS_SOFTCAP:
        t = _tanh(qk * (sm_scale / softcap))
        s = t * (softcap * 1.4426950408889634)      # softcap·tanh(·), times log2(e) for exp2
    else:
        t = qk
        s = qk * (sm_scale * 1.4426950408889634)    # scale and log2(e) folded into one multiply
    inside = (i < L) & (j < S)
    if HAS_BIAS:
        b = tl.load(bias_ptr + i * stride_bias_m + j * stride_bias_n, mask=inside, other=0.0)
        s = s + b.to(tl.float32) * 1.4426950408889634
    if INDEX_MASK:
        out = (i >= L) | (j >= S)                   # padding rows / keys of edge tiles
        if HAS_RIGHT:
            out = out | (j > i + OFFSET + RIGHT)    # causal / window right edge
        if HAS_LEFT:
            out = out | (j < i + OFFSET - LEFT)     # window left edge
        s = tl.where(out, float("-inf"), s)
    if HAS_KEEP:
        kp = tl.load(keep_ptr + i * stride_keep_m + j * stride_keep_n, mask=inside, other=1)
        s = tl.where(kp != 0, s, float("-inf"))
    if HAS_DROP:
        dp = tl.load(drop_ptr + i * stride_drop_m + j * stride_drop_n, mask=inside, other=0)
        s = tl.where(dp != 0, float("-inf"), s)
    return s, t


def _key_range(r0, S, OFFSET, LEFT, RIGHT, BLOCK_M: constexpr, BLOCK_N: constexpr,
               HAS_LEFT: constexpr, HAS_RIGHT: constexpr):
    """For query rows [r0, r0 + BLOCK_M): key tiles [lo, hi) that the band can leave
    visible, split as [lo, mid_lo) edge, [mid_lo, mid_hi) wholly inside the band and
    the S boundary (no index mask), [mid_hi, hi) edge. lo, mid_lo, mid_hi are
    multiples of BLOCK_N (or hi). Values are clamped at 0 before dividing because
    integer division of negatives differs between Triton and Python."""
    zero = r0 * 0
    lo = zero
    hi = zero + S
    full_lo = zero
    full_hi = zero + (S // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = tl.maximum(r0 + OFFSET - LEFT, 0) // BLOCK_N * BLOCK_N
        full_lo = (tl.maximum(r0 + BLOCK_M - 1 + OFFSET - LEFT, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(tl.maximum(r0 + BLOCK_M + OFFSET + RIGHT, 0), S)
        full_hi = tl.minimum(full_hi, tl.maximum(r0 + OFFSET + RIGHT + 1, 0) // BLOCK_N * BLOCK_N)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.maximum(full_hi, mid_lo)
    return lo, mid_lo, mid_hi, hi


def _query_range(c0, L, OFFSET, LEFT, RIGHT, BLOCK_M: constexpr, BLOCK_N: constexpr,
                 HAS_LEFT: constexpr, HAS_RIGHT: constexpr):
    """For keys [c0, c0 + BLOCK_N): query tiles [lo, hi) that can see any of them,
    split like _key_range; the middle part is inside the band and the L boundary."""
    zero = c0 * 0
    lo = zero
    hi = zero + L
    full_lo = zero
    full_hi = zero + (L // BLOCK_M) * BLOCK_M
    if HAS_RIGHT:
        lo = tl.maximum(c0 - OFFSET - RIGHT, 0) // BLOCK_M * BLOCK_M
        full_lo = (tl.maximum(c0 + BLOCK_N - 1 - OFFSET - RIGHT, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    if HAS_LEFT:
        hi = tl.minimum(tl.maximum(c0 + BLOCK_N - OFFSET + LEFT, 0), L)
        full_hi = tl.minimum(full_hi, tl.maximum(c0 - OFFSET + LEFT + 1, 0) // BLOCK_M * BLOCK_M)
    mid_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    mid_hi = tl.maximum(full_hi, mid_lo)
    return lo, mid_lo, mid_hi, hi


# ---- forward -----------------------------------------------------------------------
def _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, offs_dv,
               stride_kn, stride_kd, stride_vn, stride_vd,
               L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
               keep_ptr, stride_keep_m, stride_keep_n,
               drop_ptr, stride_drop_m, stride_drop_n,
               bias_ptr, stride_bias_m, stride_bias_n,
               start, end,
               HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_N: constexpr,
               INDEX_MASK: constexpr, HAS_LEFT: constexpr, HAS_RIGHT: constexpr,
               HAS_KEEP: constexpr, HAS_DROP: constexpr, HAS_BIAS: constexpr,
               HAS_SOFTCAP: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
               PRECISION: constexpr):
    """Online softmax over key tiles [start, end)."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_N):
        cols = start_n + offs_n
        kT = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=(cols[None, :] < S) & (offs_d[:, None] < HEAD_D), other=0.0)
        qk = _mm(q, kT, None, INTERPRET, PRECISION)
        s, _ = _tile_scores(qk, offs_m[:, None], cols[None, :], L, S, sm_scale, softcap,
                            OFFSET, LEFT, RIGHT, keep_ptr, stride_keep_m, stride_keep_n,
                            drop_ptr, stride_drop_m, stride_drop_n,
                            bias_ptr, stride_bias_m, stride_bias_n,
                            INDEX_MASK, HAS_LEFT, HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS,
                            HAS_SOFTCAP)
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _max_combine))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # finite stand-in: no -inf - -inf
        alpha = tl.exp2(m_i - m_safe)                 # rescales the old sums; 0 while m_i = -inf
        p = tl.exp2(s - m_safe[:, None])              # excluded keys: exp2(-inf) = 0
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
        v = tl.load(v_base + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=(cols[:, None] < S) & (offs_dv[None, :] < HEAD_DV), other=0.0)
        acc = _mm_lowp(p, v, acc * alpha[:, None], SPLIT, INTERPRET, PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def _attn_fwd(Q, K, V, Out, Lse, Keep, Drop, Bias,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_lb, stride_lh, stride_lm,
              stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n,
              stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n,
              stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
              H, L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
              GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
              BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr, BLOCK_DV: constexpr,
              HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr,
              HAS_DROP: constexpr, HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr,
              SPLIT: constexpr, INTERPRET: constexpr, PRECISION: constexpr):
    """out and lse for one query block of one (batch, head)."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)              # 64-bit base offsets: big tensors and masks
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP                         # GQA: head h reads kv head h // group
    r0 = start_m * BLOCK_M
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)                  # head dims padded to a power of two
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=(offs_m[:, None] < L) & (offs_d[None, :] < HEAD_D), other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    keep_ptr = Keep + off_b * stride_keep_b + off_h * stride_keep_h
    drop_ptr = Drop + off_b * stride_drop_b + off_h * stride_drop_h
    bias_ptr = Bias + off_b * stride_bias_b + off_h * stride_bias_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_DV], 0.0, tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(r0, S, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N,
                                        HAS_LEFT, HAS_RIGHT)
    for part in tl.static_range(3):                 # edge tiles, tiles inside the band, edge tiles
        start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
        end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, offs_m, offs_d, offs_dv,
                                   stride_kn, stride_kd, stride_vn, stride_vd,
                                   L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                                   keep_ptr, stride_keep_m, stride_keep_n,
                                   drop_ptr, stride_drop_m, stride_drop_n,
                                   bias_ptr, stride_bias_m, stride_bias_n, start, end,
                                   HEAD_D, HEAD_DV, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT,
                                   HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, SPLIT, INTERPRET,
                                   PRECISION)

    empty = l_i == 0.0                              # fully masked row (or no visible key)
    l_safe = tl.where(empty, 1.0, l_i)              # out = 0 / 1 = 0 instead of 0 / 0
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), m_i * 0.6931471805599453 + tl.log(l_safe))  # log2 -> ln
    tl.store(Out + off_b * stride_ob + off_h * stride_oh
             + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
             _cast(out, Out.dtype.element_ty, INTERPRET),
             mask=(offs_m[:, None] < L) & (offs_dv[None, :] < HEAD_DV))
    tl.store(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm, lse,
             mask=offs_m < L)


# ---- backward ----------------------------------------------------------------------
def _bwd_preprocess(Out, DO, Delta,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    stride_lb, stride_lh, stride_lm,
                    H, L, HEAD_DV: constexpr, BLOCK_M: constexpr, BLOCK_DV: constexpr):
    """delta = rowsum(dout ∘ out) in float32: the softmax Jacobian term Σ_j w·dw."""
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


def _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols, offs_d, offs_dv,
                stride_qm, stride_qd, stride_dom, stride_dod, stride_lm,
                L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                keep_ptr, stride_keep_m, stride_keep_n,
                drop_ptr, stride_drop_m, stride_drop_n,
                bias_ptr, stride_bias_m, stride_bias_n,
                start, end,
                HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_M: constexpr,
                INDEX_MASK: constexpr, HAS_LEFT: constexpr, HAS_RIGHT: constexpr,
                HAS_KEEP: constexpr, HAS_DROP: constexpr, HAS_BIAS: constexpr,
                HAS_SOFTCAP: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
               PRECISION: constexpr):
    """dk, dv of one key block from query tiles [start, end), in (keys, rows) layout."""
    offs_m = tl.arange(0, BLOCK_M)
    for start_m in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < L
        qT = tl.load(q_base + rows[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                     mask=row_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        qkT = _mm(k, qT, None, INTERPRET, PRECISION)
        sT, tT = _tile_scores(qkT, rows[None, :], cols[:, None], L, S, sm_scale, softcap,
                              OFFSET, LEFT, RIGHT, keep_ptr, stride_keep_m, stride_keep_n,
                              drop_ptr, stride_drop_m, stride_drop_n,
                              bias_ptr, stride_bias_m, stride_bias_n,
                              INDEX_MASK, HAS_LEFT, HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS,
                              HAS_SOFTCAP)
        lse = tl.load(lse_base + rows * stride_lm, mask=row_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # lse -inf: weights 0
        pT = tl.exp2(sT - lse2[None, :])            # weights = exp(scores - lse), from the given lse
        do = tl.load(do_base + rows[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                     mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
        dv = _mm_lowp(pT, do, dv, SPLIT, INTERPRET, PRECISION)
        Di = tl.load(delta_base + rows * stride_lm, mask=row_ok, other=0.0)
        dpT = _mm(v, tl.trans(do), None, INTERPRET, PRECISION)
        dsT = pT * (dpT - Di[None, :])              # softmax Jacobian: w ∘ (dw - Σ w·dw)
        if HAS_SOFTCAP:
            dsT = dsT * (1.0 - tT * tT)             # d/dx c·tanh(x/c) = 1 - tanh²
        dk = _mm_lowp(dsT, tl.trans(qT), dk, SPLIT, INTERPRET, PRECISION)
    return dk, dv


def _attn_bwd_dkdv(Q, K, V, DO, Lse, Delta, DK, DV, Keep, Drop, Bias,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_lb, stride_lh, stride_lm,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n,
                   stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n,
                   stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                   HKV, L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                   GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
                   BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
                   BLOCK_DV: constexpr,
                   HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr,
                   HAS_DROP: constexpr, HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr,
                   SPLIT: constexpr, INTERPRET: constexpr, PRECISION: constexpr):
    """dk, dv for one key block of one (batch, kv head), summed over its GQA group."""
    start_n = tl.program_id(0)
    off_bhk = tl.program_id(1)
    off_b = (off_bhk // HKV).to(tl.int64)
    off_hk = (off_bhk % HKV).to(tl.int64)
    c0 = start_n * BLOCK_N
    cols = c0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = cols < S
    k = tl.load(K + off_b * stride_kb + off_hk * stride_kh
                + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    v = tl.load(V + off_b * stride_vb + off_hk * stride_vh
                + cols[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    dk = tl.full([BLOCK_N, BLOCK_D], 0.0, tl.float32)
    dv = tl.full([BLOCK_N, BLOCK_DV], 0.0, tl.float32)
    lo, mid_lo, mid_hi, hi = _query_range(c0, L, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N,
                                          HAS_LEFT, HAS_RIGHT)
    for g in range(GROUP):                          # the query heads sharing this kv head, in order
        off_h = off_hk * GROUP + g
        q_base = Q + off_b * stride_qb + off_h * stride_qh
        do_base = DO + off_b * stride_dob + off_h * stride_doh
        lse_base = Lse + off_b * stride_lb + off_h * stride_lh
        delta_base = Delta + off_b * stride_lb + off_h * stride_lh
        keep_ptr = Keep + off_b * stride_keep_b + off_h * stride_keep_h
        drop_ptr = Drop + off_b * stride_drop_b + off_h * stride_drop_h
        bias_ptr = Bias + off_b * stride_bias_b + off_h * stride_bias_h
        for part in tl.static_range(3):             # edge tiles, tiles inside the band, edge tiles
            start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
            end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
            dk, dv = _dkdv_inner(dk, dv, k, v, q_base, do_base, lse_base, delta_base, cols,
                                 offs_d, offs_dv, stride_qm, stride_qd, stride_dom, stride_dod,
                                 stride_lm, L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                                 keep_ptr, stride_keep_m, stride_keep_n,
                                 drop_ptr, stride_drop_m, stride_drop_n,
                                 bias_ptr, stride_bias_m, stride_bias_n, start, end,
                                 HEAD_D, HEAD_DV, BLOCK_M, part != 1, HAS_LEFT, HAS_RIGHT,
                                 HAS_KEEP, HAS_DROP, HAS_BIAS, HAS_SOFTCAP, SPLIT, INTERPRET,
                                 PRECISION)
    dk = dk * sm_scale                              # scores = scale · q kᵀ
    tl.store(DK + off_b * stride_dkb + off_hk * stride_dkh
             + cols[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             _cast(dk, DK.dtype.element_ty, INTERPRET), mask=col_ok[:, None] & (offs_d[None, :] < HEAD_D))
    tl.store(DV + off_b * stride_dvb + off_hk * stride_dvh
             + cols[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd,
             _cast(dv, DV.dtype.element_ty, INTERPRET), mask=col_ok[:, None] & (offs_dv[None, :] < HEAD_DV))


def _dq_inner(dq, q, do, lse2, Di, k_base, v_base, ds_base, offs_m, offs_d, offs_dv,
              stride_kn, stride_kd, stride_vn, stride_vd, stride_ds_m, stride_ds_n,
              L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
              keep_ptr, stride_keep_m, stride_keep_n,
              drop_ptr, stride_drop_m, stride_drop_n,
              bias_ptr, stride_bias_m, stride_bias_n,
              start, end,
              HEAD_D: constexpr, HEAD_DV: constexpr, BLOCK_N: constexpr,
              INDEX_MASK: constexpr, HAS_LEFT: constexpr, HAS_RIGHT: constexpr,
              HAS_KEEP: constexpr, HAS_DROP: constexpr, HAS_BIAS: constexpr,
              HAS_SOFTCAP: constexpr, WRITE_DS: constexpr, SPLIT: constexpr,
              INTERPRET: constexpr, PRECISION: constexpr):
    """dq of one query block from key tiles [start, end); writes dS tiles if asked."""
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(_bound(start, INTERPRET), _bound(end, INTERPRET), BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < S
        kT = tl.load(k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=col_ok[None, :] & (offs_d[:, None] < HEAD_D), other=0.0)
        vT = tl.load(v_base + cols[None, :] * stride_vn + offs_dv[:, None] * stride_vd,
                     mask=col_ok[None, :] & (offs_dv[:, None] < HEAD_DV), other=0.0)
        qk = _mm(q, kT, None, INTERPRET, PRECISION)
        s, t = _tile_scores(qk, offs_m[:, None], cols[None, :], L, S, sm_scale, softcap,
                            OFFSET, LEFT, RIGHT, keep_ptr, stride_keep_m, stride_keep_n,
                            drop_ptr, stride_drop_m, stride_drop_n,
                            bias_ptr, stride_bias_m, stride_bias_n,
                            INDEX_MASK, HAS_LEFT, HAS_RIGHT, HAS_KEEP, HAS_DROP, HAS_BIAS,
                            HAS_SOFTCAP)
        p = tl.exp2(s - lse2[:, None])              # weights = exp(scores - lse)
        dp = _mm(do, vT, None, INTERPRET, PRECISION)
        ds = p * (dp - Di[:, None])                 # gradient of the final scores (= dbias)
        if WRITE_DS:
            tl.store(ds_base + offs_m[:, None] * stride_ds_m + cols[None, :] * stride_ds_n,
                     _cast(ds, ds_base.dtype.element_ty, INTERPRET),
                     mask=(offs_m[:, None] < L) & col_ok[None, :])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)                 # d/dx c·tanh(x/c) = 1 - tanh²
        dq = _mm_lowp(ds, tl.trans(kT), dq, SPLIT, INTERPRET, PRECISION)
    return dq


def _attn_bwd_dq(Q, K, V, DO, Lse, Delta, DQ, DS, Keep, Drop, Bias,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_lb, stride_lh, stride_lm,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_ds_b, stride_ds_h, stride_ds_m, stride_ds_n,
                 stride_keep_b, stride_keep_h, stride_keep_m, stride_keep_n,
                 stride_drop_b, stride_drop_h, stride_drop_m, stride_drop_n,
                 stride_bias_b, stride_bias_h, stride_bias_m, stride_bias_n,
                 H, L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                 GROUP: constexpr, HEAD_D: constexpr, HEAD_DV: constexpr,
                 BLOCK_M: constexpr, BLOCK_N: constexpr, BLOCK_D: constexpr,
                 BLOCK_DV: constexpr,
                 HAS_LEFT: constexpr, HAS_RIGHT: constexpr, HAS_KEEP: constexpr,
                 HAS_DROP: constexpr, HAS_BIAS: constexpr, HAS_SOFTCAP: constexpr,
                 WRITE_DS: constexpr, SPLIT: constexpr, INTERPRET: constexpr,
                 PRECISION: constexpr):
    """dq (and dS) for one query block of one (batch, head)."""
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    r0 = start_m * BLOCK_M
    offs_m = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < L
    q = tl.load(Q + off_b * stride_qb + off_h * stride_qh
                + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D), other=0.0)
    do = tl.load(DO + off_b * stride_dob + off_h * stride_doh
                 + offs_m[:, None] * stride_dom + offs_dv[None, :] * stride_dod,
                 mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DV), other=0.0)
    lse = tl.load(Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm,
                  mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)  # lse -inf: weights 0
    Di = tl.load(Delta + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm,
                 mask=row_ok, other=0.0)
    k_base = K + off_b * stride_kb + off_hk * stride_kh
    v_base = V + off_b * stride_vb + off_hk * stride_vh
    ds_base = DS + off_b * stride_ds_b + off_h * stride_ds_h
    keep_ptr = Keep + off_b * stride_keep_b + off_h * stride_keep_h
    drop_ptr = Drop + off_b * stride_drop_b + off_h * stride_drop_h
    bias_ptr = Bias + off_b * stride_bias_b + off_h * stride_bias_h
    dq = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(r0, S, OFFSET, LEFT, RIGHT, BLOCK_M, BLOCK_N,
                                        HAS_LEFT, HAS_RIGHT)
    for part in tl.static_range(3):                 # edge tiles, tiles inside the band, edge tiles
        start = lo if part == 0 else (mid_lo if part == 1 else mid_hi)
        end = mid_lo if part == 0 else (mid_hi if part == 1 else hi)
        dq = _dq_inner(dq, q, do, lse2, Di, k_base, v_base, ds_base, offs_m, offs_d, offs_dv,
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_ds_m, stride_ds_n,
                       L, S, sm_scale, softcap, OFFSET, LEFT, RIGHT,
                       keep_ptr, stride_keep_m, stride_keep_n, drop_ptr, stride_drop_m,
                       stride_drop_n, bias_ptr, stride_bias_m, stride_bias_n, start, end,
                       HEAD_D, HEAD_DV, BLOCK_N, part != 1, HAS_LEFT, HAS_RIGHT, HAS_KEEP, HAS_DROP,
                       HAS_BIAS, HAS_SOFTCAP, WRITE_DS, SPLIT, INTERPRET, PRECISION)
    dq = dq * sm_scale                              # scores = scale · q kᵀ
    tl.store(DQ + off_b * stride_dqb + off_h * stride_dqh
             + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             _cast(dq, DQ.dtype.element_ty, INTERPRET), mask=row_ok[:, None] & (offs_d[None, :] < HEAD_D))


# ---- wrapping the device functions with triton.jit, lazily ---------------------------
_DEVICE_FUNCTIONS = ("_max_combine", "_sum_combine", "_tanh", "_mm", "_bound", "_cast", "_mm_lowp",
                     "_tile_scores", "_key_range", "_query_range",
                     "_fwd_inner", "_attn_fwd", "_bwd_preprocess", "_dkdv_inner",
                     "_attn_bwd_dkdv", "_dq_inner", "_attn_bwd_dq")
_KERNEL_NAMES = ("_attn_fwd", "_bwd_preprocess", "_attn_bwd_dkdv", "_attn_bwd_dq")
_STANDARD_COMBINE = {"_max_combine": "_elementwise_max", "_sum_combine": "_sum_combine"}
_KERNELS = {}
_LOCK = threading.Lock()


def interpreting() -> bool:
    """True when Triton would interpret (TRITON_INTERPRET=1), read the way triton.jit
    reads it right now."""
    knobs = getattr(triton, "knobs", None)          # Triton >= 3.4
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _InterpretedHelper:
    """A device function called from an interpreted kernel, minus the per-call
    re-patching of triton.language that Triton's interpreter does on every call (the
    calling kernel has patched it already); about a third of the interpreter's time
    in these kernels. Falls back to the plain call when the interpreter lacks
    ``rewrite`` (it is internal API)."""

    def __init__(self, fn):
        self.fn = fn
        self.call = fn.rewrite() if hasattr(fn, "rewrite") else fn

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


def _kernels(mode=None):
    """The jitted kernels for interpreter mode ``mode`` (default: the current
    TRITON_INTERPRET setting), built once per mode.

    Each device function is copied into a private namespace whose globals hold the
    wrapped copies of the others, so a kernel calls helpers of its own mode and the
    module's own functions stay plain Python. The row max / row sum combine steps
    are Triton's own (what tl.max / tl.sum use) when present: the interpreter runs
    those as one NumPy reduction, any other combine function element by element."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    mode = interpreting() if mode is None else mode
    wrap = InterpretedFunction if mode else JITFunction   # what triton.jit picks for each mode
    with _LOCK:
        if mode not in _KERNELS:
            ns = dict(globals())
            for name in _DEVICE_FUNCTIONS:
                f = globals()[name]
                g = types.FunctionType(f.__code__, ns, f.__name__, f.__defaults__, f.__closure__)
                g.__qualname__, g.__module__, g.__doc__ = f.__qualname__, f.__module__, f.__doc__
                g.__annotations__ = dict(f.__annotations__)
                ns[name] = wrap(g)
                if name in _STANDARD_COMBINE:
                    ns[name] = getattr(tl.standard, _STANDARD_COMBINE[name], ns[name])
                elif mode and name not in _KERNEL_NAMES:
                    ns[name] = _InterpretedHelper(ns[name])
            _KERNELS[mode] = types.SimpleNamespace(**{n: ns[n] for n in _DEVICE_FUNCTIONS})
        return _KERNELS[mode]


# ---- host side -----------------------------------------------------------------------
def available():
    """None when Triton can run here, else the reason (for ``attnkit info``)."""
    if triton is None:
        return f"triton is not installed ({_IMPORT_ERROR})"
    import torch
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    return None


def not_supported_reasons(spec) -> list:
    """Why these kernels cannot run this call; empty when they can."""
    if triton is None:
        return [f"triton is not installed ({_IMPORT_ERROR})"]
    if not spec.torch:
        return ["takes torch tensors"]
    why = []
    if spec.dtype not in DTYPES:
        why.append(f"dtype {spec.dtype} is not supported by the Triton kernels (float16, bfloat16, float32)")
    if max(spec.D, spec.Dv) > MAX_HEAD_DIM:
        why.append(f"head dim D={spec.D}, Dv={spec.Dv} exceeds {MAX_HEAD_DIM}")
    for name, given in (("sinks", spec.sinks is not None), ("alibi_slopes", spec.alibi_slopes is not None),
                        ("dropout", spec.dropout > 0), ("q_lengths/kv_lengths/cu_seqlens", spec.varlen)):
        if given:
            why.append(f"{name} is not implemented in the Triton kernels yet")
    kind = spec.q.device.type
    if kind == "cpu":
        if not interpreting():
            why.append("CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter)")
    elif kind != "cuda":
        why.append(f"device {kind} is not supported (CUDA, or CPU with TRITON_INTERPRET=1)")
    return why


def _capability(device):
    import torch
    if device.type != "cuda" or interpreting():
        return None
    return torch.cuda.get_device_capability(device)


def _precision(spec):
    """IEEE float32 dots unless the user allowed tf32 for torch matmuls."""
    import torch
    if spec.dtype == "float32" and _capability(spec.q.device) is not None \
            and torch.get_float32_matmul_precision() != "highest":
        return "tf32"
    return "ieee"


def _band(spec):
    """(HAS_LEFT, HAS_RIGHT, LEFT, RIGHT): Spec.band as kernel constants."""
    left, right = _spec_band(spec.causal, spec.window)
    return left is not None, right is not None, left or 0, right or 0


def _next_pow2(n):
    return max(16, 1 << (n - 1).bit_length())       # tl.dot needs every block dim >= 16


def _masks(spec):
    """keep, drop, bias as views broadcast to the score shape (stride 0 on broadcast
    dims, no copy); booleans reinterpreted as uint8 (same bytes)."""
    import torch
    out = []
    for m in (spec.keep, spec.drop, spec.bias):
        if m is None:
            out.append(None)
            continue
        if m.dtype == torch.bool:
            m = m.view(torch.uint8)
        out.append(m.broadcast_to(spec.score_shape))
    return out


def _launches(batch, tensors, heads):
    """Split the leading batch dims into kernel launches of one flat batch dim.

    ``tensors`` all have shape batch + tail (broadcast views; None allowed). Batch dims
    of size 1 are dropped and adjacent dims merged when every tensor's strides allow
    it (as torch's TensorIterator does), so the common cases are one launch; what
    cannot merge is looped over here. Each launch gets views of shape (nb,) + tail
    with nb · heads within CUDA's grid limit. Yields (nb, views)."""
    sizes = [n for n in batch]
    present = [t for t in tensors if t is not None]
    nd = len(batch)
    dims = [d for d in range(nd) if sizes[d] != 1]
    merged = []                                     # [(size, {tensor index: stride})]
    for d in dims:
        st = [t.stride(d) for t in present]
        if merged and all(ms == s * sizes[d] for ms, s in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * sizes[d], st)
        else:
            merged.append((sizes[d], st))
    if not merged:
        merged = [(1, [0] * len(present))]
    outer, (inner, inner_st) = merged[:-1], merged[-1]
    chunk = max(1, 65535 // heads)                  # grid axis 1 holds nb · heads programs
    for idx in itertools.product(*(range(n) for n, _ in outer)):
        for b0 in range(0, inner, chunk):
            nb = min(chunk, inner - b0)
            views, it = [], iter(range(len(present)))
            for t in tensors:
                if t is None:
                    views.append(None)
                    continue
                i = next(it)
                off = t.storage_offset() + b0 * inner_st[i]
                off += sum(x * st[i] for x, (_, st) in zip(idx, outer))
                views.append(t.as_strided((nb,) + tuple(t.shape[nd:]),
                                          (inner_st[i],) + tuple(t.stride()[nd:]), off))
            yield nb, views


def _strides(t, n):
    return tuple(t.stride()) if t is not None else (0,) * n


def _device_guard(x):
    import contextlib
    import torch
    return torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext()


def _constexprs(cfg, *, group, D, Dv, dtype, band, keep, drop, bias, softcap, interpret,
                precision):
    """The compile-time parameters of the attention kernels."""
    has_left, has_right = band
    return dict(GROUP=group, HEAD_D=D, HEAD_DV=Dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                BLOCK_D=_next_pow2(D), BLOCK_DV=_next_pow2(Dv), HAS_LEFT=has_left,
                HAS_RIGHT=has_right, HAS_KEEP=keep, HAS_DROP=drop, HAS_BIAS=bias,
                HAS_SOFTCAP=softcap, SPLIT=bool(cfg["SPLIT"]) and dtype != "float32",
                INTERPRET=interpret, PRECISION=precision)


def _common(spec, kind):
    """Launch parameters shared by the kernels of one call."""
    has_left, has_right, left, right = _band(spec)
    cap = _capability(spec.q.device)
    cfg = triton_tuning.config(max(spec.D, spec.Dv), spec.dtype, cap, kind)
    consts = _constexprs(cfg, group=spec.group, D=spec.D, Dv=spec.Dv, dtype=spec.dtype,
                         band=(has_left, has_right), keep=spec.keep is not None,
                         drop=spec.drop is not None, bias=spec.bias is not None,
                         softcap=spec.softcap is not None, interpret=interpreting(),
                         precision=_precision(spec))
    consts.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **_FP_FUSION)
    offset = spec.S - spec.L if spec.align == "bottom_right" else 0
    scalars = (spec.scale, spec.softcap or 1.0, offset, left, right)
    return cfg, consts, scalars


_TRITON_TYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32"}


def _preprocess_launch(Dv, dtype, capability):
    """(tuning config, constexprs) of the backward's preprocess kernel."""
    cfg = triton_tuning.config(Dv, dtype, capability, "backward_preprocess")
    return cfg, dict(HEAD_DV=Dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_DV=_next_pow2(Dv))


def compile_only(capability, dtype, D, Dv=None, *, group=2, causal=True, window=False,
                 masks=True, softcap=True, bias_dtype="float32") -> dict:
    """Compile the four kernels for a CUDA target without a GPU (Triton's bundled
    ptxas) with the tuning table's configuration; returns {kind: shared memory bytes}.
    Catches compile errors and shared-memory overruns of table entries on machines
    without a GPU (``benchmarks/gpu.py --compile-only`` sweeps targets)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    Dv = D if Dv is None else Dv
    t = _TRITON_TYPES[dtype]
    cap = tuple(capability)
    target = GPUTarget("cuda", cap[0] * 10 + cap[1], 32)
    ptrs = {n: f"*{t}" for n in ("Q", "K", "V", "Out", "DO", "DK", "DV", "DQ")}
    ptrs.update(Lse="*fp32", Delta="*fp32", Keep="*u8", Drop="*u8",
                Bias=f"*{_TRITON_TYPES[bias_dtype]}", DS=f"*{_TRITON_TYPES[bias_dtype]}")
    kernels = _kernels(False)
    launches = {"forward": kernels._attn_fwd, "backward_preprocess": kernels._bwd_preprocess,
                "backward_dkdv": kernels._attn_bwd_dkdv, "backward_dq": kernels._attn_bwd_dq}
    shared = {}
    for kind, kern in launches.items():
        if kind == "backward_preprocess":
            cfg, consts = _preprocess_launch(Dv, dtype, cap)
        else:
            cfg = triton_tuning.config(max(D, Dv), dtype, cap, kind)
            consts = _constexprs(cfg, group=group, D=D, Dv=Dv, dtype=dtype,
                                 band=(window, causal or window), keep=masks, drop=masks,
                                 bias=masks, softcap=softcap, interpret=False,
                                 precision="ieee")
            if kind == "backward_dq":
                consts["WRITE_DS"] = masks
        sig = {a: "constexpr" if a in consts else ptrs.get(a, "fp32" if a in ("sm_scale", "softcap") else "i32")
               for a in kern.arg_names}
        src = ASTSource(kern, sig, constexprs=consts)
        compiled = triton.compile(src, target=target,
                                  options=dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                               **_FP_FUSION))
        shared[kind] = compiled.metadata.shared
    return shared


def _full(x, shape):
    """x broadcast to shape (a view)."""
    return x.broadcast_to(shape)


def forward(spec):
    """(out, lse): out (*batch, H, L, Dv) in q's dtype, lse (*batch, H, L) float32
    (natural log; -inf on fully masked rows, whose out is 0)."""
    import torch
    B, H, Hkv, L, S = spec.batch, spec.H, spec.Hkv, spec.L, spec.S
    q = _full(spec.q, B + (H, L, spec.D))
    k = _full(spec.k, B + (Hkv, S, spec.D))
    v = _full(spec.v, B + (Hkv, S, spec.Dv))
    out = torch.empty(spec.out_shape, dtype=spec.q.dtype, device=spec.q.device)
    lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=spec.q.device)
    keep, drop, bias = _masks(spec)
    cfg, consts, scalars = _common(spec, "forward")
    kern = _kernels()._attn_fwd
    with _device_guard(spec.q):
        for nb, (q_, k_, v_, o_, l_, kp, dp, bs) in _launches(B, [q, k, v, out, lse, keep, drop, bias], H):
            grid = (triton.cdiv(L, cfg["BLOCK_M"]), nb * H)
            kern[grid](q_, k_, v_, o_, l_, kp if kp is not None else q_,
                       dp if dp is not None else q_, bs if bs is not None else q_,
                       *q_.stride(), *k_.stride(), *v_.stride(), *o_.stride(), *l_.stride(),
                       *_strides(kp, 4), *_strides(dp, 4), *_strides(bs, 4),
                       H, L, S, *scalars, **consts)
    return out, lse


def _grad_buffer(x_full_shape, x, acc_dtype):
    """A buffer for a gradient over the full broadcast shape: x's dtype when no sum over
    broadcast dims follows, else the accumulation dtype."""
    import torch
    reduce = math.prod(x_full_shape) != x.numel()
    dtype = acc_dtype if reduce else x.dtype
    return torch.empty(x_full_shape, dtype=dtype, device=x.device)


def backward(spec, dout, out, lse, dlse=None, need_dbias=True):
    """(dq, dk, dv, dbias) from the given out and lse (DESIGN.md: weights =
    exp(scores - lse), Jacobian term rowsum(dout ∘ out), minus ``dlse`` when a
    gradient for lse is given); dq, dk, dv reduced to the
    user's q, k, v shapes in their dtype; dbias reduced to bias's shape in bias's dtype,
    None without bias or when ``need_dbias`` is False. Fully masked rows (lse -inf)
    contribute zero gradients."""
    import torch
    from ...spec import reduce_to
    B, H, Hkv, L, S, D, Dv = spec.batch, spec.H, spec.Hkv, spec.L, spec.S, spec.D, spec.Dv
    dev = spec.q.device
    q = _full(spec.q, B + (H, L, D))
    k = _full(spec.k, B + (Hkv, S, D))
    v = _full(spec.v, B + (Hkv, S, Dv))
    dout = _full(dout.to(spec.q.dtype), spec.out_shape)   # no copy when already q's dtype
    out = _full(out, spec.out_shape)
    lse = lse.to(device=dev, dtype=torch.float32).broadcast_to(spec.lse_shape)
    delta = torch.empty(spec.lse_shape, dtype=torch.float32, device=dev)
    keep, drop, bias = _masks(spec)
    f32 = torch.float32
    dq = _grad_buffer(B + (H, L, D), spec.q, f32)
    dk = _grad_buffer(B + (Hkv, S, D), spec.k, f32)
    dv = _grad_buffer(B + (Hkv, S, Dv), spec.v, f32)
    write_ds = spec.bias is not None and need_dbias
    ds = None
    if write_ds:
        full = spec.bias.numel() == math.prod(spec.score_shape)
        ds = torch.zeros(spec.score_shape, dtype=spec.bias.dtype if full else f32, device=dev)
    k_ = _kernels()
    cap = _capability(dev)

    with _device_guard(spec.q):
        pre, consts = _preprocess_launch(Dv, spec.dtype, cap)
        for nb, (o_, do_, de_) in _launches(B, [out, dout, delta], H):
            k_._bwd_preprocess[(triton.cdiv(L, pre["BLOCK_M"]), nb * H)](
                o_, do_, de_, *o_.stride(), *do_.stride(), *de_.stride(), H, L, **consts,
                num_warps=pre["num_warps"], num_stages=pre["num_stages"], **_FP_FUSION)

        if dlse is not None:                        # d lse / d scores = weights
            delta -= dlse.to(device=dev, dtype=torch.float32)
        cfg, consts, scalars = _common(spec, "backward_dkdv")
        tensors = [q, k, v, dout, lse, delta, dk, dv, keep, drop, bias]
        for nb, (q_, k2, v_, do_, l_, de_, dk_, dv_, kp, dp, bs) in _launches(B, tensors, Hkv):
            k_._attn_bwd_dkdv[(triton.cdiv(S, cfg["BLOCK_N"]), nb * Hkv)](
                q_, k2, v_, do_, l_, de_, dk_, dv_, kp if kp is not None else q_,
                dp if dp is not None else q_, bs if bs is not None else q_,
                *q_.stride(), *k2.stride(), *v_.stride(), *do_.stride(), *l_.stride(),
                *dk_.stride(), *dv_.stride(),
                *_strides(kp, 4), *_strides(dp, 4), *_strides(bs, 4),
                Hkv, L, S, *scalars, **consts)

        cfg, consts, scalars = _common(spec, "backward_dq")
        tensors = [q, k, v, dout, lse, delta, dq, ds, keep, drop, bias]
        for nb, (q_, k2, v_, do_, l_, de_, dq_, ds_, kp, dp, bs) in _launches(B, tensors, H):
            k_._attn_bwd_dq[(triton.cdiv(L, cfg["BLOCK_M"]), nb * H)](
                q_, k2, v_, do_, l_, de_, dq_, ds_ if ds_ is not None else dq_,
                kp if kp is not None else q_, dp if dp is not None else q_,
                bs if bs is not None else q_,
                *q_.stride(), *k2.stride(), *v_.stride(), *do_.stride(), *l_.stride(),
                *dq_.stride(), *_strides(ds_, 4),
                *_strides(kp, 4), *_strides(dp, 4), *_strides(bs, 4),
                H, L, S, *scalars, WRITE_DS=write_ds, **consts)

    def finish(g, x):                               # sum over broadcast dims, back to x's dtype
        return reduce_to(g, spec.shapes[x]).to(getattr(spec, x).dtype)

    dbias = None
    if write_ds:
        dbias = reduce_to(ds, spec.shapes["bias"]).to(spec.bias.dtype)
    return finish(dq, "q"), finish(dk, "k"), finish(dv, "v"), dbias
