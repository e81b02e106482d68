"""NumPy flash rung: tiled online softmax (m_i, l_i, acc), linear memory, threaded.

The forward pass walks over tiles of BLOCK_M queries × BLOCK_N keys and never holds
more than one tile of scores per worker::

    for each (batch·head, query block):           one task; tasks run on a thread pool
        m_i = -inf, l_i = 0, acc = 0               running max, running sum, running out
        for each key block inside key_bounds:      fully excluded tiles are skipped
            s = q_i k_jᵀ · scale  [softcap, bias, -inf where excluded]
            m_new = max(m_i, rowmax(s));  p = exp(s - m_new)
            alpha = exp(m_i - m_new)               rescales the old blocks to the new max
            l_i = alpha·l_i + rowsum(p);  acc = alpha·acc + p v_j
        out = acc / l_i,  lse = m_i + log(l_i)     l_i = 0 (fully masked row): out 0, lse -inf

The backward pass recomputes ``p = exp(s - lse)`` tile by tile from the saved lse
(FlashAttention-2 order: key blocks outside, query blocks inside), so it also serves
a block of keys of a longer sequence (ring attention, split-KV). Extra memory is
O((L + S)·D) per head plus a few tiles per worker.

Threads: tasks run on a pool of :func:`get_threads` workers (default: the number of
usable cores), set process-wide with :func:`set_threads` or, for a block of code
in the current thread/context only, with the :func:`threads` context manager, so
concurrent calls may use different settings. BLAS is held to one thread while any
call runs (reference counted across overlapping calls) through ``threadpoolctl``
when it is installed; without it the rung runs its tiles
on the calling thread and lets BLAS use its own threads. Results do not depend on
the thread count: every output element is reduced by one task in a fixed order.

float32 uses a compiled softmax tile (``numba``, when installed: a vectorised exp
polynomial fused with the row max and row sum); everything else, and float32
without numba, runs the same tiles in NumPy. Half inputs accumulate in float32.
Where causal/window cut through a forward tile and no keep/drop mask is given, the
softmax tile takes each row's key bounds (Spec.row_key_bounds) instead of a boolean
mask, and the rescale of acc is fused with the add of p v, so the many small tiles
along the diagonal hold the GIL briefly and both workers stay busy.

>>> import numpy as np
>>> from attnkit import flash
>>> from attnkit.spec import validate
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.standard_normal((3, 2, 5, 4))
>>> out, lse, _ = flash.rung_forward(validate(q, k, v, causal=True), block_m=2, block_n=3)
>>> out.shape, lse.shape
((2, 5, 4), (2, 5))
"""

from __future__ import annotations

import contextlib
import contextvars
import numbers
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np

from .spec import Spec, broadcast_to

# ---- tuning ---------------------------------------------------------------------


def block_sizes(D: int, dtype: str, backward: bool = False) -> tuple[int, int]:
    """The tuning table: (BLOCK_M, BLOCK_N) for head dim D, accumulation dtype and
    pass. A plain function; override per call with ``block_m=`` / ``block_n=``.
    ``dtype`` is part of the documented signature but does not change the table
    today (kept so that callers need no change if the table ever depends on it).

    >>> block_sizes(64, "float32")
    (1024, 512)
    """
    if backward:
        return (256, 256) if D <= 128 else (128, 256)
    return (1024, 512) if D <= 128 else (512, 512)


# Row strips for the tiles that causal/window cut through (see _Call.tiles).
SUB_M = 128

# Backward splits each head's keys into chunks so that at least this many tasks exist
# (a constant, never the thread count, so that the bits do not depend on it).
_MIN_TASKS = 8


# ---- threads --------------------------------------------------------------------

_UNSET = object()
# The worker count: the context's setting (flash.threads), else the process default
# (set_threads), else the core count. A ContextVar, so that concurrent calls on other
# threads (each with its own context) never see another thread's `with threads(n)`.
_threads_var: contextvars.ContextVar = contextvars.ContextVar("attnkit_flash_threads", default=_UNSET)
_state = SimpleNamespace(threads=None, pools={}, controller=None, blas_depth=0, blas_limiter=None,
                         blas_thread=None)
_lock = threading.Lock()          # guards _state.pools, _state.controller and compiled_kernels
_blas_lock = threading.Lock()     # guards blas_depth / blas_limiter


def _core_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _check_threads(n):
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1):
        raise ValueError(f"threads: expected a positive int or None, got {n!r}")
    return None if n is None else int(n)


def get_threads() -> int:
    """Workers the rung uses in the current context: the :func:`threads` setting,
    else the process default of :func:`set_threads`, else the core count.

    >>> get_threads() >= 1
    True
    """
    n = _threads_var.get()
    if n is _UNSET:
        n = _state.threads
    return n or _core_count()


def set_threads(n: int | None = None) -> int | None:
    """Set the process-wide default number of workers (None = the number of usable
    cores; any positive integer, NumPy integers included); returns the previous
    default. One worker runs every tile on the calling thread. A :func:`threads`
    block in effect in the current context takes precedence.

    >>> old = set_threads(1); get_threads()
    1
    >>> _ = set_threads(old)
    """
    n = _check_threads(n)
    old, _state.threads = _state.threads, n
    return old


@contextlib.contextmanager
def threads(n: int | None):
    """``with flash.threads(2): ...`` runs the block with n workers (None = the
    core count). The setting belongs to the current context (thread / task):
    calls running concurrently elsewhere keep their own.

    >>> with threads(1):
    ...     get_threads()
    1
    """
    token = _threads_var.set(_check_threads(n))
    try:
        yield
    finally:
        _threads_var.reset(token)


def _blas_controller():
    """A cached threadpoolctl controller, or None when threadpoolctl is missing."""
    if _state.controller is None:
        with _lock:
            if _state.controller is None:
                try:
                    from threadpoolctl import ThreadpoolController
                except ImportError:
                    _state.controller = False
                else:
                    _state.controller = ThreadpoolController()
    return _state.controller or None


def _pool(n=None):
    """The worker pool of n (default: get_threads()) workers: one per size, created
    on first use and never shut down (idle workers cost little), so a pool handed
    to one call can never be closed under it by a call with another setting."""
    n = get_threads() if n is None else n
    with _lock:
        pool = _state.pools.get(n)
        if pool is None:
            pool = _state.pools[n] = ThreadPoolExecutor(n, thread_name_prefix="attnkit-flash")
        return pool


def _on_blas_thread(fn):
    """fn() on one dedicated thread: threadpoolctl lets only the Python thread that
    set OpenBLAS's limit change it back, and the first call in may not be the last
    one out."""
    with _lock:
        if _state.blas_thread is None:
            _state.blas_thread = ThreadPoolExecutor(1, thread_name_prefix="attnkit-blas")
    return _state.blas_thread.submit(fn).result()


@contextlib.contextmanager
def _blas_single_threaded(controller):
    """BLAS held to one thread while any call is inside: threadpoolctl's limit is
    process-wide, so overlapping calls share one limit, reference counted: set on
    the first entry, restored on the last exit (whatever order the calls end in)."""
    def limit():
        limiter = controller.limit(limits=1, user_api="blas")
        return limiter.__enter__()

    with _blas_lock:
        if _state.blas_depth == 0:
            _state.blas_limiter = _on_blas_thread(limit)
        _state.blas_depth += 1
    try:
        yield
    finally:
        with _blas_lock:
            _state.blas_depth -= 1
            if _state.blas_depth == 0:
                limiter, _state.blas_limiter = _state.blas_limiter, None
                _on_blas_thread(lambda: limiter.__exit__(None, None, None))


def _run(tasks, fn):
    """fn(task) for every task: on the pool with BLAS held to one thread per worker,
    or on the calling thread (BLAS threading as it likes) without threadpoolctl."""
    controller = _blas_controller()
    if controller is None:
        for t in tasks:
            fn(t)
        return
    n = min(get_threads(), len(tasks))
    with _blas_single_threaded(controller):             # no oversubscription inside workers
        if n <= 1:
            for t in tasks:
                fn(t)
            return
        for _ in _pool(get_threads()).map(fn, tasks):   # re-raises a worker's exception here
            pass


# ---- softmax tile kernels ---------------------------------------------------------


def _np_softmax_tile(s, m_i, l_i):
    """In place: s ← exp(s − m_new); updates m_i, l_i; returns alpha = exp(m_old − m_new)."""
    m_new = np.maximum(m_i, s.max(axis=1))
    shift = np.where(m_new == -np.inf, 0.0, m_new).astype(s.dtype)  # all −inf so far: shift by 0, no NaN
    np.subtract(s, shift[:, None], out=s)
    np.exp(s, out=s)
    alpha = np.exp(m_i - shift)                          # m_i = −inf gives 0: nothing to rescale
    l_i *= alpha
    l_i += s.sum(axis=1)
    m_i[:] = m_new
    return alpha


def _np_exp_from_lse(s, lse):
    """In place: s ← exp(s − lse), rows with lse = −inf (fully masked) ← 0."""
    finite = np.isfinite(lse)
    np.subtract(s, np.where(finite, lse, 0.0).astype(s.dtype)[:, None], out=s)
    np.exp(s, out=s)
    if not finite.all():
        s[~finite] = 0.0


def _np_ds_tile(p, dp, delta):
    """In place: dp ← p ∘ (dp − delta), the softmax Jacobian applied row by row."""
    np.subtract(dp, delta[:, None], out=dp)
    np.multiply(dp, p, out=dp)


def _np_softmax_tile_bounded(s, m_i, l_i, lo, hi, c0):
    """:func:`_np_softmax_tile` for a tile whose first column is key c0, with row i
    limited to the keys [lo[i], hi[i]) (its causal/window bounds, see
    Spec.row_key_bounds): the other columns count as −inf."""
    cols = np.arange(c0, c0 + s.shape[1])
    np.copyto(s, -np.inf, where=(cols < lo[:, None]) | (cols >= hi[:, None]))
    return _np_softmax_tile(s, m_i, l_i)


def _np_rescale_add(o, alpha, pv):
    """In place: o ← alpha · o + pv (alpha per row)."""
    if not (alpha == 1).all():                           # the running max moved: rescale
        o *= alpha[:, None]
    o += pv


NUMPY_KERNELS = SimpleNamespace(name="numpy", softmax_tile=_np_softmax_tile,
                                softmax_tile_bounded=_np_softmax_tile_bounded,
                                rescale_add=_np_rescale_add,
                                exp_from_lse=_np_exp_from_lse, ds_tile=_np_ds_tile)


def _build_numba():
    """float32 kernels compiled by numba: one pass for the row max, one fused pass for
    exp and the row sum, with a polynomial exp that the compiler vectorises."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _f32_from_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.int32), codegen

    @intrinsic
    def _fmax(typingctx, a, b):
        # llvm.maxnum with nnan: the form of max the vectoriser turns into vmaxps
        # (numba's max() stays scalar); a NaN score may be skipped by the row max
        # but still makes its row NaN in the exp pass
        def codegen(context, builder, signature, args):
            f = ir.FloatType()
            fn = builder.module.declare_intrinsic("llvm.maxnum", [f], ir.FunctionType(f, [f, f]))
            return builder.call(fn, args, fastmath=("nnan", "nsz"))
        return types.float32(types.float32, types.float32), codegen

    # compiled once per process on first use (about a second); numba's disk cache
    # cannot key these closures, so it is not used
    # fast-math without reassoc: every sum keeps its source order (not IEEE-exact:
    # contract fuses multiply-adds, afn/arcp allow approximate functions / reciprocals)
    ordered = dict(nogil=True, error_model="numpy",
                   fastmath={"nsz", "arcp", "contract", "afn"})
    # reassoc lets the row max and row sum vectorise; the order is fixed at compile
    # time, so the bits stay the same run to run and thread to thread
    reduce = dict(ordered, fastmath={"reassoc", "nsz", "arcp", "contract", "afn"})
    f32 = np.float32

    LOG2E = f32(1.44269504088896341)

    @numba.njit(**ordered)
    def exp2_f32(t):
        # 2^t = 2^n · 2^r with n = round(t), r = t − n exact, |r| ≤ 1/2; the caller
        # folds log2(e) into t (exp(x − c) = 2^(x·log2 e − c·log2 e), one FMA)
        n = np.floor(t + f32(0.5))
        r = t - n
        p = f32(1.5356125e-4)                            # near-minimax for (2^r − 1) / r, ≤ 2 ulp
        p = p * r + f32(1.3398818e-3)
        p = p * r + f32(9.6184276e-3)
        p = p * r + f32(5.5503327e-2)
        p = p * r + f32(2.4022648e-1)
        p = p * r + f32(6.9314718e-1)
        y = p * r + f32(1.0)
        y = y * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)  # 2^n from its exponent bits
        # below 2^−125 (and for −inf) the bits above are garbage: the result is
        # exactly 0 there; a NaN t fails the test and stays NaN through r
        return f32(0.0) if t < f32(-125.0) else y

    @numba.njit(**reduce)
    def row_max(row, m):
        for j in range(row.shape[0]):
            m = _fmax(m, row[j])
        return m

    @numba.njit(**reduce)
    def softmax_tile(s, m_i, l_i, alpha):
        for i in range(s.shape[0]):
            row = s[i]
            m_new = row_max(row, m_i[i])
            shift = f32(0.0) if m_new == -np.inf else m_new  # all −inf so far: shift by 0, no NaN
            total = f32(0.0)
            for j in range(row.shape[0]):
                e = exp2_f32((row[j] - shift) * LOG2E)   # subtract first: shift·LOG2E may overflow
                row[j] = e
                total += e
            a = exp2_f32((m_i[i] - shift) * LOG2E)      # m_i = −inf gives 0
            alpha[i] = a
            l_i[i] = l_i[i] * a + total
            m_i[i] = m_new

    @numba.njit(**reduce)
    def softmax_tile_bounded(s, m_i, l_i, alpha, lo, hi, c0):
        # softmax_tile for a tile starting at key c0, row i limited to the keys
        # [lo[i], hi[i]); the other columns get weight 0 (the causal/window mask
        # fused in: no boolean tile, no exp of −inf)
        w = s.shape[1]
        for i in range(s.shape[0]):
            row = s[i]
            a0 = min(max(lo[i] - c0, 0), w)
            a1 = min(max(hi[i] - c0, a0), w)
            row[:a0] = f32(0.0)
            row[a1:] = f32(0.0)
            seg = row[a0:a1]                             # indexed from 0: the loops vectorise
            m_new = row_max(seg, m_i[i])
            shift = f32(0.0) if m_new == -np.inf else m_new
            total = f32(0.0)
            for j in range(seg.shape[0]):
                e = exp2_f32((seg[j] - shift) * LOG2E)
                seg[j] = e
                total += e
            a = exp2_f32((m_i[i] - shift) * LOG2E)
            alpha[i] = a
            l_i[i] = l_i[i] * a + total
            m_i[i] = m_new

    @numba.njit(**ordered)
    def rescale_add(o, alpha, pv):
        for i in range(o.shape[0]):
            a = alpha[i]
            orow, prow = o[i], pv[i]
            if a == f32(1.0):
                for j in range(orow.shape[0]):
                    orow[j] += prow[j]
            else:
                for j in range(orow.shape[0]):
                    orow[j] = orow[j] * a + prow[j]

    @numba.njit(**ordered)
    def exp_from_lse(s, lse):
        for i in range(s.shape[0]):
            row = s[i]
            if lse[i] == -np.inf:                        # fully masked row: weights 0
                row[:] = f32(0.0)
                continue
            c = lse[i]
            for j in range(row.shape[0]):
                row[j] = exp2_f32((row[j] - c) * LOG2E)

    @numba.njit(**ordered)
    def ds_tile(p, dp, delta):
        for i in range(p.shape[0]):
            d = delta[i]
            for j in range(p.shape[1]):
                dp[i, j] = p[i, j] * (dp[i, j] - d)

    def softmax_tile_alpha(s, m_i, l_i):
        alpha = np.empty_like(m_i)
        softmax_tile(s, m_i, l_i, alpha)
        return alpha

    def softmax_tile_bounded_alpha(s, m_i, l_i, lo, hi, c0):
        alpha = np.empty_like(m_i)
        softmax_tile_bounded(s, m_i, l_i, alpha, lo, hi, c0)
        return alpha

    return SimpleNamespace(name="numba", softmax_tile=softmax_tile_alpha,
                           softmax_tile_bounded=softmax_tile_bounded_alpha, rescale_add=rescale_add,
                           exp_from_lse=exp_from_lse, ds_tile=ds_tile)


_compiled = None  # None: not tried yet; False: numba missing; else the kernels


def compiled_kernels():
    """The numba float32 kernels, or None when numba is not installed."""
    global _compiled
    if _compiled is None:
        with _lock:
            if _compiled is None:
                try:
                    _compiled = _build_numba()
                except ImportError:
                    _compiled = False
    return _compiled or None


# Set to False to force the NumPy kernels everywhere (tests use it for the fallback).
USE_COMPILED = True


def _kernels(dtype):
    if dtype == np.float32 and USE_COMPILED:
        return compiled_kernels() or NUMPY_KERNELS
    return NUMPY_KERNELS


# ---- one call's prepared operands -------------------------------------------------


def _tile_ready(x, dtype):
    """x in dtype with its last two dims C-contiguous (BLAS-friendly); copies only
    when needed, and never expands broadcast batch dims."""
    x = np.asarray(x)
    it = np.dtype(dtype).itemsize
    if x.dtype == dtype and x.strides[-1] == it and (x.shape[-2] == 1 or x.strides[-2] == x.shape[-1] * it):
        return x
    return np.ascontiguousarray(x, dtype=dtype)


class _Call:
    """Operands and settings shared by every tile of one call."""

    def __init__(self, spec: Spec, block_m, block_n, backward=False):
        self.spec = spec
        self.acc = np.dtype(spec.acc_dtype)
        bm, bn = block_sizes(spec.D, spec.acc_dtype, backward)
        self.BLOCK_M = int(bm if block_m is None else block_m)
        self.BLOCK_N = int(bn if block_n is None else block_n)
        if self.BLOCK_M < 1 or self.BLOCK_N < 1:
            raise ValueError(f"block sizes must be positive, got {self.BLOCK_M}, {self.BLOCK_N}")
        self.kern = _kernels(self.acc)
        # fold the scale (and 1/softcap) into q: s = (q · qs) kᵀ saves a pass per tile
        self.qs = spec.scale / spec.softcap if spec.softcap else spec.scale
        self.batch_index = list(np.ndindex(*spec.batch))
        self.q = broadcast_to(np.asarray(spec.q), spec.batch + tuple(spec.q.shape[-3:]))
        self.k = broadcast_to(_tile_ready(spec.k, self.acc), spec.batch + tuple(spec.k.shape[-3:]))
        self.v = (None if spec.v is None else
                  broadcast_to(_tile_ready(spec.v, self.acc), spec.batch + tuple(spec.v.shape[-3:])))
        self.masked = spec.keep is not None or spec.drop is not None
        # causal/window alone (no keep/drop): the forward passes each row's key bounds
        # to the softmax tile instead of building a boolean mask for the tile
        self.fuse_index = spec.has_index_mask and not self.masked
        self._plans = {}                                 # (r0, r1) -> tiles(r0, r1), same for every head

    def heads(self):
        """(batch index, head) pairs in a fixed order."""
        return [(b, h) for b in self.batch_index for h in range(self.spec.H)]

    def q_block(self, b, h, rows):
        """q rows times qs, in the accumulation dtype, contiguous."""
        return np.multiply(self.q[b][h, rows], self.qs, dtype=self.acc)

    def kv(self, b, h):
        hk = h // self.spec.group                        # GQA: a view of the shared kv head, no copy
        return self.k[b][hk], (None if self.v is None else self.v[b][hk])

    def query_blocks(self):
        """Query row blocks [r0, r1) of BLOCK_M rows covering all L rows."""
        L = self.spec.L
        return [(i, min(i + self.BLOCK_M, L)) for i in range(0, L, self.BLOCK_M)]

    def scores(self, s, b, h, q_blk, k_blk, r0, r1, c0, c1, tanh_out=None, index_mask=None):
        """Fill s (r1-r0, c1-c0) with the final scores of one tile: q kᵀ, softcap,
        bias, −inf where excluded. tanh_out (optional) receives tanh(s / softcap).
        index_mask: whether causal/window cut this tile (None: work it out); False
        also when the caller applies them itself (see :meth:`fused_bounds`)."""
        spec = self.spec
        np.matmul(q_blk, k_blk.T, out=s)
        if spec.softcap:
            np.tanh(s, out=s)                            # q was scaled by scale / softcap
            if tanh_out is not None:
                tanh_out[...] = s
            s *= spec.softcap
        if spec.bias is not None:
            s += spec.mask_tile(spec.bias, b, h, r0, r1, c0, c1)
        if index_mask is None:
            index_mask = self.index_partial(r0, r1, c0, c1)
        if self.masked or index_mask:
            ex = spec.tile_excluded(b, h, r0, r1, c0, c1, index=index_mask)
            if ex is not None:
                np.copyto(s, -np.inf, where=ex)

    def index_partial(self, r0, r1, c0, c1):
        """True when causal/window hide part of this tile (rows [r0, r1) see the
        keys [lo, hi) of their own key_bounds; the tile is clear inside all of them)."""
        if not self.spec.has_index_mask:
            return False
        lo_all = self.spec.key_bounds(r1 - 1, r1)[0]      # the last row's lower bound is the largest
        hi_all = self.spec.key_bounds(r0, r0 + 1)[1]      # the first row's upper bound is the smallest
        return not (lo_all <= c0 and c1 <= hi_all)

    def fused_bounds(self, r0, r1):
        """Per-row key bounds (lo, hi) of rows [r0, r1) (Spec.row_key_bounds) when the
        forward's softmax applies causal/window itself (``fuse_index``), else None."""
        return self.spec.row_key_bounds(r0, r1) if self.fuse_index else None

    def tiles(self, r0, r1):
        """[(a0, a1, c0, c1, partial)]: tiles covering what rows [r0, r1) can see, key
        block by key block; partial = causal/window cut the tile (index_partial).
        Where they cut through a block, its rows are taken in strips of SUB_M: strips
        that see the whole key block are merged into one tile, the others are clipped
        to their own key bounds (so a large BLOCK_M costs little along the diagonal).
        Worked out once per call for each query block (every head has the same)."""
        plan = self._plans.get((r0, r1))
        if plan is None:
            plan = self._plans[(r0, r1)] = [t + (self.index_partial(*t),) for t in self._tiles(r0, r1)]
        return plan

    def _tiles(self, r0, r1):
        for c0, c1 in self.key_blocks(r0, r1):
            if r1 - r0 <= SUB_M or not self.index_partial(r0, r1, c0, c1):
                yield r0, r1, c0, c1
                continue
            run = None                                   # rows [run, a0) see all of [c0, c1)
            for a0 in range(r0, r1, SUB_M):
                a1 = min(a0 + SUB_M, r1)
                if not self.index_partial(a0, a1, c0, c1):
                    run = a0 if run is None else run
                    continue
                if run is not None:
                    yield run, a0, c0, c1
                    run = None
                lo, hi = self.spec.key_bounds(a0, a1)
                if max(c0, lo) < min(c1, hi):
                    yield a0, a1, max(c0, lo), min(c1, hi)
            if run is not None:
                yield run, r1, c0, c1

    def query_tiles(self, c0, c1):
        """[(r0, r1, partial)]: the query blocks that can see any of keys [c0, c1) (the
        backward's loop; fully excluded tiles skipped), partial as in :meth:`tiles`.
        Worked out once per call for each key block."""
        plan = self._plans.get(("keys", c0, c1))
        if plan is None:
            plan = self._plans[("keys", c0, c1)] = [
                (r0, r1, self.index_partial(r0, r1, c0, c1)) for r0, r1 in self.query_blocks()
                for lo, hi in [self.spec.key_bounds(r0, r1)] if not (hi <= c0 or lo >= c1 or hi <= lo)]
        return plan

    def key_blocks(self, r0, r1):
        """Key tiles [c0, c1) for query rows [r0, r1), only inside key_bounds: tiles
        outside are fully excluded and skipped (causal: about half of them)."""
        lo, hi = self.spec.key_bounds(r0, r1)
        return [(c, min(c + self.BLOCK_N, hi)) for c in range(lo, hi, self.BLOCK_N)]


# ---- forward ------------------------------------------------------------------------


def _forward(call: _Call, want_out: bool, want_weights: bool):
    spec, acc = call.spec, call.acc
    lse = np.empty(spec.lse_shape, dtype=acc)
    out = np.empty(spec.out_shape, dtype=acc) if want_out else None
    weights = np.zeros(spec.score_shape, dtype=spec.dtype) if want_weights else None

    def task(t):
        (b, h), (r0, r1) = t
        q_blk = call.q_block(b, h, slice(r0, r1))
        buf = np.empty((r1 - r0) * call.BLOCK_N, dtype=acc)
        lse_i, o_i = _online_softmax(call, b, h, q_blk, r0, r1, buf, want_out)
        lse[b][h, r0:r1] = lse_i
        if want_out:
            out[b][h, r0:r1] = o_i
        if want_weights:
            _weights_rows(call, b, h, q_blk, r0, r1, lse_i, weights[b][h, r0:r1], buf)

    tasks = [(bh, rb) for bh in call.heads() for rb in call.query_blocks()]
    # heaviest tasks first (causal: the last query blocks see the most keys)
    tasks.sort(key=lambda t: -sum(c1 - c0 for c0, c1 in call.key_blocks(*t[1])))
    _run(tasks, task)
    return out, lse, weights


def _online_softmax(call, b, h, q_blk, r0, r1, buf, want_out):
    """The tiled loop for query rows [r0, r1) of head (b, h): (lse_i, out_i | None)."""
    acc, Dv = call.acc, call.spec.Dv
    k_h, v_h = call.kv(b, h)
    bm = r1 - r0
    m_i = np.full(bm, -np.inf, dtype=acc)                # running row max
    l_i = np.zeros(bm, dtype=acc)                        # running row sum of exp(s − m_i)
    acc_i = np.zeros((bm, Dv), dtype=acc) if want_out else None  # running Σ exp(s − m_i) v
    pv = np.empty((bm, Dv), dtype=acc) if want_out else None
    kern = call.kern
    bounds = call.fused_bounds(r0, r1)                   # None: scores() masks causal/window
    for a0, a1, c0, c1, partial in call.tiles(r0, r1):
        i0, i1 = a0 - r0, a1 - r0
        s = buf[: (a1 - a0) * (c1 - c0)].reshape(a1 - a0, c1 - c0)
        fused = bounds is not None and partial
        call.scores(s, b, h, q_blk[i0:i1], k_h[c0:c1], a0, a1, c0, c1, index_mask=partial and not fused)
        if fused:                                        # causal/window applied row by row
            alpha = kern.softmax_tile_bounded(s, m_i[i0:i1], l_i[i0:i1],
                                              bounds[0][i0:i1], bounds[1][i0:i1], c0)
        else:
            alpha = kern.softmax_tile(s, m_i[i0:i1], l_i[i0:i1])
        if want_out:
            np.matmul(s, v_h[c0:c1], out=pv[i0:i1])
            kern.rescale_add(acc_i[i0:i1], alpha, pv[i0:i1])   # acc ← alpha · acc + p v
    has = l_i > 0                                        # l_i = 0: the row saw no key
    lse_i = np.log(l_i, out=np.full_like(l_i, -np.inf), where=has)
    lse_i += m_i
    if want_out:
        np.divide(acc_i, l_i[:, None], out=acc_i, where=has[:, None])
        acc_i[~has] = 0.0                                # fully masked row: out 0
    return lse_i, acc_i


def _weights_rows(call, b, h, q_blk, r0, r1, lse_i, w_out, buf):
    """w_out (r1-r0, S), zero-filled ← exp(scores − lse) for rows [r0, r1), tile by tile."""
    k_h, _ = call.kv(b, h)
    for a0, a1, c0, c1, partial in call.tiles(r0, r1):
        i0, i1 = a0 - r0, a1 - r0
        s = buf[: (a1 - a0) * (c1 - c0)].reshape(a1 - a0, c1 - c0)
        call.scores(s, b, h, q_blk[i0:i1], k_h[c0:c1], a0, a1, c0, c1, index_mask=partial)
        call.kern.exp_from_lse(s, lse_i[i0:i1])
        with np.errstate(under="ignore"):                # float16: tiny weights flush to 0
            w_out[i0:i1, c0:c1] = s


def _row_runs(rows):
    """Split row indices into runs of consecutive rows: [(pos, r0, r1)], where pos is
    where the run starts in ``rows``."""
    rows = np.asarray(rows, dtype=np.int64).ravel()
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [rows.size]))
    return [(int(p), int(rows[p]), int(rows[p]) + int(e - p)) for p, e in zip(starts, ends)]


# ---- backward -----------------------------------------------------------------------


def _backward(call: _Call, dout, out, lse, dlse=None):
    spec, acc = call.spec, call.acc
    dout = broadcast_to(_tile_ready(dout, acc), spec.out_shape)
    lse = np.asarray(lse, dtype=acc)
    # delta = rowsum(dout ∘ out): the softmax Jacobian term Σ_j w·dw, O(L) per head
    delta = np.einsum("...d,...d->...", dout, np.asarray(out, dtype=acc))
    if dlse is not None:                                 # a gradient for lse: d lse / d scores = w
        delta = delta - np.asarray(dlse, dtype=acc)

    heads = call.heads()
    # tasks that add into the same dbias slice run its heads one after another
    groups = _bias_groups(spec, heads)
    n_kb = -(-spec.S // call.BLOCK_N)
    bias_shape = _bias_shape(spec)
    n_chunks = 1 if (bias_shape is not None and bias_shape[-1] == 1) else \
        max(1, min(n_kb, -(-_MIN_TASKS // len(groups))))
    dq = np.zeros((n_chunks,) + spec.batch + (spec.H, spec.L, spec.D), dtype=acc)
    dk = np.zeros(spec.batch + (spec.H, spec.S, spec.D), dtype=acc)    # per query head, folded below
    dv = np.zeros(spec.batch + (spec.H, spec.S, spec.Dv), dtype=acc)
    dbias = None if bias_shape is None else np.zeros(bias_shape, dtype=acc)
    kern = call.kern
    BM, BN = call.BLOCK_M, call.BLOCK_N

    def task(t):
        g, chunk = t
        s_buf = np.empty(BM * BN, dtype=acc)
        dp_buf = np.empty(BM * BN, dtype=acc)
        t_buf = np.empty(BM * BN, dtype=acc) if spec.softcap else None
        for b, h in groups[g]:
            k_h, v_h = call.kv(b, h)
            dq_h = dq[chunk][b][h]
            q_blks = {}
            for j in range(chunk * n_kb // n_chunks, (chunk + 1) * n_kb // n_chunks):
                c0, c1 = j * BN, min((j + 1) * BN, spec.S)
                bn = c1 - c0
                k_blk, v_blk = k_h[c0:c1], v_h[c0:c1]
                dk_j = np.zeros((bn, spec.D), dtype=acc)
                dv_j = np.zeros((bn, spec.Dv), dtype=acc)
                for r0, r1, partial in call.query_tiles(c0, c1):   # fully excluded tiles skipped
                    bm = r1 - r0
                    if r0 not in q_blks:
                        q_blks[r0] = call.q_block(b, h, slice(r0, r1))
                    q_blk, do_blk = q_blks[r0], dout[b][h, r0:r1]
                    p = s_buf[: bm * bn].reshape(bm, bn)
                    tanh_t = None if t_buf is None else t_buf[: bm * bn].reshape(bm, bn)
                    call.scores(p, b, h, q_blk, k_blk, r0, r1, c0, c1, tanh_out=tanh_t, index_mask=partial)
                    kern.exp_from_lse(p, lse[b][h, r0:r1])          # p = exp(s − lse), the saved softmax
                    dv_j += p.T @ do_blk
                    ds = dp_buf[: bm * bn].reshape(bm, bn)
                    np.matmul(do_blk, v_blk.T, out=ds)               # dp = dout vᵀ
                    kern.ds_tile(p, ds, delta[b][h, r0:r1])          # ds = p ∘ (dp − delta)
                    if dbias is not None:
                        _add_dbias(spec, dbias, ds, b, h, r0, r1, c0, c1)
                    if tanh_t is not None:
                        np.multiply(tanh_t, tanh_t, out=tanh_t)     # d/dz c·tanh(z/c) = 1 − tanh²
                        np.subtract(1.0, tanh_t, out=tanh_t)
                        ds *= tanh_t
                    dk_j += ds.T @ q_blk                             # q_blk carries qs; fixed below
                    dq_h[r0:r1] += ds @ k_blk
                dk[b][h, c0:c1] = dk_j
                dv[b][h, c0:c1] = dv_j

    tasks = [(g, c) for g in range(len(groups)) for c in range(n_chunks)]
    _run(tasks, task)

    dq_sum = dq[0]
    for c in range(1, n_chunks):                         # fixed order: same bits for any thread count
        dq_sum += dq[c]
    dq_sum *= spec.scale                                 # dz/dq = scale · k
    if spec.softcap:                                     # q_blk was q · scale / softcap; dz/dk = scale · q
        dk *= spec.softcap

    res = tuple(_cast(g, spec.dtype) for g in spec.to_inputs(dq_sum, dk, dv))
    if dbias is not None:
        dbias = _cast(dbias.reshape(spec.shapes["bias"]), np.asarray(spec.bias).dtype)
    return res + (dbias,)


def _cast(x, dtype):
    """x in the output dtype. Results below the dtype's smallest subnormal (float16
    mostly) flush to 0 as they should, not as an error under np.errstate(all='raise')."""
    with np.errstate(under="ignore"):
        return x.astype(dtype, copy=False)


def _bias_shape(spec):
    """bias's shape left-padded with 1s to the score rank, or None without bias."""
    if spec.bias is None:
        return None
    bs = tuple(spec.shapes["bias"])
    return (1,) * (len(spec.score_shape) - len(bs)) + bs


def _bias_slot(spec, b, h):
    """Index of the (L, S) slice of the padded dbias that head (b, h) adds into."""
    shape = _bias_shape(spec)
    return tuple(0 if n == 1 else i for i, n in zip(b + (h,), shape[:-2]))


def _bias_groups(spec, heads):
    """Heads grouped by the dbias slice they add into (one head per group without bias)."""
    if spec.bias is None:
        return [[bh] for bh in heads]
    groups = {}
    for bh in heads:
        groups.setdefault(_bias_slot(spec, *bh), []).append(bh)
    return list(groups.values())


def _add_dbias(spec, dbias, ds, b, h, r0, r1, c0, c1):
    """dbias[slot] += ds, summed over rows / keys along which bias was broadcast
    (dbias has the padded shape of :func:`_bias_shape`)."""
    slot = _bias_slot(spec, b, h)
    if dbias.shape[-2] == 1:
        ds, r0, r1 = ds.sum(axis=0, keepdims=True), 0, 1
    if dbias.shape[-1] == 1:
        ds, c0, c1 = ds.sum(axis=1, keepdims=True), 0, 1
    dbias[slot][r0:r1, c0:c1] += ds


# ---- the rung interface (see backends.py) -------------------------------------------


def not_supported_reasons(spec: Spec) -> list[str]:
    if spec.torch:
        return ["takes NumPy arrays (torch tensors use backend='torch')"]
    if spec.dtype == "bfloat16":
        return ["NumPy has no bfloat16"]
    return []


def rung_forward(spec: Spec, need_weights: bool = False, *, block_m=None, block_n=None):
    """(out, lse, weights | None): out in q's dtype, lse in the accumulation dtype.
    weights (when asked) come from lse tile by tile, like :func:`rung_weights`."""
    call = _Call(spec, block_m, block_n)
    out, lse, weights = _forward(call, spec.v is not None, need_weights)
    return (None if out is None else _cast(out, spec.dtype)), lse, weights


def rung_backward(spec: Spec, dout, out, lse, dlse=None, *, block_m=None, block_n=None):
    """(dq, dk, dv, dbias | None) from the saved out and lse (and a gradient ``dlse``
    for lse, optional), reduced to the shapes the user passed; dbias has bias's dtype."""
    return _backward(_Call(spec, block_m, block_n, backward=True), dout, out, lse, dlse)


def rung_weights(spec: Spec, lse=None, rows=None, *, block_m=None, block_n=None):
    """Weights (..., H, len(rows), S) in q's dtype for the query rows ``rows`` (all
    if None), as exp(scores − lse) tile by tile: O(len(rows) · S) memory. Without lse
    each task first runs the forward over its rows (no v needed) to get it."""
    call = _Call(spec, block_m, block_n)
    rows = np.arange(spec.L) if rows is None else np.asarray(rows, dtype=np.int64).ravel()
    lse_rows = None if lse is None else np.asarray(lse, dtype=call.acc)[..., rows]
    w = np.zeros(spec.batch + (spec.H, rows.size, spec.S), dtype=spec.dtype)

    def task(t):
        (b, h), (pos, r0, r1) = t
        buf = np.empty((r1 - r0) * call.BLOCK_N, dtype=call.acc)
        q_blk = call.q_block(b, h, slice(r0, r1))
        lse_i = (_online_softmax(call, b, h, q_blk, r0, r1, buf, False)[0] if lse_rows is None
                 else lse_rows[b][h, pos:pos + r1 - r0])
        _weights_rows(call, b, h, q_blk, r0, r1, lse_i, w[b][h, pos:pos + r1 - r0], buf)

    _run([(bh, piece) for bh in call.heads() for piece in _split_runs(_row_runs(rows), call.BLOCK_M)], task)
    return w


def _split_runs(runs, block):
    return [(p + i, r0 + i, min(r0 + i + block, r1)) for p, r0, r1 in runs for i in range(0, r1 - r0, block)]


# ---- merge ---------------------------------------------------------------------------


def _xp(x):
    """The array namespace of x: numpy, or torch for tensors (merge serves both)."""
    if isinstance(x, np.ndarray):
        return np
    import torch
    return torch


def merge(outs, lses):
    """Combine attention over disjoint key blocks: out = Σ_b exp(lse_b − lse) out_b,
    lse = log Σ_b exp(lse_b). Rows masked in every block (all lse_b = −inf) give
    out 0, lse −inf. Works on NumPy arrays and torch tensors (differentiable).

    >>> o, l = merge([np.ones((1, 2)), np.zeros((1, 2))], [np.zeros(1), np.zeros(1)])
    >>> o, l.round(4)
    (array([[0.5, 0.5]]), array([0.6931]))
    """
    xp = _xp(lses[0])
    lse_b = xp.stack(list(lses))                              # (n, ..., H, L)
    m = lse_b.max(0) if xp is np else lse_b.max(0).values      # running max over blocks
    m = xp.where(xp.isfinite(m), m, xp.zeros_like(m))         # all −inf: shift by 0, no NaN
    w = xp.exp(lse_b - m)                                     # (n, ..., H, L), 0 for empty blocks
    total = w.sum(0)
    safe = xp.where(total > 0, total, xp.ones_like(total))
    lse = xp.where(total > 0, xp.log(safe) + m, xp.full_like(m, -float("inf")))
    scale = (w / safe)[..., None]                             # each block's share per row
    out = sum(scale[i] * outs[i].astype(scale.dtype) if xp is np else scale[i] * outs[i].to(scale.dtype)
              for i in range(len(outs)))
    return _cast(out, outs[0].dtype) if xp is np else out.to(outs[0].dtype), lse
