"""Tile kernels of the flash rung, in place on one (rows × keys) tile (run under
:func:`attnkit.nonfinite.quiet`): the NumPy set
(every dtype) and the compiled float32 set (:mod:`.numba_kernels`, when numba is
installed). Both compute the same thing; the tests run both.

- ``softmax_tile(s, m_i, l_i) -> alpha``: s ← exp(s − m_new) with the running max and
  sum updated; alpha = exp(m_old − m_new) rescales what came before. A row that has
  seen only −inf keeps m = −inf (its shift is 0, no NaN); a NaN score makes the row NaN.
- ``softmax_tile_bounded(s, m_i, l_i, lo, hi, c0)``: the same with row i limited to
  keys [lo[i], hi[i]) (the causal/window band fused in: no boolean tile).
- ``rescale_add(o, alpha, pv)``: o ← alpha · o + pv.
- ``finish_into(acc, m, l, out, lse)``: out ← acc / l row by row (acc (rows, Dv), out an
  (F, R, Dv) view of any strides with F·R = rows): rows with l = 0 (no key, no sink) get
  0, and an infinite result (an inf value a row sees) NaN; lse (F, R) ← m + log l
  (:func:`lse_from`); acc is scratch afterwards.
- ``normalize(acc, l)``: the same in place (acc ← acc / l).
- ``exp_from_lse(s, lse)``: s ← exp(s − lse); keys with s = −inf and rows with
  lse = −inf give 0 (a NaN lse leaves NaN on the other keys).
- ``ds_tile(p, dp, delta)``: dp ← p ∘ (dp − delta).
- ``alibi_tile(s, slopes, r0, c0, sigma)``: s[h, i, j] −= slopes[h] · |r0 + i + sigma − c0 − j|.
- ``dropout_tile(p, heads, r0, c0, seed, thr, scale)``: p[h, i, j] ← 0 where Philox
  drops (head n·H + h = heads[h], row r0 + i, key c0 + j), else p · scale.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import philox
from ..nonfinite import all_finite


def _np_softmax_tile(s: np.ndarray, m_i: np.ndarray, l_i: np.ndarray) -> np.ndarray:
    m_new = np.maximum(m_i, s.max(axis=1))              # NaN propagates
    shift = np.where(m_new == -np.inf, 0.0, m_new).astype(s.dtype)  # all −inf so far: shift by 0
    np.subtract(s, shift[:, None], out=s)                # inf − inf: the row is NaN
    alpha = np.exp(m_i - shift)                          # m_i = −inf gives 0: nothing to rescale
    np.exp(s, out=s)
    l_i *= alpha
    l_i += s.sum(axis=1)
    m_i[:] = m_new
    return alpha


def _np_softmax_tile_bounded(s: np.ndarray, m_i: np.ndarray, l_i: np.ndarray, lo: np.ndarray,
                             hi: np.ndarray, c0: int) -> np.ndarray:
    cols = np.arange(c0, c0 + s.shape[1])
    np.copyto(s, -np.inf, where=(cols < lo[:, None]) | (cols >= hi[:, None]))
    return _np_softmax_tile(s, m_i, l_i)


def _np_rescale_add(o: np.ndarray, alpha: np.ndarray, pv: np.ndarray) -> None:
    if not (alpha == 1).all():                           # the running max moved: rescale
        o *= alpha[:, None]
    o += pv


def _np_normalize(acc: np.ndarray, l_i: np.ndarray) -> None:
    empty = l_i == 0
    if empty.any():
        np.divide(acc, l_i[:, None], out=acc, where=~empty[:, None])
        acc[empty] = 0.0
    else:                                                # the common case: one pass
        acc /= l_i[:, None]
    # |out| ≤ max |v| over visible keys: ±inf can only come from an inf value a row
    # sees, which the NaN rule makes NaN (paths that take the plain product)
    if not all_finite(acc):
        np.copyto(acc, np.nan, where=np.isinf(acc))


def lse_from(m_i: np.ndarray, l_i: np.ndarray) -> np.ndarray:
    """lse from the running state: l_i = 0 (no key, no sink) gives −inf; a NaN sum
    stays NaN."""
    empty = l_i == 0
    lse = np.log(l_i, out=np.full_like(l_i, -np.inf), where=~empty)
    lse += m_i
    return lse


def _np_finish_into(acc: np.ndarray, m_i: np.ndarray, l_i: np.ndarray, out: np.ndarray, lse: np.ndarray) -> None:
    lse[...] = lse_from(m_i, l_i).reshape(lse.shape)
    _np_normalize(acc, l_i)
    out[...] = acc.reshape(out.shape)


def _np_exp_from_lse(s: np.ndarray, lse: np.ndarray) -> None:
    excluded = (s == -np.inf) if np.isnan(lse).any() else None   # exempt from a NaN lse
    shift = np.where(lse == -np.inf, np.inf, lse).astype(s.dtype)   # lse −inf: weights 0
    np.subtract(s, shift[:, None], out=s)
    np.exp(s, out=s)
    if excluded is not None:
        s[excluded] = 0.0


def _np_ds_tile(p: np.ndarray, dp: np.ndarray, delta: np.ndarray) -> None:
    np.subtract(dp, delta[:, None], out=dp)
    np.multiply(dp, p, out=dp)


def _np_alibi_tile(s: np.ndarray, slopes: np.ndarray, r0: int, c0: int, sigma: int) -> None:
    """s (heads, rows, keys)."""
    dist = np.abs(np.arange(r0 + sigma - c0, r0 + sigma - c0 + s.shape[1])[:, None]
                  - np.arange(s.shape[2])[None, :]).astype(s.dtype)
    s -= slopes.astype(s.dtype)[:, None, None] * dist


def _np_dropout_tile(p: np.ndarray, heads: np.ndarray, r0: int, c0: int, seed: int, thr: int,
                     scale: float) -> None:
    """p (heads, rows, keys)."""
    w = philox.words(seed, heads[:, None, None], np.arange(r0, r0 + p.shape[1])[None, :, None],
                     np.arange(c0, c0 + p.shape[2])[None, None, :])
    p *= np.where(w >= np.uint32(thr), p.dtype.type(scale), p.dtype.type(0))


NUMPY = SimpleNamespace(name="numpy", softmax_tile=_np_softmax_tile,
                        softmax_tile_bounded=_np_softmax_tile_bounded, rescale_add=_np_rescale_add,
                        finish_into=_np_finish_into, normalize=_np_normalize,
                        exp_from_lse=_np_exp_from_lse, ds_tile=_np_ds_tile, alibi_tile=_np_alibi_tile,
                        dropout_tile=_np_dropout_tile)

# Set to False to force the NumPy kernels everywhere (tests use it for the fallback).
USE_COMPILED = True
# Set to False to keep the compiled kernels but run the forward's and the backward's
# tile loops in Python (the path without NumPy's sgemm; tests use it).
USE_LOOP = True
_compiled: list[Any] = []   # [] not tried yet; [None] numba missing; [kernels]


def compiled_kernels() -> Any:
    """The numba float32 kernels, or None when numba is not installed (compiled on
    first use and cached on disk by numba between processes)."""
    if not _compiled:
        try:
            from . import numba_kernels
        except ImportError:
            _compiled.append(None)
        else:
            _compiled.append(_probed(numba_kernels))
    return _compiled[0]


def _probed(nk: Any) -> Any:
    """The kernels once one of them compiles (or loads from numba's cache): should a
    numba or llvmlite refuse the 512-bit vector attributes, the kernels compile
    without them; should it refuse to compile at all, the NumPy kernels run. The
    compiled tile loop (:mod:`.numba_loop`) joins them where it runs and gets one
    query against one key right; else the tiles stay in Python. The decoding kernels
    (``decode_part``, ``small_rows``, ``small_rows_at``, ``kvcache_rows_at``, ``small_units``) join where
    :func:`.numba_simd.works`."""
    one = np.ones((1, 1), dtype=np.float32)
    for attrs in (nk.WIDE_ATTRIBUTES, ()):
        nk.WIDE_ATTRIBUTES = attrs
        try:
            nk.rescale_add(one.copy(), one[0], one)
        except Exception:                   # noqa: BLE001 — any compile error: try without
            continue
        try:
            from . import numba_loop
            tasks = numba_loop.kernels()
        except Exception:                   # noqa: BLE001 — any compile error: the Python loop
            tasks = None
        if tasks is not None and _loop_works(tasks):
            nk.KERNELS.tile_tasks = tasks
            from . import numba_backward
            nk.KERNELS.backward_tasks = numba_backward.kernels()
        from . import numba_simd
        if numba_simd.works():              # the decoding kernels' vectors
            from . import numba_small
            nk.KERNELS.small_rows = numba_small.small_rows   # compiled at their first call
            nk.KERNELS.small_rows_at = numba_small.small_rows_at
            nk.KERNELS.kvcache_rows_at = numba_small.kvcache_rows_at
            nk.KERNELS.small_units = numba_small.small_units.address      # its units' entry (a team's)
        else:                               # decoding takes the tiles and products
            nk.KERNELS.decode_part = nk.KERNELS.small_rows = nk.KERNELS.small_rows_at = nk.KERNELS.small_units = None
            nk.KERNELS.kvcache_rows_at = None
        return nk.KERNELS
    return None


def _loop_works(tasks: Any) -> bool:
    """Whether the compiled tile loop (which calls BLAS through a pointer, something a
    numba might refuse) runs and gets one query against one key right, finished (out
    the key's value 2, lse the score 2) and as a key part's state (m 2, l 1, acc 2)."""
    q = np.ones((1, 1, 1, 1), dtype=np.float32)
    kv = np.full((1, 1, 1, 1), 2.0, dtype=np.float32)
    q.flags.writeable = kv.flags.writeable = False        # as a call's views are: the same compiled code
    tiles, none = np.array([[0, 1, 0, 1, 0]]), np.zeros(0, dtype=np.int64)   # bounds: no banded tile
    table = np.array([[0] * 6 + [1, 1, 0, 1, 0, 1, -1, -1, 0], [0] * 6 + [1, 1, 0, 1, 0, 1, -1, 0, 0]])
    out, lse, status = np.zeros((1, 1, 1, 1), np.float32), np.zeros((1, 1, 1), np.float32), np.zeros(2, np.int8)
    sm, sl, sacc = np.zeros(1, np.float32), np.zeros(1, np.float32), np.zeros((1, 1), np.float32)
    empty = np.zeros((0, 0, 0), dtype=np.float32)
    try:
        tasks(q, 1.0, kv, kv, table, tiles, none, none, np.zeros(1, dtype=np.int64), status, empty, empty,
              out, lse, sm, sl, sacc, 1 << 20)
    except Exception:                       # noqa: BLE001 — any compile or call error
        return False
    return (status.tolist() == [1, 1] and (out[0, 0, 0, 0], lse[0, 0, 0]) == (2.0, 2.0)
            and (sm[0], sl[0], sacc[0, 0]) == (2.0, 1.0, 2.0))


_FLOAT32 = frozenset({"float32", np.dtype(np.float32), np.float32})


def for_dtype(dtype: Any) -> Any:
    """The kernel set for a tile dtype: compiled for float32 when available."""
    if (dtype in _FLOAT32 or np.dtype(dtype) == np.float32) and USE_COMPILED:
        return compiled_kernels() or NUMPY
    return NUMPY
