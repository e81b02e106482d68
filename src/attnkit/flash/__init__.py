"""The flash rung: tiled online softmax (m_i, l_i, acc) on the CPU, linear memory,
threaded, forward and backward from lse, exact weights for chosen rows.

Modules: ``runtime`` (worker threads, BLAS held to one thread, fork and interrupt
safety), ``kernels`` / ``numba_kernels`` (the tile kernels, and the forward's tile
loop compiled with ``blas``: NumPy's own sgemm), ``plan`` (units, tiles, split-KV: the
tile planner), ``forward`` and ``backward``.

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

from typing import Any

import numpy as np

from ..backends import Grads
from ..kvcache import compact, seen
from ..nonfinite import quiet
from ..spec import Spec
from ..spec.kvcache import KVCall
from . import backward as _backward
from . import forward as _forward
from .direct import direct, direct_at
from .kernels import compiled_kernels
from .plan import SUB_M, Call, blas_cannot_read, block_sizes
from .runtime import get_threads, set_threads, threads

__all__ = ["SUB_M", "block_sizes", "compiled_kernels", "direct", "direct_at", "get_threads", "not_supported_reasons",
           "rung_backward", "rung_forward", "rung_kvcache", "rung_weights", "set_threads", "threads"]

name = "flash"
# its kept calls (direct, direct_at) are made for one key length: kept under it too
KEPT_PER_KEY_LENGTH = True


def not_supported_reasons(spec: Spec) -> list[str]:
    if spec.torch:
        if spec.q.device.type != "cpu":
            return [f"runs on the CPU (torch CPU tensors through the torch op), got device {spec.q.device}"]
        return []
    if spec.dtype == "bfloat16":
        return ["NumPy has no bfloat16"]
    return []


def rung_forward(spec: Spec, need_weights: bool = False, *, block_m: int | None = None,
                 block_n: int | None = None) -> tuple[Any, np.ndarray, Any]:
    """(out, lse, weights | None): out in q's dtype, lse in the accumulation dtype.
    weights (when asked) come from lse tile by tile, like :func:`rung_weights`."""
    with quiet():
        call = Call(spec, block_m, block_n)
        out, lse, weights = _forward.forward(call, spec.v is not None, need_weights)
        return (None if out is None else _forward.cast(out, spec.dtype)), lse, weights


def rung_backward(spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None, need_dbias: bool = True, *,
                  block_m: int | None = None, block_n: int | None = None) -> Grads:
    """Gradients from the saved out and lse (and a gradient ``dlse`` for lse,
    optional), reduced to the shapes the user passed; dbias has bias's dtype."""
    with quiet():
        call = Call(spec, block_m, block_n, backward=True)
        return _backward.backward(call, dout, out, lse, dlse, need_dbias)


def rung_kvcache(kv: KVCall, *, block_m: int | None = None, block_n: int | None = None) -> tuple[Any, Any]:
    """(out, lse) of attention_kvcache's queries against the cache (already appended):
    a contiguous cache is read in place, a paged one page by page; keys past each
    sequence's length are never read."""
    caches = (kv.k_cache, kv.v_cache)
    if kv.paged and any(blas_cannot_read(x) for x in caches):
        kv = compact(kv)                                 # (a pool strided along D is copied: its pages in use)
    elif not kv.paged and any(x.dtype != kv.spec.acc_dtype or blas_cannot_read(x) for x in caches):
        kv = seen(kv)                                    # (a cache converted or copied: up to the keys in use)
    with quiet():
        if kv.paged:
            table = np.asarray(kv.block_table, dtype=np.int64)
            call = Call(kv.spec, block_m, block_n, pages=(kv.k_cache, kv.v_cache, table, kv.page_size))
        else:
            call = Call(kv.spec.replace(k=kv.k_cache, v=kv.v_cache), block_m, block_n)
        out, lse, _ = _forward.forward(call, True, False)
        assert out is not None
        return _forward.cast(out, kv.spec.dtype), lse


def rung_weights(spec: Spec, lse: Any = None, rows: Any = None, *, block_m: int | None = None,
                 block_n: int | None = None) -> np.ndarray:
    """Weights (..., H, len(rows), S) in q's dtype for the query rows ``rows`` (all
    if None), as exp(scores − lse) tile by tile: O(len(rows) · S) memory."""
    with quiet():
        call = Call(spec, block_m, block_n)
        rows = np.arange(spec.L) if rows is None else np.asarray(rows, dtype=np.int64).ravel()
        return _forward.weights(call, lse, rows)
