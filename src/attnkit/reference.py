"""The definition: softmax(q kᵀ / √D) v as the seed's four steps, one numbered pass each.

This rung materialises the full (..., H, L, S) score matrix, computes in float32 for
half inputs and float64 for float64, and is the oracle every faster rung is tested
against. ``trace`` is a callback ``trace(name, array)`` that sees every intermediate;
``attnkit.explain`` is built on it, so the teaching tool runs this very code.
"""

from __future__ import annotations

import numpy as np

from .spec import Spec, broadcast_to, reduce_to


def _operands(spec: Spec):
    """q, k, v as NumPy arrays in the accumulation dtype, k and v repeated per query
    head (GQA: head h reads kv head h // group)."""
    acc = spec.acc_dtype
    q = np.asarray(spec.q, dtype=acc)
    k = np.repeat(np.asarray(spec.k, dtype=acc), spec.group, axis=-3)
    v = None if spec.v is None else np.repeat(np.asarray(spec.v, dtype=acc), spec.group, axis=-3)
    return q, k, v


def _softmax(scores):
    """Row softmax and its lse; a row of all -inf gives weights 0 and lse -inf."""
    m = scores.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)                 # all -inf row: shift by 0, not -inf (no NaN)
    e = np.exp(scores - m)
    l = e.sum(axis=-1, keepdims=True)
    weights = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    log_l = np.log(l, out=np.full_like(l, -np.inf), where=l > 0)  # log(0) = -inf without a warning
    return weights, (log_l + m)[..., 0]


def final_scores(spec: Spec, q, k, trace=None):
    """Steps 1–2 on the operands q, k (:func:`_operands`): (final scores with −inf
    where excluded, tanh(scores / softcap) or None) — what backward needs."""
    t = trace or (lambda name, x: None)

    # Step 1: dot products — how well each query matches each key.
    scores = q @ np.swapaxes(k, -1, -2)                  # (..., H, L, S)
    t("scores", scores)

    # Step 2: scale by 1/√D (or `scale`) so the softmax does not saturate as D grows.
    scores = scores * spec.scale
    t("scaled", scores)
    capped = None
    if spec.softcap is not None:                         # 2a: softcap · tanh(scores / softcap)
        capped = np.tanh(scores / spec.softcap)
        scores = spec.softcap * capped
        t("softcapped", scores)
    if spec.bias is not None:                            # 2b: additive bias (-inf allowed)
        scores = scores + np.asarray(spec.bias, dtype=scores.dtype)
        t("biased", scores)
    excluded = spec.excluded()
    if excluded is not None:                             # 2c: keep / drop / causal / window
        scores = np.where(excluded, -np.inf, scores)
        t("excluded", broadcast_to(excluded, spec.score_shape))
        t("masked", scores)
    return scores, capped


def forward(spec: Spec, trace=None):
    """(out, lse, weights) in the accumulation dtype, shapes (..., H, L, Dv),
    (..., H, L), (..., H, L, S)."""
    q, k, v = _operands(spec)
    scores, _ = final_scores(spec, q, k, trace)

    # Step 3: softmax over keys turns scores into weights that sum to 1 per query.
    weights, lse = _softmax(scores)
    if trace:
        trace("weights", weights)
        trace("lse", lse)

    # Step 4: weighted sum of values — each output is a blend of the values.
    out = weights @ v                                    # (..., H, L, Dv)
    if trace:
        trace("out", out)
    return out, lse, weights


def from_lse(scores, lse):
    """weights = exp(scores − lse): the softmax recomputed from a saved lse, with
    fully masked rows (lse = −inf) giving 0 instead of NaN."""
    lse = lse[..., None]
    finite = np.isfinite(lse)
    return np.exp(scores - np.where(finite, lse, 0.0)) * finite


def backward(spec: Spec, dout, out, lse, dlse=None):
    """Gradients by the chain rule back through the four steps, with the softmax
    normalised by the given ``lse`` and its Jacobian term rowsum(w ∘ dw) taken as
    rowsum(dout ∘ out) — so a block of keys gets its share of the gradient of the
    whole (ring attention, split-KV), and with out, lse from this block alone it is
    the ordinary gradient. ``dlse`` (optional, lse's shape) is a gradient for lse:
    d lse / d scores = weights, so it enters that term with the opposite sign.
    Returns (dq, dk, dv, dbias) reduced to the shapes the user passed; dbias is None
    without bias. Fully masked rows give zero gradients."""
    q, k, v = _operands(spec)
    scores, capped = final_scores(spec, q, k)
    acc = q.dtype
    dout, out, lse = (np.asarray(x, dtype=acc) for x in (dout, out, lse))
    weights = from_lse(scores, lse)

    # Step 4 back: out = weights v
    dv = np.swapaxes(weights, -1, -2) @ dout             # (..., H, S, Dv)
    dweights = dout @ np.swapaxes(v, -1, -2)             # (..., H, L, S)
    # Step 3 back: softmax Jacobian, dz = w ∘ (dw − Σ_j w dw), and Σ_j w dw = dout · out
    delta = (dout * out).sum(axis=-1, keepdims=True)
    if dlse is not None:                                 # d lse / dz = weights
        delta = delta - np.asarray(dlse, dtype=acc)[..., None]
    dz = weights * (dweights - delta)
    dbias = None if spec.bias is None else reduce_to(dz, spec.shapes["bias"])
    # Step 2 back: softcap and scale
    if capped is not None:
        dz = dz * (1.0 - capped * capped)                # d/ds c·tanh(s/c) = 1 − tanh²
    dz = dz * spec.scale
    # Step 1 back: scores = q kᵀ
    dq = dz @ k                                          # (..., H, L, D)
    dk = np.swapaxes(dz, -1, -2) @ q                     # (..., H, S, D)
    return spec.to_inputs(dq, dk, dv) + (dbias,)


# ---- the rung interface (see backends.py) ---------------------------------------
def not_supported_reasons(spec: Spec) -> list[str]:
    return ["takes NumPy arrays (torch tensors use backend='torch')"] if spec.torch else []


def rung_forward(spec: Spec, need_weights: bool = False):
    out, lse, weights = forward(spec)
    return out.astype(spec.dtype), lse, (weights.astype(spec.dtype) if need_weights else None)


def rung_backward(spec: Spec, dout, out, lse, dlse=None):
    dq, dk, dv, dbias = backward(spec, dout, out, lse, dlse)
    dt = spec.dtype
    return dq.astype(dt), dk.astype(dt), dv.astype(dt), (None if dbias is None else dbias.astype(np.asarray(spec.bias).dtype))


def rung_weights(spec: Spec, lse=None, rows=None):
    q, k, _ = _operands(spec)
    scores, _ = final_scores(spec, q, k)
    weights = _softmax(scores)[0] if lse is None else from_lse(scores, np.asarray(lse, dtype=scores.dtype))
    weights = weights if rows is None else weights[..., rows, :]
    return weights.astype(spec.dtype)


def seed(spec: Spec):
    """The seed's scaled_dot_product_attention: masked scores are *replaced* by -1e9
    (so a fully masked row averages V). Returns (output, weights) in q's dtype."""
    q, k, v = _operands(spec)
    scores = q @ np.swapaxes(k, -1, -2) * spec.scale
    if spec.drop is not None:
        scores = np.where(np.asarray(spec.drop), -1e9, scores)
    weights, _ = _softmax(scores)
    out = weights @ v
    return out[0].astype(spec.dtype), weights[0].astype(spec.dtype)
