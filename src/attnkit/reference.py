"""The definition: softmax(q kᵀ / √D) v as the seed's four steps, one numbered pass each.

This rung materialises the full (..., H, L, S) score matrix, computes in float32 for
half inputs and float64 for float64, and is the oracle every faster rung is tested
against. ``trace`` is a callback ``trace(name, array)`` that sees every intermediate;
``attnkit.explain`` is built on it, so the teaching tool runs this very code.

>>> import numpy as np
>>> from attnkit.spec import validate
>>> out, lse, w = forward(validate(np.array([[1.0, 0.0]]), np.eye(2), np.eye(2)))
>>> w.round(3).tolist()
[[[0.67, 0.33]]]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import philox
from .backends import Grads
from .nonfinite import exempt_matmul, quiet
from .spec import Spec, broadcast_to, reduce_to
from .spec import geometry as geo

name = "reference"
Trace = Callable[[str, np.ndarray], None]


def _operands(spec: Spec) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """q, k, v as NumPy arrays in the accumulation dtype, k and v repeated per query
    head (GQA: head h reads kv head h // group)."""
    acc = spec.acc_dtype
    q = np.asarray(spec.q, dtype=acc)
    k = np.repeat(np.asarray(spec.k, dtype=acc), spec.group, axis=-3)
    v = None if spec.v is None else np.repeat(np.asarray(spec.v, dtype=acc), spec.group, axis=-3)
    return q, k, v


def _sinks(spec: Spec, dtype: Any) -> np.ndarray | None:
    """The sink logits broadcast to (..., H, L, 1), or None."""
    if spec.sinks is None:
        return None
    return broadcast_to(np.asarray(spec.sinks, dtype=dtype), spec.lse_shape)[..., None]


def _softmax(scores: np.ndarray, sinks: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Row softmax (with one extra sink logit per row when given) and its lse. A row
    of only -inf scores (and no sink) gives weights 0 and lse -inf; a NaN or +inf
    score (or sink) makes its row NaN."""
    m = scores.max(axis=-1, keepdims=True)              # NaN propagates
    if sinks is not None:
        m = np.maximum(m, sinks)
    shift = np.where(m == -np.inf, 0.0, m)               # every key excluded: shift by 0, not -inf
    e = np.exp(scores - shift)
    l = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(sinks - shift)
    weights = np.divide(e, l, out=np.zeros_like(e), where=l != 0)
    log_l = np.log(l, out=np.full_like(l, -np.inf), where=l != 0)   # log(0) = -inf without a warning
    return weights, (log_l + shift)[..., 0]


def final_scores(spec: Spec, q: np.ndarray, k: np.ndarray, trace: Trace | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """Steps 1–2 on the operands q, k (:func:`_operands`): (final scores with −inf
    where excluded, tanh(scores / softcap) or None) — what backward needs."""
    def t(name: str, x: np.ndarray) -> None:
        if trace is not None:
            trace(name, x)

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
    if spec.alibi_slopes is not None:                    # 2c: ALiBi, −slope · |diag(i) − j|
        scores = scores + geo.alibi_bias(spec, scores.dtype)
        t("alibi", scores)
    excluded = geo.excluded(spec)
    if excluded is not None:                             # 2d: keep / drop / causal / window / lengths
        scores = np.where(excluded, -np.inf, scores)
        t("excluded", broadcast_to(excluded, spec.score_shape))
        t("masked", scores)
    return scores, capped


def dropout_scale(spec: Spec, dtype: Any) -> np.ndarray | None:
    """kept / (1 − p) for every score (…, H, L, S), or None without dropout."""
    if spec.dropout == 0:
        return None
    n = int(np.prod(spec.batch, dtype=np.int64))
    head = np.arange(n * spec.H, dtype=np.int64).reshape(spec.batch + (spec.H, 1, 1))
    r, c = spec.origin                                   # a block of a larger problem: global positions
    keep = philox.kept(int(spec.seed), spec.dropout, head, np.arange(r, r + spec.L)[:, None],
                       np.arange(c, c + spec.S)[None, :])
    return keep * np.asarray(1.0 / (1.0 - spec.dropout), dtype=dtype)


def _padding(spec: Spec, weights: np.ndarray, lse: np.ndarray) -> None:
    """Padding rows (i >= q_lengths[b]): weights 0 and lse -inf, sink or not."""
    pad = geo.padding_rows(spec)
    if pad is not None:
        pad = np.broadcast_to(pad, lse.shape)
        lse[pad] = -np.inf
        weights[pad] = 0.0


def forward(spec: Spec, trace: Trace | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(out, lse, weights) in the accumulation dtype, shapes (..., H, L, Dv),
    (..., H, L), (..., H, L, S). ``weights`` are before dropout."""
    q, k, v = _operands(spec)
    scores, _ = final_scores(spec, q, k, trace)

    # Step 3: softmax over keys turns scores into weights that sum to 1 per query (less
    # than 1 with a sink: the rest of the mass goes to the sink).
    weights, lse = _softmax(scores, _sinks(spec, scores.dtype))
    _padding(spec, weights, lse)
    if trace:
        trace("weights", weights)
        trace("lse", lse)
    z = dropout_scale(spec, weights.dtype)
    dropped = weights if z is None else weights * z
    if z is not None and trace:
        trace("dropped", dropped)

    # Step 4: weighted sum of values — each output is a blend of the values. A key
    # with score −inf never reads its value (see attnkit.nonfinite).
    assert v is not None
    out = exempt_matmul(dropped, v, lambda: scores != -np.inf)    # (..., H, L, Dv)
    if trace:
        trace("out", out)
    return out, lse, weights


def from_lse(scores: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """weights = exp(scores − lse): the softmax recomputed from a saved lse. Keys with
    score −inf and rows with lse −inf give 0; a NaN lse gives NaN on the other keys."""
    lse = lse[..., None]
    shift = np.where(lse == -np.inf, np.inf, lse)        # lse −inf: exp(s − inf) = 0
    w = np.exp(scores - shift)
    return np.where(scores == -np.inf, 0.0, w)


def sink_gradient(spec: Spec, lse: Any, delta: Any) -> Any:
    """d loss / d sinks, reduced to the shape the user gave sinks, for every rung
    (NumPy arrays or torch tensors, in lse's dtype): the sink is a logit with value 0,
    so its score gradient is w_sink · (0 − delta) with w_sink = exp(sink − lse) — 0
    where the sink or lse is −inf (padding rows: whatever the sink) — and delta =
    rowsum(dout ∘ out) − dlse, (..., H, L)."""
    inf = float("inf")
    where: Any
    exp: Any
    if isinstance(lse, np.ndarray):
        where, exp = np.where, np.exp
        sinks = broadcast_to(np.asarray(spec.sinks, dtype=lse.dtype), lse.shape)
    else:
        import torch
        where, exp = torch.where, torch.exp
        sinks = spec.sinks.to(lse.dtype).broadcast_to(lse.shape)
    shift = where(lse == -inf, inf, lse)                   # lse −inf: exp(s − inf) = 0
    w_sink = where(lse == -inf, 0.0, exp(sinks - shift))    # a −inf sink: exp(−inf) = 0
    return reduce_to(-(w_sink * delta), tuple(spec.sinks.shape)).reshape(spec.shapes["sinks"])


def backward(spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None) -> Grads:
    """Gradients by the chain rule back through the four steps, with the softmax
    normalised by the given ``lse`` and its Jacobian term rowsum(w ∘ dw) taken as
    rowsum(dout ∘ out) — so a block of keys gets its share of the gradient of the
    whole (ring attention, split-KV), and with out, lse from this block alone it is
    the ordinary gradient. ``dlse`` (optional, lse's shape) is a gradient for lse:
    d lse / d scores = weights, so it enters that term with the opposite sign.
    Returns gradients reduced to the shapes the user passed (dbias / dsinks None
    without bias / sinks). Fully masked and padding rows give zero gradients; keys
    with score −inf get none."""
    q, k, v = _operands(spec)
    assert v is not None
    scores, capped = final_scores(spec, q, k)
    acc = q.dtype
    dout, out, lse = (np.asarray(x, dtype=acc) for x in (dout, out, lse))
    weights = from_lse(scores, lse)
    vis = scores != -np.inf
    z = dropout_scale(spec, acc)
    dropped = weights if z is None else weights * z

    # Step 4 back: out = dropout(weights) v
    dv = exempt_matmul(np.swapaxes(dropped, -1, -2), dout, np.swapaxes(vis, -1, -2))  # (..., H, S, Dv)
    dweights = dout @ np.swapaxes(v, -1, -2)             # (..., H, L, S)
    if z is not None:
        dweights = dweights * z
    # Step 3 back: softmax Jacobian, dz = w ∘ (dw − Σ_j w dw), and Σ_j w dw = dout · out
    delta = (dout * out).sum(axis=-1, keepdims=True)
    if dlse is not None:                                 # d lse / dz = weights
        delta = delta - np.asarray(dlse, dtype=acc)[..., None]
    dz = np.where(vis, weights * (dweights - delta), 0.0)
    dsinks = None if spec.sinks is None else sink_gradient(spec, lse, delta[..., 0])
    dbias = None if spec.bias is None else reduce_to(dz, spec.shapes["bias"])
    # Step 2 back: softcap and scale
    if capped is not None:
        # d/ds c·tanh(s/c) = 1 − tanh², on the pairs a row sees: an excluded pair's tanh
        # may be NaN (inf · 0 from an infinite q or k entry), and excluded pairs are exempt
        dz = np.where(vis, dz * (1.0 - capped * capped), 0.0)
    dz = dz * spec.scale
    # Step 1 back: scores = q kᵀ
    dq = exempt_matmul(dz, k, vis)                       # (..., H, L, D)
    dk = exempt_matmul(np.swapaxes(dz, -1, -2), q, np.swapaxes(vis, -1, -2))   # (..., H, S, D)
    dq, dk, dv = spec.to_inputs(dq, dk, dv)
    return Grads(dq, dk, dv, dbias, dsinks)


# ---- the rung interface (see backends.py) ---------------------------------------
def not_supported_reasons(spec: Spec) -> list[str]:
    if spec.torch and spec.q.device.type != "cpu":
        return [f"runs on the CPU (torch CPU tensors through the torch op), got device {spec.q.device}"]
    return []


def _user_dtype(spec: Spec, name: str) -> Any:
    x = getattr(spec, name)
    return None if x is None else np.asarray(x).dtype


def rung_forward(spec: Spec, need_weights: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    with quiet():                                        # (the casts too: a float16 overflow is inf)
        out, lse, weights = forward(spec)
        return out.astype(spec.dtype), lse, (weights.astype(spec.dtype) if need_weights else None)


def rung_backward(spec: Spec, dout: Any, out: Any, lse: Any, dlse: Any = None, need_dbias: bool = True) -> Grads:
    with quiet():
        g = backward(spec, dout, out, lse, dlse)
        dt = spec.dtype
        return Grads(g.dq.astype(dt), g.dk.astype(dt), g.dv.astype(dt),
                     None if g.dbias is None or not need_dbias else g.dbias.astype(_user_dtype(spec, "bias")),
                     None if g.dsinks is None else g.dsinks.astype(_user_dtype(spec, "sinks")))


def rung_weights(spec: Spec, lse: Any = None, rows: Any = None) -> np.ndarray:
    with quiet():
        return _weights(spec, lse, rows)


def _weights(spec: Spec, lse: Any, rows: Any) -> np.ndarray:
    q, k, _ = _operands(spec)
    scores, _ = final_scores(spec, q, k)
    if lse is None:
        weights, lse_all = _softmax(scores, _sinks(spec, scores.dtype))
        _padding(spec, weights, lse_all)
    else:
        weights = from_lse(scores, np.asarray(lse, dtype=scores.dtype))
    weights = weights if rows is None else weights[..., rows, :]
    return weights.astype(spec.dtype)


def gathered(kv: Any) -> Spec:
    """attention_kvcache's call as a plain one: each sequence's keys gathered from the
    cache (:func:`attnkit.kvcache.gather`), excluded past its length."""
    from .kvcache import gather, seen
    kv = seen(kv)
    k, v = gather(kv)
    if k.shape[-2] == 0:                                 # a block table without columns: the Spec's
        k, v = kv.spec.k, kv.spec.v                      # stand-in key (excluded: every length is 0)
    return kv.spec.replace(k=np.asarray(k), v=np.asarray(v))


def rung_kvcache(kv: Any) -> tuple[np.ndarray, np.ndarray]:
    """attention_kvcache by the definition: :func:`gathered`, then the forward above."""
    out, lse, _ = rung_forward(gathered(kv))
    return out, lse


def seed(spec: Spec) -> tuple[np.ndarray, np.ndarray]:
    """The seed's scaled_dot_product_attention: masked scores are *replaced* by -1e9
    (so a fully masked row averages V). Returns (output, weights) in q's dtype."""
    q, k, v = _operands(spec)
    scores = q @ np.swapaxes(k, -1, -2) * spec.scale
    if spec.drop is not None:
        scores = np.where(np.asarray(spec.drop), -1e9, scores)
    weights, _ = _softmax(scores)
    out = weights @ v
    return out[0].astype(spec.dtype), weights[0].astype(spec.dtype)
