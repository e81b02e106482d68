"""Host side of the Triton kernels: what they support, and the launches of
``forward`` and ``backward`` (the kernels are in ``forward.py`` and ``backward.py``,
their shared device functions in ``device.py``, the jit wrapping in ``jit.py``).

The whole contract, in DESIGN.md §2's order: scores = scale·q kᵀ, softcap, + bias,
− ALiBi slope·|diag(i) − j| (per tile, never an L × S array), then keep / drop /
causal / window / lengths set −inf; softmax with an optional sink logit; dropout
(Philox, bit-identical to ``attnkit.philox``); out = weights v. Causal and window are
one band ``diag(i) − LEFT <= j <= diag(i) + RIGHT`` (``attnkit.spec.geometry.band``)
with ``diag(i) = i + sigma`` (``geometry.Segment``), per sequence. Tiles wholly
outside the band or past a sequence's end are skipped through the loop bounds; tiles
wholly inside run without the index mask; only the tiles crossing an edge compute
it. keep / drop / bias are read per tile through their broadcast strides (stride 0
on broadcast dims): never expanded in memory.

Sequences: ``q_lengths`` / ``kv_lengths`` / ``kv_starts`` are read on the device (no
host sync); a sequence's keys before its start keep their places (they are excluded
and get gradients of 0).
A block of a larger problem (``Spec.origin`` / ``extent``, as ring attention makes
them) uses global positions: the diagonal of ``geometry.segments`` (the global
sequence's, shifted by origin[0] − origin[1]), the global lengths translated to the
block on the device (``device._sequence``), and dropout's Philox counters at global
row i + origin[0], key j + origin[1]; packed sequences in a block are refused with
a reason.
Packed sequences (``cu_seqlens_q/k``) run one grid over (sequence · head) with as
many query (key) blocks as the longest sequence has: that maximum is read on the
host, one device-to-host copy (a sync) per forward and per backward call.

The NaN rule (DESIGN.md §2, ``attnkit.nonfinite``): a NaN or inf reaching a row's
softmax makes the row NaN on its own; the products whose left side is 0 on excluded
pairs (p·v forward; pᵀ·dout, dSᵀ·q, dS·k backward) are exempt products: a
non-finite right-operand entry reaches a result only through a visible pair, and
then makes it NaN. Each kernel is launched twice, a plain and a careful variant; the
largest magnitude of the products' right operands (v forward; q, k, dout backward),
one torch reduction each on the device, tells each launch whether it runs (no host
sync), so finite inputs take the plain code and pay those reductions and one
launch whose programs return at once. Weights are 0 wherever the score is −inf
(even when lse is NaN) and so is the score gradient: excluded pairs give exactly 0.

Every output element is written by exactly one program and no atomics are used, so
results are bit-for-bit deterministic.

Head dims up to 256; D and Dv that are not powers of two are padded inside the
kernel (``tl.arange`` over the next power of two, masked loads and stores). float16,
bfloat16 and float32 inputs; float32 dots run in IEEE fp32 (tf32 only when
``torch.get_float32_matmul_precision()`` is not "highest", as for torch matmuls).

Numerics: scores, softmax statistics and every accumulator are float32. In the
backward, the weights p and score gradients dS enter the half-precision tensor-core
dots as two parts, hi + lo (``SPLIT`` in ``tuning``, on by default for the backward
kinds): rounding them once, as FlashAttention-2 does, puts dq, dk and dv above
DESIGN.md's 2× rule on random inputs. The forward rounds p once (its error stays
inside the rule: the output's final rounding dominates). Under ``TRITON_INTERPRET=1``
the kernels round fp32 → bf16 to nearest and dot in fp32 themselves (``_cast``,
``_mm``): the interpreter truncates and multiplies bf16 bit patterns.

Memory: forward O(B·H·L·(D + Dv)) for out and lse, nothing L × S. Backward adds delta
(B·H·L float32) and, only when bias is given and its gradient is asked, one
(..., H, L, S) dS buffer (in bias's dtype when bias is full size, else float32, summed
to bias's shape afterwards). dq/dk/dv get a float32 (..., H|Hkv, L|S, D) buffer only
when q/k/v are broadcast over batch dims (the sum over them is then a torch reduction).
"""

import itertools
import math

from ... import philox
from ...reference import sink_gradient
from ...spec import geometry, reduce_to
from . import tuning as triton_tuning
from .jit import FP_FUSION, IMPORT_ERROR, interpreting, kernels, triton

MAX_HEAD_DIM = 256
DTYPES = ("float16", "bfloat16", "float32")
GRID_Y = 65535                                      # CUDA's limit on grid axis 1


# ---- what runs here ------------------------------------------------------------------
def available():
    """None when Triton can run here, else the reason (for ``attnkit info``)."""
    if triton is None:
        return f"triton is not installed ({IMPORT_ERROR})"
    import torch
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU, slowly)"
    return None


def not_supported_reasons(spec) -> list:
    """Why these kernels cannot run this call; empty when they can."""
    if triton is None:
        return [f"triton is not installed ({IMPORT_ERROR})"]
    if not spec.torch:
        return ["takes torch tensors"]
    why = []
    if spec.dtype not in DTYPES:
        why.append(f"dtype {spec.dtype} is not supported by the Triton kernels (float16, bfloat16, float32)")
    if max(spec.D, spec.Dv) > MAX_HEAD_DIM:
        why.append(f"head dim D={spec.D}, Dv={spec.Dv} exceeds {MAX_HEAD_DIM}")
    if spec.block:
        why += _block_reasons(spec)
    kind = spec.q.device.type
    if kind == "cpu":
        if not interpreting():
            why.append("CPU tensors need TRITON_INTERPRET=1 (Triton's interpreter)")
    elif kind != "cuda":
        why.append(f"device {kind} is not supported (CUDA, or CPU with TRITON_INTERPRET=1)")
    return why


def _block_reasons(spec):
    """Why a block of a larger problem (Spec.origin / extent) cannot run here."""
    (r, c), (L, S) = spec.origin, spec.extent
    why = []
    if spec.packed:
        why.append("packed sequences (cu_seqlens) in a block of a larger problem (Spec.origin) are not "
                   "supported by the Triton kernels")
    if min(r, c) < 0 or r + spec.L > L or c + spec.S > S:
        why.append(f"block rows [{r}, {r + spec.L}) / keys [{c}, {c + spec.S}) lie outside its extent {(L, S)}")
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


def _next_pow2(n):
    return max(16, 1 << (n - 1).bit_length())       # tl.dot needs every block dim >= 16


def _s32(x):
    """A 32-bit word as the signed int32 Triton passes (the kernels reinterpret it)."""
    return x - (1 << 32) if x >= 1 << 31 else x


# ---- operands --------------------------------------------------------------------------
def _full(x, shape):
    """x broadcast to shape (a view)."""
    return x.broadcast_to(shape)


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


def _terms(spec):
    """(slopes, sinks, q_lengths, kv_lengths, kv_starts) as kernel operands, None when
    absent: float32 slopes broadcast to batch + (H,), float32 sinks to batch + (H, L),
    int32 lengths and starts to batch (the small arrays are converted, never the
    score-sized ones)."""
    import torch

    def conv(x, dtype, shape):
        return None if x is None else x.to(dtype).broadcast_to(shape)

    return (conv(spec.alibi_slopes, torch.float32, spec.batch + (spec.H,)),
            conv(spec.sinks, torch.float32, spec.lse_shape),
            conv(spec.q_lengths, torch.int32, spec.batch), conv(spec.kv_lengths, torch.int32, spec.batch),
            conv(spec.kv_starts, torch.int32, spec.batch))


class _Packed:
    """cu_seqlens as int32 device arrays, the number of sequences and the longest
    query and key sequence (read on the host: they size the grid)."""

    def __init__(self, spec):
        import torch
        self.cu_q = spec.cu_seqlens_q.to(torch.int32).contiguous()
        self.cu_k = spec.cu_seqlens_k.to(torch.int32).contiguous()
        self.n = self.cu_q.shape[0] - 1
        lengths = torch.stack([self.cu_q[1:] - self.cu_q[:-1], self.cu_k[1:] - self.cu_k[:-1]])
        self.max_q, self.max_k = (int(x) for x in lengths.amax(dim=1).tolist())   # the one host sync


def _finite(*xs):
    """max |x| over the tensors as a float32 0-d tensor on their device: NaN or inf
    when some entry is not finite (one reduction each, no host sync)."""
    import torch
    norms = [torch.linalg.vector_norm(x, ord=float("inf")).float() for x in xs]
    return norms[0] if len(norms) == 1 else torch.stack(norms).amax()


def _launches(batch, tensors, heads):
    """Split the leading batch dims into kernel launches of one flat batch dim.

    ``tensors`` all have shape batch + tail (broadcast views; None allowed). Batch dims
    of size 1 are dropped and adjacent dims merged when every tensor's strides allow
    it (as torch's TensorIterator does), so the common cases are one launch; what
    cannot merge is looped over here. Each launch gets views of shape (nb,) + tail
    with nb · heads within CUDA's grid limit. Yields (nb, n0, views), n0 the flat
    index in ``batch`` of the launch's first element (dropout counts it)."""
    sizes = list(batch)
    present = [t for t in tensors if t is not None]
    nd = len(batch)
    merged = []                                     # [(size, [stride per present tensor])]
    for d in (d for d in range(nd) if sizes[d] != 1):
        st = [t.stride(d) for t in present]
        if merged and all(ms == s * sizes[d] for ms, s in zip(merged[-1][1], st)):
            merged[-1] = (merged[-1][0] * sizes[d], st)
        else:
            merged.append((sizes[d], st))
    if not merged:
        merged = [(1, [0] * len(present))]
    outer, (inner, inner_st) = merged[:-1], merged[-1]
    chunk = max(1, GRID_Y // heads)                 # grid axis 1 holds nb · heads programs
    for flat, idx in enumerate(itertools.product(*(range(n) for n, _ in outer))):
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
            yield nb, flat * inner + b0, views


def _programs(spec, packed, tensors, heads):
    """The launches of one kernel: yields (programs on grid axis 1, N0, SEQ0, views).
    Dense: one program per (batch element, head); packed: per (sequence, head)."""
    for nb, n0, views in _launches(spec.batch, tensors, heads):
        if packed is None:
            yield nb * heads, n0, 0, views
            continue
        chunk = max(1, GRID_Y // heads)
        for s0 in range(0, packed.n, chunk):
            yield min(chunk, packed.n - s0) * heads, 0, s0, views


def _strides(t, n):
    return tuple(t.stride()) if t is not None else (0,) * n


def _or(t, dummy):
    return t if t is not None else dummy


def op(t, n=None, dummy=None):
    """A kernel operand: the tuple (pointer, its n strides) the kernels take for each
    tensor (``*_op`` parameters). An absent tensor (None) is ``dummy`` with zero
    strides: the kernels never read it (its HAS_* flag is off)."""
    return (_or(t, dummy),) + (_strides(t, n) if n is not None else tuple(t.stride()))


def _device_guard(x):
    """The tensors' CUDA device as the current one; on the CPU (the interpreter, whose
    kernels are NumPy operations), NumPy's warnings off: inf − inf in a NaN row is
    the NaN rule at work, and a GPU warns of nothing."""
    import torch
    if x.device.type == "cuda":
        return torch.cuda.device(x.device)
    import numpy as np
    return np.errstate(all="ignore")


# ---- launch parameters ---------------------------------------------------------------
def _constexprs(cfg, kind, *, group, D, Dv, dtype, band, keep, drop, bias, softcap, alibi, sinks, dropout,
                lengths, starts, packed, bottom_right, interpret, precision):
    """The compile-time parameters of the attention kernels (sinks: the forward's only)."""
    has_left, has_right = band
    consts = dict(GROUP=group, HEAD_D=D, HEAD_DV=Dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                  BLOCK_D=_next_pow2(D), BLOCK_DV=_next_pow2(Dv), HAS_LEFT=has_left, HAS_RIGHT=has_right,
                  HAS_KEEP=keep, HAS_DROP=drop, HAS_BIAS=bias, HAS_SOFTCAP=softcap, HAS_ALIBI=alibi,
                  HAS_DROPOUT=dropout, HAS_QLEN=lengths[0], HAS_KLEN=lengths[1], HAS_KSTART=starts, PACKED=packed,
                  BOTTOM_RIGHT=bottom_right, SPLIT=bool(cfg["SPLIT"]) and dtype != "float32",
                  INTERPRET=interpret, PRECISION=precision)
    if kind == "forward":
        consts["HAS_SINKS"] = sinks
    return consts


def _offset(spec):
    """The kernels' OFFSET (device._sequence): the diagonal of geometry.segments in the
    call's own coordinates (a block of a larger problem: the global sequence's, shifted
    by origin[0] − origin[1]), less what the kernels read on the device. Without
    lengths it is the whole diagonal; with them, bottom-right, the kernels add
    kv_len − q_len (global lengths) and OFFSET holds the global size standing in for
    a length not given, and the shift. Packed sequences: unused."""
    if spec.packed:
        return 0
    if not spec.varlen:
        seg = geometry.segments(spec, (0,) * len(spec.batch))   # dense: the same for every element
        return seg[0].sigma if seg else 0
    r, c = spec.origin
    L, S = spec.extent if spec.extent is not None else (spec.L, spec.S)
    if spec.align != "bottom_right":
        return r - c                                # top-left: the global sigma is 0
    return (0 if spec.kv_lengths is not None else S) - (0 if spec.q_lengths is not None else L) + r - c


def _common(spec, kind):
    """(tuning config, constexprs, scalars) shared by the launches of one kernel:
    scalars are (sm_scale, softcap, OFFSET, ROW0, COL0, LEFT, RIGHT, seed_lo,
    seed_hi, drop_threshold, drop_scale) in the kernels' order."""
    left, right = geometry.band(spec.causal, spec.window)
    cap = _capability(spec.q.device)
    cfg = triton_tuning.config(max(spec.D, spec.Dv), spec.dtype, cap, kind)
    consts = _constexprs(cfg, kind, group=spec.group, D=spec.D, Dv=spec.Dv, dtype=spec.dtype,
                         band=(left is not None, right is not None), keep=spec.keep is not None,
                         drop=spec.drop is not None, bias=spec.bias is not None,
                         softcap=spec.softcap is not None, alibi=spec.alibi_slopes is not None,
                         sinks=spec.sinks is not None, dropout=spec.dropout > 0,
                         lengths=(spec.q_lengths is not None, spec.kv_lengths is not None),
                         starts=spec.kv_starts is not None, packed=spec.packed,
                         bottom_right=spec.align == "bottom_right", interpret=interpreting(),
                         precision=_precision(spec))
    consts.update(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **FP_FUSION)
    scalars = (spec.scale, spec.softcap or 1.0, _offset(spec), *spec.origin, left or 0, right or 0,
               *_dropout_scalars(spec))
    return cfg, consts, scalars


def _dropout_scalars(spec):
    """(seed_lo, seed_hi, drop_threshold, drop_scale), the kernels' last scalars (the
    Philox key from the seed; unused without dropout)."""
    key0, key1 = philox.key(int(spec.seed or 0))
    return _s32(key0), _s32(key1), _s32(philox.threshold(spec.dropout)), 1.0 / (1.0 - spec.dropout)


def _preprocess_launch(Dv, dtype, capability):
    """(tuning config, constexprs) of the backward's preprocess kernel."""
    cfg = triton_tuning.config(Dv, dtype, capability, "backward_preprocess")
    return cfg, dict(HEAD_DV=Dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_DV=_next_pow2(Dv))


# ---- forward and backward --------------------------------------------------------------
def forward(spec):
    """(out, lse): out (*batch, H, L, Dv) in q's dtype, lse (*batch, H, L) float32
    (natural log; -inf on fully masked and padding rows, whose out is 0; the sink's
    logit on rows whose keys are all excluded)."""
    import torch
    B, H, Hkv, L, S = spec.batch, spec.H, spec.Hkv, spec.L, spec.S
    q = _full(spec.q, B + (H, L, spec.D))
    k = _full(spec.k, B + (Hkv, S, spec.D))
    v = _full(spec.v, B + (Hkv, S, spec.Dv))
    out = torch.empty(spec.out_shape, dtype=spec.q.dtype, device=spec.q.device)
    lse = torch.empty(spec.lse_shape, dtype=torch.float32, device=spec.q.device)
    packed = _Packed(spec) if spec.packed else None
    cu = (packed.cu_q, packed.cu_k) if packed else (q, q)
    finite = _finite(spec.v)
    cfg, consts, scalars = _common(spec, "forward")
    blocks = triton.cdiv(packed.max_q if packed else L, cfg["BLOCK_M"])
    kern = kernels()._attn_fwd
    tensors = [q, k, v, out, lse, *_masks(spec), *_terms(spec)]
    with _device_guard(spec.q):
        for n, n0, s0, (q_, k_, v_, o_, l_, kp, dp, bs, sl, sk, ql, kl, ks) in _programs(spec, packed, tensors, H):
            for careful in (False, True):
                kern[(blocks, n)](
                    op(q_), op(k_), op(v_), op(o_), op(l_), op(kp, 4, q_), op(dp, 4, q_), op(bs, 4, q_),
                    op(sl, 2, l_), op(sk, 3, l_), op(ql, 1, cu[0]), op(kl, 1, cu[0]), op(ks, 1, cu[0]), *cu, finite,
                    H, L, S, n0, s0, *scalars, CAREFUL=careful, **consts)
    return out, lse


def _grad_buffer(x_full_shape, x, acc_dtype):
    """A buffer for a gradient over the full broadcast shape: x's dtype when no sum over
    broadcast dims follows, else the accumulation dtype."""
    import torch
    reduce = math.prod(x_full_shape) != x.numel()
    dtype = acc_dtype if reduce else x.dtype
    return torch.empty(x_full_shape, dtype=dtype, device=x.device)


def backward(spec, dout, out, lse, dlse=None, need_dbias=True):
    """(dq, dk, dv, dbias, dsinks) from the given out and lse (DESIGN.md: weights =
    exp(scores - lse), Jacobian term rowsum(dout ∘ out), minus ``dlse`` when a
    gradient for lse is given); dq, dk, dv reduced to the user's q, k, v shapes in
    their dtype; dbias reduced to bias's shape in bias's dtype (None without bias or
    when ``need_dbias`` is False); dsinks to sinks' (None without sinks). Fully
    masked and padding rows contribute zero gradients."""
    import torch
    B, H, Hkv, L, S, D, Dv = spec.batch, spec.H, spec.Hkv, spec.L, spec.S, spec.D, spec.Dv
    dev = spec.q.device
    q = _full(spec.q, B + (H, L, D))
    k = _full(spec.k, B + (Hkv, S, D))
    v = _full(spec.v, B + (Hkv, S, Dv))
    dout = dout.to(spec.q.dtype)                    # no copy when already q's dtype
    finite = _finite(spec.q, spec.k, dout)
    dout = _full(dout, spec.out_shape)
    out = _full(out, spec.out_shape)
    # contiguous, as delta: the kernels read both with lse's strides (a slice of a larger lse, as ring
    # attention hands its blocks, has others)
    lse = lse.to(device=dev, dtype=torch.float32).broadcast_to(spec.lse_shape).contiguous()
    delta = torch.empty(spec.lse_shape, dtype=torch.float32, device=dev)
    masks = _masks(spec)
    slopes, _, qlen, klen, kstart = _terms(spec)
    packed = _Packed(spec) if spec.packed else None
    cu = (packed.cu_q, packed.cu_k) if packed else (q, q)
    f32 = torch.float32
    dq = _grad_buffer(B + (H, L, D), spec.q, f32)
    dk = _grad_buffer(B + (Hkv, S, D), spec.k, f32)
    dv = _grad_buffer(B + (Hkv, S, Dv), spec.v, f32)
    write_ds = spec.bias is not None and need_dbias
    ds = None
    if write_ds:
        full = spec.bias.numel() == math.prod(spec.score_shape)
        ds = torch.zeros(spec.score_shape, dtype=spec.bias.dtype if full else f32, device=dev)
    kern = kernels()
    cap = _capability(dev)

    with _device_guard(spec.q):
        pre, consts = _preprocess_launch(Dv, spec.dtype, cap)
        for nb, _, (o_, do_, de_) in _launches(B, [out, dout, delta], H):
            kern._bwd_preprocess[(triton.cdiv(L, pre["BLOCK_M"]), nb * H)](
                op(o_), op(do_), op(de_), H, L, **consts,
                num_warps=pre["num_warps"], num_stages=pre["num_stages"], **FP_FUSION)
        if dlse is not None:                        # d lse / d scores = weights
            delta -= dlse.to(device=dev, dtype=torch.float32)

        cfg, consts, scalars = _common(spec, "backward_dkdv")
        blocks = triton.cdiv(packed.max_k if packed else S, cfg["BLOCK_N"])
        tensors = [q, k, v, dout, lse, delta, dk, dv, *masks, slopes, qlen, klen, kstart]
        for n, n0, s0, (q_, k2, v_, do_, l_, de_, dk_, dv_, kp, dp, bs, sl, ql, kl, ks) in \
                _programs(spec, packed, tensors, Hkv):
            for careful in (False, True):
                kern._attn_bwd_dkdv[(blocks, n)](
                    op(q_), op(k2), op(v_), op(do_), op(l_), de_, op(dk_), op(dv_), op(kp, 4, q_), op(dp, 4, q_),
                    op(bs, 4, q_), op(sl, 2, l_), op(ql, 1, cu[0]), op(kl, 1, cu[0]), op(ks, 1, cu[0]), *cu, finite,
                    Hkv, L, S, n0, s0, *scalars, CAREFUL=careful, **consts)

        cfg, consts, scalars = _common(spec, "backward_dq")
        blocks = triton.cdiv(packed.max_q if packed else L, cfg["BLOCK_M"])
        tensors = [q, k, v, dout, lse, delta, dq, ds, *masks, slopes, qlen, klen, kstart]
        for n, n0, s0, (q_, k2, v_, do_, l_, de_, dq_, ds_, kp, dp, bs, sl, ql, kl, ks) in \
                _programs(spec, packed, tensors, H):
            for careful in (False, True):
                kern._attn_bwd_dq[(blocks, n)](
                    op(q_), op(k2), op(v_), op(do_), op(l_), de_, op(dq_), op(ds_, 4, dq_), op(kp, 4, q_),
                    op(dp, 4, q_), op(bs, 4, q_), op(sl, 2, l_), op(ql, 1, cu[0]), op(kl, 1, cu[0]), op(ks, 1, cu[0]),
                    *cu, finite,
                    H, L, S, n0, s0, *scalars, WRITE_DS=write_ds, CAREFUL=careful, **consts)

    def finish(g, x):                               # sum over broadcast dims, back to x's dtype
        return reduce_to(g, spec.shapes[x]).to(getattr(spec, x).dtype)

    dbias = reduce_to(ds, spec.shapes["bias"]).to(spec.bias.dtype) if write_ds else None
    dsinks = None if spec.sinks is None else sink_gradient(spec, lse, delta).to(spec.sinks.dtype)
    return finish(dq, "q"), finish(dk, "k"), finish(dv, "v"), dbias, dsinks
