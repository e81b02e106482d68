"""Public functions: normalise → validate (spec.py) → dispatch (backends.py).

Masking keywords shared by every function (DESIGN.md §2), applied in this order::

    scores = scale · q kᵀ                      scale defaults to 1/√D
    scores = softcap · tanh(scores / softcap)  only if softcap is given
    scores = scores + bias                     bias: float, -inf allowed
    scores[excluded] = -inf                    keep=False / drop=True / causal / window
    weights = softmax(scores over keys);  out = weights v

- ``keep``: bool, True = may attend.  ``drop``: bool, True = masked out.  Both may
  be given; a key is excluded if either excludes it.
- ``causal``: key j excluded when j > diag(i).  ``window=(left, right)``: key j kept
  only if diag(i) - left <= j <= diag(i) + right (None = unbounded on that side).
- ``align``: "bottom_right" (default, diag(i) = i + S - L) or "top_left"
  (diag(i) = i, PyTorch's is_causal); see attnkit.spec for the pictures.
- A fully masked query row gives out = 0, weights = 0, lse = -inf, zero gradients.
"""

from __future__ import annotations

from . import backends, reference
from .spec import check_grad_inputs, check_lse, check_merge, check_rows, validate, validate_seed


def _head_squeeze(spec, x, tail):
    """2-D q gives outputs without the head axis: drop axis -(tail + 1)."""
    if not spec.two_d or x is None:
        return x
    return x[(Ellipsis, 0) + (slice(None),) * tail]


def _head_unsqueeze(spec, x, tail):
    return x[(Ellipsis, None) + (slice(None),) * tail] if spec.two_d else x


def attention(q, k, v, *, scale=None, causal=False, window=None, align="bottom_right",
              keep=None, drop=None, bias=None, softcap=None,
              return_lse=False, return_weights=False, backend="auto"):
    """Exact scaled dot-product attention, softmax(scale · q kᵀ [+ masks]) v.

    Shapes: q (..., H, L, D), k (..., Hkv, S, D), v (..., Hkv, S, Dv) with H % Hkv == 0
    → out (..., H, L, Dv), lse (..., H, L), weights (..., H, L, S). 2-D q, k, v
    (the seed's form) give 2-D out. ``out`` and ``weights`` have q's dtype; ``lse``
    is float32 (float64 for float64 inputs). A fully masked row gives out 0,
    weights 0 and lse -inf.

    Returns out, or a tuple (out, [lse], [weights]) in that order.

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
    spec = validate(q, k, v, scale=scale, causal=causal, window=window, align=align,
                    keep=keep, drop=drop, bias=bias, softcap=softcap, backend=backend)
    out, lse, weights = backends.select(spec, backend).rung_forward(spec, return_weights)
    res = (_head_squeeze(spec, out, 2),)
    if return_lse:
        res += (_head_squeeze(spec, lse, 1),)
    if return_weights:
        res += (_head_squeeze(spec, weights, 2),)
    return res[0] if len(res) == 1 else res


def attention_weights(q, k, *, lse=None, rows=None, scale=None, causal=False, window=None,
                      align="bottom_right", keep=None, drop=None, bias=None, softcap=None,
                      backend="auto"):
    """Exact attention probabilities for the query rows ``rows`` (all if None).

    With ``lse`` from a forward pass (``return_lse=True``) the weights are
    exp(scores − lse), with no second softmax pass; on the flash rung (the default for
    NumPy arrays and torch CPU tensors) the requested rows cost O(rows · S) memory and
    the full L × S matrix is never built (the reference rung, the definition, builds it). Returns (..., H, len(rows), S)
    (2-D q: (len(rows), S)). Rows that are fully masked are all zeros.

    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0], [0.0, 1.0]]); k = np.eye(2)
    >>> attnkit.attention_weights(q, k, rows=[1]).round(3)
    array([[0.33, 0.67]])
    """
    spec = validate(q, k, None, scale=scale, causal=causal, window=window, align=align,
                    keep=keep, drop=drop, bias=bias, softcap=softcap, backend=backend)
    if rows is not None:
        rows = check_rows(spec, rows)
    if lse is not None:
        check_lse(spec, lse, spec.user_lse_shape)
        lse = _head_unsqueeze(spec, lse, 1)
    w = backends.select(spec, backend).rung_weights(spec, lse, rows)
    return _head_squeeze(spec, w, 2)


def attention_backward(dout, q, k, v, out, lse, *, scale=None, causal=False, window=None,
                       align="bottom_right", keep=None, drop=None, bias=None, softcap=None,
                       backend="auto"):
    """Gradients of attention: (dq, dk, dv), plus dbias when bias is given.

    ``out`` and ``lse`` come from ``attention(..., return_lse=True)`` with the same
    arguments; ``dout`` is the gradient of the loss with respect to out. dk and dv sum
    over the query heads sharing a kv head (GQA) and over broadcast batch dims, so each
    gradient has its input's shape; dbias is reduced to bias's shape. Fully masked
    rows get zero gradients.

    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[10.0, 0], [0, 10]])
    >>> out, lse = attnkit.attention(q, k, v, return_lse=True)
    >>> dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse)
    >>> dv.round(3)
    array([[0.67, 0.67],
           [0.33, 0.33]])
    """
    spec = validate(q, k, v, scale=scale, causal=causal, window=window, align=align,
                    keep=keep, drop=drop, bias=bias, softcap=softcap, backend=backend)
    check_grad_inputs(spec, dout, out, lse, spec.user_out_shape)
    dout, out, lse = (_head_unsqueeze(spec, dout, 2), _head_unsqueeze(spec, out, 2),
                      _head_unsqueeze(spec, lse, 1))
    dq, dk, dv, dbias = backends.select(spec, backend).rung_backward(spec, dout, out, lse)
    return (dq, dk, dv) if dbias is None else (dq, dk, dv, dbias)


def scaled_dot_product_attention(Q, K, V, mask=None):
    """The seed's function, behaviour kept verbatim: returns (output, weights).

    2-D Q (L, D), K (S, D), V (S, Dv); ``mask`` is boolean with True = masked out,
    filled with -1e9 before the softmax — so a fully masked row gets the *mean of V*,
    not 0 (use ``attention(..., drop=mask)`` for the contract's 0 / -inf).

    >>> import numpy as np, attnkit
    >>> out, w = attnkit.scaled_dot_product_attention(np.array([[1.0, 0.0]]), np.eye(2),
    ...                                               np.array([[10.0, 0], [0, 10]]))
    >>> out.round(2), w.round(3)
    (array([[6.7, 3.3]]), array([[0.67, 0.33]]))
    """
    return reference.seed(validate_seed(Q, K, V, mask))


def merge(outs, lses):
    """Exact attention over the union of disjoint key blocks, from each block's
    (out, lse): the split-KV / ring-attention combine step. Returns (out, lse).
    Rows fully masked in every block give out 0 and lse −inf.

    >>> import numpy as np, attnkit
    >>> q = np.array([[1.0, 0.0]]); k = np.eye(2); v = np.array([[10.0, 0], [0, 10]])
    >>> parts = [attnkit.attention(q, k[i:i+1], v[i:i+1], return_lse=True) for i in (0, 1)]
    >>> out, lse = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    >>> out.round(2)
    array([[6.7, 3.3]])
    """
    from .flash import merge as _merge
    return _merge(*check_merge(outs, lses))
