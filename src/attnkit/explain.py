"""explain: the four steps of attention on real numbers, recorded by reference.py's
trace hook (never a second copy of the math)."""

from __future__ import annotations

import numpy as np

from . import reference
from .spec import validate

# The seed's worked example: a query wanting "sweet"; keys apple and cheese.
EXAMPLE = dict(q=[[1.0, 0.0]], k=[[1.0, 0.0], [0.0, 1.0]], v=[[10.0, 0.0], [0.0, 10.0]],
               labels=("apple", "cheese"))


def explain(q, k, v, **kwargs):
    """Run attention through the reference with a trace; returns {step name: array}
    in the order computed (scores, scaled, [softcapped, biased, excluded, masked],
    weights, lse, out).

    >>> t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]])
    >>> list(t), t["weights"].round(3).tolist()
    (['scores', 'scaled', 'weights', 'lse', 'out'], [[[0.67, 0.33]]])
    """
    spec = validate(np.asarray(q, dtype=float), np.asarray(k, dtype=float),
                    np.asarray(v, dtype=float), **kwargs)
    steps = {}
    reference.forward(spec, trace=lambda name, x: steps.__setitem__(name, np.array(x)))
    return steps


def worked_example() -> str:
    """The seed's example, step by step with the arithmetic shown."""
    ex = EXAMPLE
    t = explain(ex["q"], ex["k"], ex["v"])
    s, sc, w, out = t["scores"][0, 0], t["scaled"][0, 0], t["weights"][0, 0], t["out"][0, 0]
    a, c = ex["labels"]
    e = np.exp(sc)
    lines = [
        "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V  — the seed's worked example",
        "",
        "query  q = (1, 0)        wants 'sweet'",
        f"keys   {a} = (1, 0), {c} = (0, 1)",
        f"values {a} = (10, 0), {c} = (0, 10)",
        "",
        "Step 1  scores = q · k",
        f"        q·{a}  = 1·1 + 0·0 = {s[0]:g}",
        f"        q·{c} = 1·0 + 0·1 = {s[1]:g}",
        "Step 2  scale by 1/√d_k, d_k = 2, √2 ≈ 1.414",
        f"        {s[0]:g} / 1.414 = {sc[0]:.3f}      {s[1]:g} / 1.414 = {sc[1]:.3f}",
        "Step 3  softmax: weights = e^score / Σ e^score",
        f"        e^{sc[0]:.3f} ≈ {e[0]:.3f}   e^{sc[1]:.3f} = {e[1]:.3f}   total {e.sum():.3f}",
        f"        weights: {a} {w[0]:.3f}, {c} {w[1]:.3f}",
        "Step 4  output = Σ weight · value",
        f"        {w[0]:.3f}·(10, 0) + {w[1]:.3f}·(0, 10) = ({out[0]:.2f}, {out[1]:.2f})",
        "",
        f"Reading: the query matches {a} best, so the answer leans {w[0]:.0%} toward {a}'s",
        f"value — a blend, not a copy.",
    ]
    return "\n".join(lines)
