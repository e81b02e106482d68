"""The small rung: a small call in one vectorised pass over every head at once.

A decoding step of a small model (B=4, 8 heads, one query, 45 keys) or a short
prefill holds a few thousand scores: there the flash rung's planning and thread
hand-offs, and the reference's NumPy reductions over short rows, cost many times the
arithmetic. ``backend="auto"`` runs this rung when all score matrices together hold
at most ``backends.SMALL_TOTAL`` elements and the keys and values (a paged cache's
too, which this rung gathers first) at most ``backends.SMALL_KV``::

    s = q kᵀ · scale         one product for all heads: a GQA group's query heads are
                             stacked on their key-value head (no copy of k or v)
    softcap, bias, ALiBi     on the whole (..., H, L, S) array, in DESIGN.md §2's order
    keep / drop              −inf where excluded
    p = exp(s − m) per row   the flash rung's compiled row softmax (causal, window and
                             lengths as per-row key bounds: no L × S mask); a sink
                             logit starts each row's max and sum
    dropout                  p · kept / (1 − p), the reference's Philox draws
    out = p v / l            one product; lse = m + log l; the flash rung's finish
                             (no key: out 0, lse −inf; the NaN rule)

Values with a NaN or inf take the reference's forward (their exempt product). A
call of few query rows per kv head (``group · L`` ≤ STREAM_ROWS: decoding, speculative
steps; or a short prefill under a causal band, rows × keys ≤ STREAM_BANDED) in float32
without bias, keep, drop, ALiBi or dropout runs instead as one
compiled call over every batch element and head (:mod:`attnkit.flash.numba_small`:
the same steps, the bounds per row, a key whose score is −inf never read): in a
decoding step of a small model the NumPy calls above cost 23 µs, this call 14; a kept
call of TEAM_WORK or more (a short prefill) runs its (batch element, kv head) units on
torch's OpenMP team where it can (1.6× as fast on 2 cores, the same bits). Such
a call that repeats its signature (every layer, every step) runs without validation:
:func:`attnkit.api.attention` keeps :func:`direct`'s prepared call for it (torch
tensors: :func:`direct_at`'s, on their memory). The
backward is the flash rung's, the weights the reference's; KV-cache decoding reads
the reference's gathered keys (a paged cache's float32 keys the compiled call
gathers), and a float32 decoding loop runs its later calls whole, append included, as
one compiled call (:func:`kvcache_step`; torch tensors: :func:`kvcache_at`'s, on their
memory). No packed sequences or blocks
of a larger problem: ``auto`` gives those to the flash rung.

>>> import numpy as np
>>> from attnkit import small
>>> from attnkit.spec import validate
>>> q, k, v = np.random.default_rng(0).standard_normal((3, 2, 4, 5))
>>> out, lse, _ = small.rung_forward(validate(q, k, v, causal=True))
>>> out.shape, lse.shape
((2, 4, 5), (2, 4))
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from math import prod
from typing import Any

import numpy as np

from . import flash, reference
from .backends import Grads, key_range
from .flash import kernels, runtime
from .flash.forward import finish
from .flash.kernels import for_dtype
from .flash.plan import unit_rows
from .nonfinite import all_finite, quiet
from .spec import Spec, dtype_name
from .spec import geometry as geo

name = "small"


def not_supported_reasons(spec: Spec) -> list[str]:
    r = reference.not_supported_reasons(spec)
    if spec.packed:
        r.append("no packed sequences (cu_seqlens: the reference and flash rungs)")
    if spec.block:
        r.append("whole problems only (ring attention's blocks run on the flash rung)")
    return r


def _sink_state(spec: Spec, dtype: Any, sinks: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Each row's running (max, sum) before its keys, rows in (..., H, L) order: the
    sink is one more score with value 0 (its exp joins the sum, not the output).
    ``sinks``: this call's, in the normal form of spec's (a kept call's; else spec's)."""
    shape = spec.lse_shape
    sinks = spec.sinks if sinks is None else sinks
    if sinks is None:
        return np.full(shape, -np.inf, dtype=dtype).ravel(), np.zeros(shape, dtype=dtype).ravel()
    m = np.array(np.broadcast_to(np.asarray(sinks, dtype=dtype), shape)).ravel()
    shift = np.where(m == -np.inf, 0.0, m)
    with quiet():                                      # (no warning: the NaN rule's NaN)
        return m, np.exp(m - shift).astype(dtype)      # a +inf or NaN sink: NaN


# each row's key bounds by the call's geometry, for calls without lengths (a prefill
# repeats its geometry in every layer): (lse shape, S, causal, window, align) -> (lo, hi)
_BOUNDS: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray]] = {}
_BOUNDS_ROWS = 1 << 16     # rows of a call whose bounds are kept (two int64 arrays each)


def _row_bounds(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi): the keys [lo, hi) each query row sees, flat in (..., H, L) order; made
    once per geometry when the call gives no lengths (22 of a 32 × 32 causal call's
    146 µs), else every call. The kernel only reads them."""
    key = None
    if not spec.varlen and prod(spec.lse_shape) <= _BOUNDS_ROWS:
        key = (spec.lse_shape, spec.S, spec.causal, spec.window, spec.align)
        hit = _BOUNDS.get(key)
        if hit is not None:
            return hit
    lo, hi = (geo.filled(x, spec.lse_shape).ravel() for x in geo.dense_row_bounds(spec))
    if key is not None:
        if len(_BOUNDS) >= 64:
            _BOUNDS.clear()
        _BOUNDS[key] = (lo, hi)
    return lo, hi


# query rows per kv head (group · L) up to which a call streams: against the products,
# 1.0–2.1× as fast at 1 to 8 rows (45–1024 keys); with the vector passes 1.02–1.74× at
# 16 (8 shapes, causal or not), 0.6–1.3× at 32 to 128 (an Intel Xeon host). Rows that
# a causal band or window cuts (a short prefill) stream up to STREAM_BANDED rows × keys
# per kv head: there the compiled call skips the excluded keys the products compute,
# 1.00–1.43× the products in all 10 such shapes tried (32–128 rows, 32–128 keys, D 32–128;
# the row passes in vectors), 0.80–0.83× at 64 rows × 512–1,024 keys
STREAM_ROWS = 16
STREAM_BANDED = 1 << 14


def streams(spec: Spec, kern: Any, S: int | None = None) -> bool:
    """Whether :func:`forward` runs the call in one compiled call (:func:`streamer`):
    few query rows per kv head (at most STREAM_ROWS, or rows × keys at most
    STREAM_BANDED under a causal band or window; S: the key length, spec's if None),
    float32 kernels, and none of bias, keep, drop, ALiBi or dropout."""
    rows = spec.group * spec.L
    return ((rows <= STREAM_ROWS or spec.has_index_mask and rows * (spec.S if S is None else S) <= STREAM_BANDED)
            and getattr(kern, "small_rows", None) is not None and spec.bias is None and spec.keep is None
            and spec.drop is None and spec.alibi_slopes is None and spec.dropout == 0)


def streams_alone(spec: Spec, S: int | None = None, sinks: bool = False) -> bool:
    """Whether the call streams with q, k and v its only arrays (no sinks, no lengths;
    kv_starts, which only moves the rows' bounds, read as NumPy reads the caller's
    array): then a caller holding q, k, v in another array library passes NumPy views
    of them (the torch op's full path) or their addresses (its kept call,
    :func:`direct_at`). ``sinks``: sinks allowed too (a kept call reads each call's)."""
    return ((sinks or spec.sinks is None) and spec.q_lengths is None and spec.kv_lengths is None
            and not spec.packed and streams(spec, for_dtype(spec.acc_dtype), S))


def streamer(spec: Spec) -> Callable[..., tuple[np.ndarray, np.ndarray]]:
    """A decoding-like call (:func:`streams`) of spec's options and sizes, prepared:
    ``call(q, k, v) -> (out (..., H, L, Dv), lse (..., H, L))``, float32 C-ordered, on
    these q, k, v (NumPy arrays; the Spec's are not read, its sinks and lengths are; the
    key length is k's; ``call(q, k, v, sinks)``: these sinks, in the normal form of
    spec's) in one compiled call over every batch element and head
    (flash.numba_small.small_rows), finished there. What :func:`direct` keeps."""
    N, A, R, Dv, batch = prod(spec.batch), spec.Hkv, spec.group * spec.L, spec.Dv, spec.batch
    out_shape, lse_shape = spec.out_shape, spec.lse_shape
    scale, softcap = np.float32(spec.scale), np.float32(spec.softcap or 0.0)
    m, l = _NO_STATE, _NO_STATE
    if spec.sinks is not None:
        m, l = (x.reshape(N, A * R) for x in _sink_state(spec, np.float32))
    bounded = spec.has_index_mask or spec.varlen
    kernel = for_dtype("float32").small_rows

    def call(q: Any, k: Any, v: Any, sinks: Any = None) -> tuple[np.ndarray, np.ndarray]:
        lo = hi = _NO_BOUNDS
        if sinks is not None:
            m_, l_ = (x.reshape(N, A * R) for x in _sink_state(spec, np.float32, sinks))
        else:
            m_, l_ = m, l
        if bounded:
            S = k.shape[-2]
            lo, hi = (x.reshape(N, A * R) for x in _row_bounds(spec if S == spec.S else spec.replace(S=S)))
        out = np.empty(out_shape, dtype=np.float32)
        lse = np.empty(lse_shape, dtype=np.float32)
        # rows of unit stride, as the kernel reads them (its sums take one order whatever
        # the other strides: the same bits for any layout)
        kernel(_heads(q, batch, N, A), _heads(k, batch, N, A), _heads(v, batch, N, A), scale, softcap, lo, hi, m_, l_,
               out.reshape(N, A, R, Dv), lse.reshape(N, A, R), np.zeros(2, dtype=np.int64))
        return out, lse
    return call


def _settings() -> tuple[Any, ...]:
    """What :func:`streams` reads besides the call (replace them to change them)."""
    return STREAM_ROWS, STREAM_BANDED, kernels.USE_COMPILED


def _prepared(spec: Spec) -> tuple[Spec, int, int, tuple[Any, ...]] | None:
    """For :func:`direct` and :func:`direct_at`: (spec without its arrays, lo, hi,
    settings): a call of spec's signature with S keys streams while lo ≤ S ≤ hi and
    :func:`_settings` gives those settings; None unless spec streams alone
    (:func:`streams_alone`, sinks allowed: each call's are read) in float32."""
    if spec.dtype != "float32" or not streams_alone(spec, sinks=True):
        return None
    # no reference to this call's arrays; the starts copied (kept by their values, read
    # at every call: the caller may reuse its array)
    starts = None if spec.kv_starts is None else np.array(np.asarray(spec.kv_starts), dtype=np.int64)
    kept = spec.replace(q=None, k=None, v=None, kv_starts=starts, sinks=None)
    lo, hi = key_range(lambda S: streams_alone(kept, S), spec.S)
    if starts is not None:                               # fewer keys than a sequence's first: the
        lo = max(lo, int(starts.max()))                  # full path's error
    return kept, lo, hi, _settings()


def direct(spec: Spec) -> Callable[[Any, Any, Any, bool], tuple[np.ndarray, np.ndarray] | None] | None:
    """For calls that repeat spec's signature (:func:`attnkit.api.attention` keeps it):
    ``call(q, k, v, need_lse[, sinks])``, :func:`streamer`'s call on new q, k, v (and
    sinks where spec has them; NumPy arrays, not checked: the caller knows their
    signature is spec's; lse made whether needed or not), or None from it when the call
    no longer streams (settings changed since, or its key length); None unless spec
    streams alone (:func:`_prepared`) in float32."""
    made = _prepared(spec)
    if made is None:
        return None
    run, lo, hi, stamp = streamer(made[0]), *made[1:]
    shape = None if spec.sinks is None else spec.sinks.shape       # the sinks' normal form

    def call(q: Any, k: Any, v: Any, need_lse: bool, sinks: Any = None) -> tuple[np.ndarray, np.ndarray] | None:
        if not (lo <= k.shape[-2] <= hi and _settings() == stamp and (sinks is None) == (shape is None)):
            return None
        return run(q, k, v, None if shape is None else sinks.reshape(shape))
    return call


# the work (rows × keys × (D + Dv), all heads) from which a kept call's (batch element,
# kv head) units run on torch's team where it can take them (a short prefill: 4 × 8
# heads on 2 kv heads, 32 × 32 causal, D = 32 has 2.1 × 10⁶); below, a second thread's
# start costs more than it takes over (a decoding step has 10⁴–10⁵)
TEAM_WORK = 1 << 20


def sink_reads(spec: Spec) -> tuple[int, int, int] | None:
    """How a kept call on addresses reads each call's sinks (:func:`direct_at`): the
    (batch element, head, row) strides in elements of float32 sinks of spec's normal
    form stored C-ordered ((0, 0, 0) without sinks), or None where it cannot (another
    dtype; batch dims of the sinks partly broadcast)."""
    x = spec.sinks
    if x is None:
        return 0, 0, 0
    if dtype_name(x) != "float32":
        return None
    nb = len(spec.batch)
    shape = (1,) * (nb + 2 - len(x.shape)) + tuple(x.shape)
    Hs, Ls = shape[nb:]
    if shape[:nb] not in ((1,) * nb, spec.batch):
        return None
    return (0 if shape[:nb] == (1,) * nb else Hs * Ls), (Ls if Hs > 1 else 0), (1 if Ls > 1 else 0)


def _run_at(kept: Spec, reads: tuple[int, int, int], name: str = "small_rows_at") -> Callable[..., bool]:
    """The compiled call on addresses for calls of kept's signature (a Spec without its
    arrays): ``run(q, q_strides, k, k_strides, v, v_strides, S, out, out_strides, lse,
    lo, hi, sinks, *more) -> bool``, as :func:`direct_at` says (lo, hi: the addresses of the
    rows' key bounds, or 0; sinks: the sinks' address, read at strides ``reads``
    (:func:`sink_reads`), or 0), by :func:`.flash.numba_small.small_rows_at` (or the
    kernel ``name``, whose arguments are the same and ``more``); a call of TEAM_WORK or
    more on torch's OpenMP team (:func:`.flash.runtime.native_team`), one (batch
    element, kv head) at a time, with the same bits."""
    shapes = kept.out_shape, kept.Hkv, kept.shapes["q"], kept.shapes["k"], kept.shapes["v"]
    scale, softcap = np.float32(kept.scale), np.float32(kept.softcap or 0.0)
    kernels_ = for_dtype("float32")
    kernel, entry = getattr(kernels_, name), kernels_.small_units
    units = prod(kept.batch) * kept.Hkv
    per_key = units * kept.group * kept.L * (kept.D + kept.Dv)       # the call's work is per_key · S

    def run(q: int, q_strides: tuple[int, ...], k: int, k_strides: tuple[int, ...], v: int,
            v_strides: tuple[int, ...], S: int, out: int, out_strides: tuple[int, ...], lse: int, lo: int,
            hi: int, sinks: int, *more: Any) -> bool:
        team = n = 0
        if units > 1 and per_key * S >= TEAM_WORK:
            team, n = runtime.native_team(min(runtime.get_threads(), units))
        out_shape, A, q_shape, k_shape, v_shape = shapes
        return kernel(out_shape, A, S, q, q_shape, q_strides, k, k_shape, k_strides, v, v_shape, v_strides, out,
                      out_strides, lse, scale, softcap, lo, hi, sinks, reads, team, n, entry, *more) == 0
    return run


def direct_at(spec: Spec) -> Callable[..., bool] | None:
    """:func:`direct` for a caller whose arrays are another library's (the torch op):
    ``call(q, q_strides, k, k_strides, v, v_strides, S, out, out_strides, lse, sinks)
    -> bool`` with addresses of float32 memory and strides in elements (q, k, v of
    spec's shapes but for k's and v's key length S; out of its out shape, any strides;
    lse its lse shape, C-ordered, or 0; sinks of spec's sinks' shape, C-ordered, where
    it has them, else 0), by :func:`_run_at`. False, having written nothing, when
    the call no longer streams (as :func:`direct`) or its layout is not one the
    compiled call reads; None unless spec streams alone in float32 (sinks:
    :func:`sink_reads`)."""
    made, reads = _prepared(spec), sink_reads(spec)
    if made is None or reads is None:
        return None
    kept, lo_S, hi_S, stamp = made
    run = _run_at(kept, reads)
    # the rows' key bounds at the kept key length, made once (a prefill repeats it), their
    # addresses kept with them: the arrays' .ctypes costs a call 2–5 µs cold
    bounds = _row_bounds(kept) if spec.has_index_mask or spec.varlen else None
    at_kept = (0, 0) if bounds is None else (bounds[0].ctypes.data, bounds[1].ctypes.data)
    # the bounds at the last other key length, with their addresses: a model's layers
    # repeat one key length in a decoding step (one tuple, replaced whole: threads)
    last: list[Any] = [(kept.S, bounds, at_kept)]

    def call(q: int, q_strides: tuple[int, ...], k: int, k_strides: tuple[int, ...], v: int,
             v_strides: tuple[int, ...], S: int, out: int, out_strides: tuple[int, ...], lse: int,
             sinks: int) -> bool:
        if not (lo_S <= S <= hi_S and _settings() == stamp):
            return False
        lo_at, hi_at = at_kept
        if bounds is not None and S != kept.S:
            at = last[0]
            if at[0] != S:
                made = _row_bounds(kept.replace(S=S))
                at = last[0] = (S, made, (made[0].ctypes.data, made[1].ctypes.data))
            lo_at, hi_at = at[2]
        return run(q, q_strides, k, k_strides, v, v_strides, S, out, out_strides, lse, lo_at, hi_at, sinks)
    return call


# a band's bound no key reaches, for the relative bounds kvcache_at makes
_FAR = 1 << 62
# each thread's scratch for a paged cache's gathered keys (kvcache_at), kept up to
# SCRATCH_MAX elements (a larger call gathers into a new array, as every call once did:
# at 0.5M elements paging that in cost a step 772 µs against 87)
_SCRATCH = threading.local()
SCRATCH_MAX = 1 << 22
_NO_SCRATCH = np.zeros(0, dtype=np.float32)


def _scratch(n: int) -> np.ndarray:
    """This thread's float32 scratch of n elements at least (an empty array past
    SCRATCH_MAX: the kernel then makes its own)."""
    buf = getattr(_SCRATCH, "buf", _NO_SCRATCH)
    if buf.size < n:
        if n > SCRATCH_MAX:
            return _NO_SCRATCH
        buf = _SCRATCH.buf = np.empty(n, dtype=np.float32)
    return buf


def kvcache_at(spec: Spec, pages: tuple[int, int, int] | None = None) -> Callable[..., bool] | None:
    """attention_kvcache's kept call on a cache, the append included, for calls of
    spec's signature (the torch op's and :func:`kvcache_step`'s): ``call(q, q_strides,
    k, k_strides, v, v_strides, lengths, out, out_strides, lse, sinks, kind, step,
    L_new, k_new, kn_strides, v_new, vn_strides, table=0, t_kind=0, t_strides=(0, 0))
    -> bool``, addresses and strides as :func:`direct_at`'s, k and v the caches — a
    contiguous cache's (spec's key length, their capacity), or with ``pages`` (N, P, W) a
    paged cache's N pages of P keys, read through the block table (B, W) at ``table`` (int64
    where ``t_kind`` is 8, int32 where 4; strides in elements) —, lse 0 where not
    wanted; each sequence's keys before the append at ``lengths`` (``kind`` 8: int64
    ``step`` elements apart, 4: int32, 0: the int ``lengths`` itself for every
    sequence); L_new new keys and values per sequence at k_new and v_new (any strides
    but unit ones along D), written into their slots first — by
    :func:`.flash.numba_small.kvcache_rows_at`, which also makes the rows' key bounds
    from the lengths. False, having written nothing, where a length leaves no room, a
    page is one the full path refuses or checks further, the layout is not one the
    compiled call reads or the new keys lie in a cache's memory: the full path then
    checks and runs the call (False also where a unit on torch's team failed, the
    append done: the full path writes the same keys again). None unless spec, its
    lengths aside, streams alone in float32 (:func:`_prepared`, :func:`sink_reads`)."""
    made, reads = _prepared(spec.replace(kv_lengths=None)), sink_reads(spec)
    if made is None or reads is None or not made[1] <= spec.S <= made[2] or spec.q_lengths is not None \
            or spec.kv_starts is not None or (pages is not None and spec.S != pages[1] * pages[2]):
        return None
    kept, _, _, stamp = made
    run = _run_at(kept, reads, "kvcache_rows_at")
    N, P = pages[:2] if pages else (0, 0)
    need = prod(kept.batch) * kept.Hkv * kept.S * (kept.D + kept.Dv) if pages else 0    # the gathered keys
    # the band's bounds of each row i for a sequence of no keys, unclamped: they move
    # with a sequence's n keys by n where its rows align bottom-right (dense_row_bounds'
    # diagonal i + n − L), and are then clamped to [0, n) in the kernel
    shift = int(kept.align == "bottom_right")
    rel = geo.band_bounds(np.arange(kept.L, dtype=np.int64) - shift * kept.L, -_FAR, _FAR,
                          geo.band(kept.causal, kept.window))
    held = tuple(np.ascontiguousarray(x, dtype=np.int64) for x in rel)     # (alive as long as the call)
    at = held[0].ctypes.data, held[1].ctypes.data

    def call(q: int, q_strides: tuple[int, ...], k: int, k_strides: tuple[int, ...], v: int,
             v_strides: tuple[int, ...], lengths: int, out: int, out_strides: tuple[int, ...], lse: int,
             sinks: int, kind: int, step: int, L_new: int, k_new: int, kn_strides: tuple[int, ...], v_new: int,
             vn_strides: tuple[int, ...], table: int = 0, t_kind: int = 0,
             t_strides: tuple[int, int] = (0, 0)) -> bool:
        if _settings() != stamp or not held or (t_kind == 0) != (pages is None):
            return False
        return run(q, q_strides, k, k_strides, v, v_strides, kept.S, out, out_strides, lse, *at, sinks, lengths,
                   kind, step, shift, L_new, k_new, kn_strides, v_new, vn_strides, table, t_kind, t_strides, N, P,
                   _scratch(need) if need else _NO_SCRATCH)
    return call


_NO_STATE, _NO_BOUNDS = np.zeros((1, 0), dtype=np.float32), np.zeros((1, 0), dtype=np.int64)


def _heads(x: Any, batch: tuple[int, ...], N: int, A: int) -> np.ndarray:
    """x (..., heads, rows, D) in float32 as (N, A, rows · heads / A, D) with unit
    stride along D: batch dims broadcast and flattened (views where they can be)."""
    x = np.asarray(x, dtype=np.float32)
    if x.shape[:-3] != batch:
        x = np.broadcast_to(x, batch + x.shape[-3:])
    if x.ndim != 4 or x.shape[1] != A:
        x = x.reshape(N, A, -1, x.shape[-1])
    return unit_rows(x)


def forward(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in the accumulation dtype, shapes (..., H, L, Dv) and (..., H, L)."""
    kern = for_dtype(spec.acc_dtype)
    if streams(spec, kern):                              # compiled: no NumPy warnings to quiet
        out, lse = streamer(spec)(spec.q, spec.k, spec.v)
    else:
        with quiet():
            out, lse = _product(spec, kern)
    pad = geo.padding_rows(spec)
    if pad is not None:                                  # padding rows: lse −inf, sink or not
        lse[np.broadcast_to(pad, lse.shape)] = -np.inf
    return out, lse


def _product(spec: Spec, kern: Any) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) by two products over every head at once (see the module's doc)."""
    acc = spec.acc_dtype
    q, k, v = (np.asarray(x, dtype=acc) for x in (spec.q, spec.k, spec.v))
    if not all_finite(v):
        o_ref, lse_ref, _ = reference.forward(spec)
        return o_ref, lse_ref
    L, S, Hkv = spec.L, spec.S, spec.Hkv
    qg = q.reshape(q.shape[:-3] + (Hkv, spec.group * L, spec.D))    # head h = kv head h // group
    # (..., Hkv, group·L, S), C-ordered: NumPy's product of some operands' memory orders
    # (a broadcast batch, k stored heads-major) is not, and the steps below act in place
    # on heads and rows, reshapes that must be views of s
    s = np.ascontiguousarray(np.matmul(qg, np.swapaxes(k, -1, -2)))
    s *= s.dtype.type(spec.scale)
    heads = s.reshape(spec.score_shape)                  # the same memory as (..., H, L, S)
    if spec.softcap is not None:
        heads /= spec.softcap
        np.tanh(heads, out=heads)
        heads *= spec.softcap
    if spec.bias is not None:
        heads += np.asarray(spec.bias, dtype=acc)
    if spec.alibi_slopes is not None:
        heads += geo.alibi_bias(spec, acc)
    masked = geo.combine(None, None if spec.keep is None else np.asarray(spec.keep),
                         None if spec.drop is None else np.asarray(spec.drop))
    if masked is not None:
        np.copyto(heads, -np.inf, where=masked)
    rows = s.reshape(-1, S)
    m, l = _sink_state(spec, rows.dtype)
    if spec.has_index_mask or spec.varlen:
        lo, hi = _row_bounds(spec)
        kern.softmax_tile_bounded(rows, m, l, lo, hi, 0)
    else:
        kern.softmax_tile(rows, m, l)
    z = reference.dropout_scale(spec, rows.dtype)
    if z is not None:                                    # the same Philox draws as every rung
        heads *= z
    lse, out = finish(m, l, np.matmul(s, v), kern)      # p v: (..., Hkv, group·L, Dv), normalised there
    assert out is not None
    return out.reshape(spec.out_shape), lse.reshape(spec.lse_shape)


# ---- the rung interface (see backends.py) ---------------------------------------
def rung_forward(spec: Spec, need_weights: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    out, lse = forward(spec)
    with quiet():                                        # (a float16 overflow is inf, not a warning)
        out = out.astype(spec.dtype, copy=False)
    return out, lse, (rung_weights(spec, lse) if need_weights else None)


def rung_backward(spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None, need_dbias: bool = True) -> Grads:
    """The flash rung's backward (from out and lse): as fast as the reference's on the
    smallest calls and 2–3× faster from about 100k scores."""
    return flash.rung_backward(spec, dout, out, lse, dlse, need_dbias)


def rung_weights(spec: Spec, lse: Any = None, rows: Any = None) -> np.ndarray:
    """The reference's weights."""
    return reference.rung_weights(spec, lse, rows)


def rung_kvcache(kv: Any) -> tuple[np.ndarray, np.ndarray]:
    """attention_kvcache, its append done: a paged cache's call on float32 NumPy arrays
    by :func:`kvcache_step`'s compiled call (the pages gathered there, not by NumPy:
    at 2M key and value elements a copy of 8 MB; the same bits), else the reference's
    gathered call (a contiguous cache is read in place), then the forward above."""
    if kv.paged:
        step = kvcache_step(kv)
        done = None if step is None else step(kv.spec.q, kv.k_cache, kv.v_cache, kv.lengths, kv.block_table, None,
                                              None, kv.spec.sinks, True)
        if done is not None:
            return done
    out, lse, _ = rung_forward(reference.gathered(kv))
    return out, lse


_F32 = np.dtype(np.float32)
_INTS = {np.dtype(np.int64): 8, np.dtype(np.int32): 4}


def kvcache_step(kv: Any) -> Callable[..., Any] | None:
    """For calls of kv's signature on NumPy arrays, the whole call — the lengths'
    check, the append, the attention — as one compiled call on the arrays' memory
    (:func:`kvcache_at`), as :func:`attnkit.torch.kvcache_op.step` runs it for CPU
    tensors: ``step(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new,
    sinks, need_lse) -> (out, lse or None)``, or None where it cannot take them as
    they are (strides not whole elements, sinks not C-ordered, lengths not an int or
    int64 or int32 of one or B elements, a block table not int64 or int32; what
    :func:`kvcache_at` declines): the full path then checks and runs the call. None
    unless every array of kv is native float32 (their dtypes are the signature's)."""
    spec = kv.spec
    arrays = [x for x in (spec.q, kv.k_cache, kv.v_cache, kv.k_new, kv.v_new, spec.sinks) if x is not None]
    if any(type(x) is not np.ndarray or x.dtype != _F32 for x in arrays):
        return None
    call = kvcache_at(spec, (kv.k_cache.shape[0], kv.page_size, kv.block_table.shape[1]) if kv.paged else None)
    if call is None:
        return None
    out_shape, lse_shape, B = spec.out_shape, spec.lse_shape, spec.batch[0]
    sink_shape = None if spec.sinks is None else spec.shapes["sinks"]      # as the caller gives them
    no_rows = (0, 0, 0, 0)

    def places(xs: tuple[np.ndarray, ...]) -> list[Any] | None:
        """Each array's address and strides in elements, or None (a stride not whole)."""
        made = []
        for x in xs:
            st = x.strides
            if any(n & 3 for n in st):
                return None
            made += [x.ctypes.data, tuple(n >> 2 for n in st)]
        return made

    def run(q: Any, k: Any, v: Any, lengths: Any, table: Any, k_new: Any, v_new: Any, sinks: Any,
            need_lse: bool) -> tuple[np.ndarray, Any] | None:
        at = places((q, k, v) if k_new is None else (q, k, v, k_new, v_new))
        pages: tuple[Any, ...] = ()
        if table is not None:                            # (its type and shape: the signature's)
            if table.dtype not in _INTS or any(n % table.itemsize for n in table.strides):
                return None
            pages = (table.ctypes.data, table.itemsize, tuple(n // table.itemsize for n in table.strides))
        if type(lengths) is int and abs(lengths) < _FAR:
            kind, where, apart = 0, lengths, 0
        elif type(lengths) is np.ndarray and lengths.dtype in _INTS and lengths.shape in ((), (B,)) and not (
                lengths.ndim and lengths.strides[0] % lengths.itemsize):
            kind, where = lengths.itemsize, lengths.ctypes.data
            apart = lengths.strides[0] // kind if lengths.ndim else 0
        else:
            return None
        sinks_at = 0
        if sink_shape is not None:
            if type(sinks) is not np.ndarray or sinks.dtype != _F32 or sinks.shape != sink_shape \
                    or not sinks.flags.c_contiguous:
                return None
            sinks_at = sinks.ctypes.data
        if at is None or sinks is not None and sink_shape is None:
            return None
        out = np.empty(out_shape, dtype=np.float32)
        lse = np.empty(lse_shape, dtype=np.float32) if need_lse else None
        added = (k_new.shape[-2], *at[6:]) if k_new is not None else (0, 0, no_rows, 0, no_rows)
        if not call(*at[:6], where, out.ctypes.data, tuple(n >> 2 for n in out.strides),
                    0 if lse is None else lse.ctypes.data, sinks_at, kind, apart, *added, *pages):
            return None
        return out, lse
    return run
