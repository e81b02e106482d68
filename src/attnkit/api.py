"""Public functions: validate (attnkit.spec) → select (attnkit.backends) → the rung.

Every function takes the masking keywords of :mod:`attnkit.spec.options`, applied in
this order (DESIGN.md §2)::

    scores = scale · q kᵀ                      scale defaults to 1/√D
    scores = softcap · tanh(scores / softcap)  only if softcap is given
    scores = scores + bias                     bias: float, -inf allowed
    scores = scores − slope · |diag(i) − j|    only if alibi_slopes is given
    scores[excluded] = -inf                    keep / drop / causal / window / lengths
    weights = softmax(scores over keys [+ one sink logit per row])
    weights = dropout(weights, p, seed);  out = weights v

A fully masked query row gives out = 0, weights = 0, lse = -inf and zero gradients;
a NaN or inf that reaches a row's softmax or weighted sum makes that row NaN.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from . import backends, kvcache, reference
from .merge import merge as _merge_blocks
from .spec import (
    Masking,
    autocast,
    check_flags,
    check_grad_inputs,
    check_lse,
    check_merge,
    check_rows,
    validate,
    validate_seed,
    with_options,
)
from .spec.kvcache import STEP, kept_step, validate_kvcache
from .spec.validate import compiling, geometry_key, signature

if sys.version_info >= (3, 11):     # at run time too: typing.get_type_hints (pydantic, beartype)
    from typing import Unpack
elif TYPE_CHECKING:
    from typing_extensions import Unpack


def _head_squeeze(two_d: bool, x: Any, tail: int) -> Any:
    """2-D q gives outputs without the head axis: drop axis -(tail + 1)."""
    if not two_d or x is None:
        return x
    return x[(Ellipsis, 0) + (slice(None),) * tail]


def _head_unsqueeze(two_d: bool, x: Any, tail: int) -> Any:
    return x[(Ellipsis, None) + (slice(None),) * tail] if two_d else x


# Calls that repeat one signature (a decoding step: every layer, every step; a model's
# layers) skip the checks and the choice after the first: where the chosen rung has a
# direct call for it (``rung.direct(spec)``: the small rung's streaming call, the flash
# rung's compiled loop on a kept plan, behind the torch op's per-call tests of
# gradients, tracing and autocast), attention keeps it under the key validate reuses
# its check by (the same signature: types, dtypes, shapes but the key length, devices,
# scalar keywords; lengths and offsets by value) while the key length stays where
# select makes the same choice (the flash rung's: that key length alone, see _keep),
# under the settings select read then (backends.settings). A kept call
# ``call(q, k, v, need_lse[, sinks]) -> (out, lse or None)`` (sinks, keyed by dtype and
# shape, read at every call) may decline (None): then the call takes the full path.
_KEPT: dict[tuple[Any, ...], tuple[Callable[[Any, Any, Any, bool], Any], int, int, tuple[Any, ...]]] = {}
_KEPT_MAX = 256
_ONCE: set[tuple[Any, ...]] = set()        # keys seen once, to keep the second time (_keep)


def kept_call(q: Any, k: Any, v: Any, backend: str, masking: Any) -> tuple[Any, Any]:
    """(the call's key, the call kept for it or None); (None, None) for other array
    types, array keywords other than lengths, offsets and sinks, or an unhashable keyword.
    The key is validate's signature, with the lengths' and offsets' values
    (:func:`~attnkit.spec.validate.geometry_key`). (Also the transformers hook's,
    which keeps a layer's call: :mod:`attnkit.hf`.)"""
    key, arrays = signature(q, k, v, backend, True, masking)
    if key is None:
        return None, None
    if arrays:
        values = geometry_key(masking, ("sinks",))
        if values is None:
            return None, None
        key += values
    try:
        kept = _KEPT.get(key)
        if kept is None:                                 # one kept for this key length (see _keep)
            kept = _KEPT.get((*key, k.shape[-2]))
        return key, kept
    except TypeError:
        return None, None


def run_kept(kept: Any, q: Any, k: Any, v: Any, need_lse: bool, sinks: Any = None) -> Any:
    """A kept call on q, k, v (and sinks) of the signature it was kept for: (out, lse or
    None), or None where their key length or the settings left those it was kept under,
    or where the call declines (the caller then takes the full path)."""
    S = k.shape[-2]
    if kept[1] <= S <= kept[2] and v.shape[-2] == S and backends.settings() == kept[3]:
        return kept[0](q, k, v, need_lse) if sinks is None else kept[0](q, k, v, need_lse, sinks)
    return None


def _keep(key: tuple[Any, ...], spec: Any, rung: Any, backend: str) -> None:
    """Keep the rung's direct call for spec under key: for the key lengths where select
    chooses the same, or, for a rung whose direct calls are made for one key length
    (``KEPT_PER_KEY_LENGTH``: the flash rung's plan), for spec's alone, under key and
    that length (another length gets its own), the second time that key comes (a
    model's second layer): key lengths, or lengths (their values are in the key), that
    change at every call would make a plan for each and never reuse it."""
    make = getattr(rung, "direct", None)
    if make is None:
        return
    exact = getattr(getattr(rung, "mod", rung), "KEPT_PER_KEY_LENGTH", False)
    if exact:
        key = (*key, spec.S)
        if key not in _ONCE:
            if len(_ONCE) >= _KEPT_MAX:
                _ONCE.clear()
            _ONCE.add(key)
            return
    call = make(spec)
    if call is not None:
        if len(_KEPT) >= _KEPT_MAX:
            _KEPT.clear()
        _KEPT[key] = (call, spec.S, spec.S, backends.settings()) if exact else \
            (call, *backends.same_keys(spec, backend), backends.settings())


@with_options()
def attention(q: Any, k: Any, v: Any, *, return_lse: bool = False, return_weights: bool = False,
              backend: str = "auto", **masking: Unpack[Masking]) -> Any:
    """Exact scaled dot-product attention, softmax(scale · q kᵀ [+ masks]) v.

    Shapes: q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) with H % Hkv == 0
    → out (..., H, L, Dv), lse (..., H, L), weights (..., H, L, S). 2-D q, k, v
    (the seed's form) give 2-D out. ``out`` and ``weights`` have q's dtype; ``lse``
    is float32 (float64 for float64 inputs). A fully masked row gives out 0,
    weights 0 and lse -inf.

    Parameters
    ----------
    q, k, v : NumPy arrays or torch tensors (one library per call)
        Queries, keys and values.
    return_lse : bool
        Also return lse, the natural-log log-sum-exp of each row's final scores.
    return_weights : bool
        Also return the attention weights (exact, recomputed from lse; no gradient).
    backend : str
        "auto" (by array type and device), "reference", "flash", "small", "torch" or "triton".

    {masking}

    Returns
    -------
    out, or a tuple (out, [lse], [weights]) in that order.

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[10.0, 0], [0, 10]])
    >>> attnkit.attention(q, k, v).round(2)
    array([[6.7, 3.3]])
    >>> out, w = attnkit.attention(q, k, v, return_weights=True)
    >>> w.round(3)
    array([[0.67, 0.33]])
    >>> attnkit.attention(q, k, v, drop=np.array([[False, True]]))   # key 1 masked out
    array([[10.,  0.]])
    >>> out, lse = attnkit.attention(q, k, v, keep=np.zeros((1, 2), bool), return_lse=True)
    >>> out, lse                                                     # fully masked row
    (array([[0., 0.]]), array([-inf]))
    """
    key = kept = None
    if return_weights is False and type(return_lse) is bool:
        key, kept = kept_call(q, k, v, backend, masking)
        if kept is not None:
            direct = run_kept(kept, q, k, v, return_lse, masking.get("sinks"))
            if direct is not None:
                return direct if return_lse else direct[0]
    check_flags(return_lse=return_lse, return_weights=return_weights)
    given = q
    q, k, v = autocast(q, k, v)
    spec = validate(q, k, v, backend=backend, **masking)
    rung = backends.select(spec, backend)
    out, lse, weights = rung.rung_forward(spec, return_weights)
    if key is not None and kept is None and q is given and not spec.two_d:   # (autocast: another dtype)
        _keep(key, spec, rung, backend)
    res: tuple[Any, ...] = (_head_squeeze(spec.two_d, out, 2),)
    if return_lse:
        res += (_head_squeeze(spec.two_d, lse, 1),)
    if return_weights:
        res += (_head_squeeze(spec.two_d, weights, 2),)
    return res[0] if len(res) == 1 else res


@with_options()
def attention_weights(q: Any, k: Any, *, lse: Any = None, rows: Any = None, backend: str = "auto",
                      **masking: Unpack[Masking]) -> Any:
    """Exact attention probabilities for the query rows ``rows`` (all if None).

    With ``lse`` from a forward pass (``return_lse=True``) the weights are
    exp(scores − lse), with no second softmax pass; on the flash rung (the default for
    NumPy arrays and torch CPU tensors) the requested rows cost O(rows · S) memory and
    the full L × S matrix is never built (the reference rung, the definition, builds
    it). Returns (..., H, len(rows), S) (2-D q: (len(rows), S)). Fully masked rows are
    all zeros. With ``sinks`` the weights of a row sum to less than 1 (the rest went to
    the sink); with ``dropout`` they are the weights before dropout.

    Parameters
    ----------
    q, k : arrays
        Queries and keys (no values needed).
    lse : array, optional
        The lse of a forward pass with the same arguments.
    rows : int or sequence of ints, optional
        Query rows to return, in [-L, L).
    backend : str
        As for :func:`attention`.

    {masking}

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]]); k = np.eye(2)
    >>> attnkit.attention_weights(q, k, rows=[1]).round(3)
    array([[0.33, 0.67]])
    """
    q, k = autocast(q, k)
    spec = validate(q, k, None, backend=backend, need_v=False, **masking)
    if rows is not None:
        rows = check_rows(spec, rows)
    if lse is not None:
        check_lse(spec, lse, spec.user_lse_shape)
        lse = _head_unsqueeze(spec.two_d, lse, 1)
    w = backends.select(spec, backend).rung_weights(spec, lse, rows)
    return _head_squeeze(spec.two_d, w, 2)


@with_options()
def attention_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, backend: str = "auto",
                       **masking: Unpack[Masking]) -> tuple[Any, ...]:
    """Gradients of attention: (dq, dk, dv), then dbias when bias is given and dsinks
    when sinks are given.

    ``out`` and ``lse`` come from ``attention(..., return_lse=True)`` with the same
    arguments; ``dout`` is the gradient of the loss with respect to out. dk and dv sum
    over the query heads sharing a kv head (GQA) and over broadcast batch dims, so each
    gradient has its input's shape; dbias and dsinks are reduced to their inputs'
    shapes. Fully masked rows get zero gradients. With a global out and lse and a block
    of keys, the result is that block's share (ring attention, split-KV).

    Parameters
    ----------
    dout : array
        Gradient of the loss with respect to out (out's shape and dtype).
    q, k, v, out, lse : arrays
        The forward pass's inputs and results.
    backend : str
        As for :func:`attention`.

    {masking}

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[10.0, 0], [0, 10]])
    >>> out, lse = attnkit.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse)
    >>> dv.round(3)
    array([[0.67, 0.67],
           [0.33, 0.33]])
    """
    spec = validate(q, k, v, backend=backend, **masking)
    if spec.dropout > 0 and spec.seed is None:
        raise ValueError("seed: attention_backward with dropout needs the seed the forward pass used")
    check_grad_inputs(spec, dout, out, lse)
    dout, out = (_head_unsqueeze(spec.two_d, x, 2) for x in (dout, out))
    lse = _head_unsqueeze(spec.two_d, lse, 1)
    g = backends.select(spec, backend).rung_backward(spec, dout, out, lse)
    extra = tuple(x for x, given in ((g.dbias, spec.bias is not None), (g.dsinks, spec.sinks is not None))
                  if given)
    return (g.dq, g.dk, g.dv) + extra


@with_options(kvcache=True)
def attention_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, *, block_table: Any = None,
                      k_new: Any = None, v_new: Any = None, return_lse: bool = False, backend: str = "auto",
                      **masking: Unpack[Masking]) -> Any:
    """Decoding against a KV cache: attention of q (B, H, L, D) over each sequence's
    cached keys, after writing ``k_new``/``v_new`` into the cache (forward only).

    A contiguous cache is ``k_cache (B, Hkv, S_max, D)``; a paged one ``k_cache
    (num_pages, Hkv, page_size, D)`` with ``block_table (B, max_pages)`` of page
    indices (any page size, pages in any order): key p of sequence b is slot
    ``p % page_size`` of page ``block_table[b, p // page_size]``. ``cache_lengths``
    (B,) counts each sequence's valid keys; ``k_new``/``v_new`` (B, Hkv, L_new, D[v])
    are written in place at positions cache_lengths[b] … first (one call for append
    and attend, as FlashAttention's ``flash_attn_with_kvcache``; the caller advances
    cache_lengths). The queries then see cache_lengths[b] + L_new keys, causal
    aligned bottom-right per sequence (the last query sees the last key). Keys past a
    sequence's length are never read, so unused cache slots may hold anything.

    Sequences with different numbers of new tokens (prefill chunks next to single
    decoding steps, speculative drafts of different lengths) pass ``q_lengths`` (B,):
    sequence b's first q_lengths[b] query rows are real, the rest padding (out 0,
    lse −inf); with k_new (then L_new = L) it appends its first q_lengths[b] new keys,
    so it sees cache_lengths[b] + q_lengths[b] keys, its last real query the last.

    Parameters
    ----------
    q : array (B, H, L, D)
        The new queries (decoding: L = 1; speculative decoding / chunked prefill: L > 1).
    k_cache, v_cache : arrays
        The cache, contiguous or paged (see above), q's dtype and device.
    cache_lengths : ints (B,), or one int
        Valid keys per sequence before the append (one int, or a 0-d array or tensor:
        the same for every sequence, as FlashAttention's ``cache_seqlens``).
    block_table : ints (B, max_pages), optional
        Page indices of each sequence (a paged cache).
    k_new, v_new : arrays (B, Hkv, L_new, D[v]), optional
        Keys and values to append (all L_new of them, or with ``q_lengths`` the
        first q_lengths[b] of sequence b).
    return_lse : bool
        Also return lse (B, H, L).
    backend : str
        As for :func:`attention`.

    {masking}

    Returns
    -------
    out (B, H, L, Dv), or (out, lse).

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> k_cache = np.zeros((1, 1, 4, 2)); v_cache = np.zeros((1, 1, 4, 2))
    >>> k_cache[0, 0, :2] = [[1, 0], [0, 1]]; v_cache[0, 0, :2] = [[10, 0], [0, 10]]
    >>> q = np.array([[[[1.0, 0.0]]]])
    >>> attnkit.attention_kvcache(q, k_cache, v_cache, np.array([2])).round(2)
    array([[[[6.7, 3.3]]]])

    Two sequences, one bringing two new tokens and one bringing one (its second row
    is padding); each appends its own:

    >>> kc, vc = np.zeros((2, 1, 8, 2)), np.zeros((2, 1, 8, 2))
    >>> q = np.ones((2, 1, 2, 2)); k_new = np.ones((2, 1, 2, 2)); v_new = np.arange(8.0).reshape(2, 1, 2, 2)
    >>> out = attnkit.attention_kvcache(q, kc, vc, 3, k_new=k_new, v_new=v_new, q_lengths=np.array([2, 1]),
    ...                                 causal=True)
    >>> out[1, 0].round(2)                  # sequence 1: its token, then a padding row
    array([[2.31, 2.89],
           [0.  , 0.  ]])
    >>> kc[:, 0, 3:6, 0]                     # the keys appended: two, and one
    array([[1., 1., 0.],
           [1., 0., 0.]])
    """
    check_flags(return_lse=return_lse)
    if compiling():                  # torch.compile: one op, checked and run when the graph runs
        from .torch import kvcache_op
        out, lse = kvcache_op.kvcache_traced(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new,
                                             backend, dict(masking))
        return (out, lse) if return_lse else out
    # a decoding loop repeats one signature: after its first call, the rung's kept step
    # (where it has one) takes the call whole while select would choose as then
    key, step = kept_step(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, backend, masking)
    done = step[0](q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, masking.get("sinks"), return_lse) \
        if step is not None and step[1] == backends.settings() else None
    if done is not None:
        return done if return_lse else done[0]
    kv = validate_kvcache(q, k_cache, v_cache, cache_lengths, block_table=block_table, k_new=k_new,
                          v_new=v_new, backend=backend, signature_key=key, **masking)
    rung = cast(backends.CacheRung, backends.select(kv.spec, backend, need="kvcache"))
    kvcache.append(kv)
    out, lse = rung.rung_kvcache(kv)
    if kv.memo is not None and STEP not in kv.memo:
        make = getattr(rung, "kvcache_step", None)
        made = None if make is None else make(kv)
        kv.memo[STEP] = None if made is None else (made, backends.settings())
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(Q: Any, K: Any, V: Any, mask: Any = None) -> tuple[Any, Any]:
    """The seed's function, behaviour kept verbatim: returns (output, weights).

    ``mask`` is filled with -1e9 before the softmax — so a fully masked row gets the
    *mean of V*, not 0 (use ``attention(..., drop=mask)`` for the contract's 0 / -inf).

    Parameters
    ----------
    Q : NumPy array (L, D)
        Queries.
    K : NumPy array (S, D)
        Keys.
    V : NumPy array (S, Dv)
        Values.
    mask : array broadcastable to (L, S), optional
        True (or nonzero) = masked out, as the seed's ``np.where(mask, ...)`` read it.

    Returns
    -------
    (output (L, Dv), weights (L, S)) in Q's dtype.

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> out, w = attnkit.scaled_dot_product_attention(np.array([[1.0, 0.0]]), np.eye(2),
    ...                                               np.array([[10.0, 0], [0, 10]]))
    >>> out.round(2), w.round(3)
    (array([[6.7, 3.3]]), array([[0.67, 0.33]]))
    """
    return reference.seed(validate_seed(Q, K, V, mask))


def merge(outs: Any, lses: Any) -> tuple[Any, Any]:
    """Exact attention over the union of disjoint key blocks, from each block's
    (out, lse): the split-KV / ring-attention combine step. Rows fully masked in every
    block give out 0 and lse −inf; a NaN block makes its rows NaN.

    Parameters
    ----------
    outs : list of arrays (..., Dv)
        Each block's output (NumPy arrays or torch tensors, one library, equal shapes).
    lses : list of arrays (...)
        Each block's lse, out's shape without its last dim.

    Returns
    -------
    (out, lse) over all the blocks' keys (differentiable for torch tensors).

    Examples
    --------
    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[10.0, 0], [0, 10]])
    >>> parts = [attnkit.attention(q, k[i:i+1], v[i:i+1], return_lse=True) for i in (0, 1)]
    >>> out, lse = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    >>> out.round(2)
    array([[6.7, 3.3]])
    """
    return _merge_blocks(*check_merge(outs, lses))
