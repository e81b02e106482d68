"""The common mistakes, made visible with numbers computed by
:func:`attnkit.attention`: leaving out the √d_k scaling (an entropy sweep over d_k),
mixing up the roles of Q, K and V, expecting the best value to be copied, and order
blindness.
"""

from __future__ import annotations

import math

import numpy as np

from .example import EXAMPLE
from .formatting import WIDTH, vec, wrap


def entropy(weights):
    """Mean over rows of the Shannon entropy -Σ w ln w of each weight row, in nats
    (ln S for uniform weights, 0 for a one-hot row; 0 · ln 0 counts 0).

    >>> round(entropy(np.full((1, 4), 0.25)), 4), entropy(np.eye(3))
    (1.3863, 0.0)
    """
    w = np.asarray(weights, dtype=np.float64)
    logw = np.log(w, out=np.zeros_like(w), where=w > 0)
    return float(-(w * logw).sum(axis=-1).mean()) + 0.0     # + 0.0: no "-0.0"


DIMS = tuple(2 ** n for n in range(1, 11))   # d_k = 2 … 1024


def entropy_sweep(dims=DIMS, *, S=64, L=64, trials=4,
                  seed=0, progress=None) -> dict:
    """Leaving out the √d_k scaling: for each d_k, random unit-normal q, k (so q·k has
    variance d_k) through :func:`attnkit.attention` with the default scale 1/√d_k and
    with scale 1. Returns lists ``d_k``, ``scaled``, ``unscaled`` (mean entropy of the
    weights, nats), ``max_weight_unscaled``, and ``uniform`` = ln S. ``progress(i, n,
    d_k)`` is called after each size.

    >>> r = entropy_sweep(dims=(2, 256), S=16, L=16, trials=1)
    >>> r["unscaled"][1] < 0.5 * r["unscaled"][0], abs(r["scaled"][1] - r["scaled"][0]) < 0.5
    (True, True)
    """
    from ..api import attention
    rng = np.random.default_rng(seed)
    res = {"d_k": [], "scaled": [], "unscaled": [], "max_weight_unscaled": [],
           "uniform": math.log(S), "S": S}
    for i, d in enumerate(dims):
        q = rng.standard_normal((trials, L, d))
        k = rng.standard_normal((trials, S, d))
        v = rng.standard_normal((trials, S, 1))
        _, w_scaled = attention(q, k, v, return_weights=True)
        _, w_raw = attention(q, k, v, scale=1.0, return_weights=True)
        res["d_k"].append(int(d))
        res["scaled"].append(entropy(w_scaled))
        res["unscaled"].append(entropy(w_raw))
        res["max_weight_unscaled"].append(float(w_raw.max(axis=-1).mean()))
        if progress:
            progress(i + 1, len(dims), d)
    return res


def mistakes(progress=None) -> dict:
    """The common mistakes, as numbers computed by :func:`attnkit.attention`:
    ``entropy`` (see :func:`entropy_sweep`), ``roles`` (keys and values swapped),
    ``blend`` (a blend, not the best value copied; sharper only as the scale grows)
    and ``order`` (permuting the items permutes the outputs).

    >>> m = mistakes()
    >>> m["roles"]["right"], m["order"]["outputs_permuted"]
    ([6.7, 3.3], True)
    """
    from ..api import attention
    ex = EXAMPLE
    q, k, v = (np.array(ex[n]) for n in ("q", "k", "v"))
    right = attention(q, k, v)[0]
    swapped = attention(q, v, k)[0]             # keys and values mixed up
    scales = [1 / math.sqrt(2), 1.0, 4.0, 16.0, 64.0]
    sharp = [attention(q, k, v, scale=c, return_weights=True) for c in scales]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3))             # four items, no positions
    perm = np.array([2, 0, 3, 1])
    y = attention(x, x, x)
    y_perm = attention(x[perm], x[perm], x[perm])
    return {
        "entropy": entropy_sweep(progress=progress),
        "roles": {"right": right.round(2).tolist(), "keys_values_swapped": swapped.round(2).tolist()},
        "blend": {"best_value": v[0].tolist(), "output": right.round(2).tolist(),
                  "scales": [round(c, 3) for c in scales],
                  "weights": [w[0].round(3).tolist() for _, w in sharp],
                  "outputs": [o[0].round(2).tolist() for o, _ in sharp]},
        "order": {"perm": perm.tolist(),
                  "max_diff": float(np.abs(y_perm - y[perm]).max()),
                  "outputs_permuted": bool(np.allclose(y_perm, y[perm], rtol=0, atol=1e-12)),
                  "row0": y[0].round(3).tolist(), "row0_after": y_perm[1].round(3).tolist()},
    }


def mistakes_text(m: dict, width: int = WIDTH) -> str:
    """The mistakes as text tables, readable at ``width`` columns."""
    e = m["entropy"]
    L = ["Common mistakes, made visible with numbers", "",
         "1. Leaving out the √d_k scaling",
         *wrap([f"Random q, k with unit-normal entries: q·k has variance d_k, so "
                 f"without the 1/√d_k scale the scores grow with d_k and the softmax "
                 f"saturates: the entropy of the weights (over S = {e['S']} keys, "
                 f"uniform = ln {e['S']} = {e['uniform']:.2f} nats) collapses toward 0."],
                width, indent=3),
         "",
         f"   {'d_k':>6}  {'entropy scaled':>15}  {'entropy unscaled':>17}  {'max weight unscaled':>20}"]
    for d, a, b, mw in zip(e["d_k"], e["scaled"], e["unscaled"], e["max_weight_unscaled"]):
        L.append(f"   {d:>6}  {a:>15.3f}  {b:>17.3f}  {mw:>20.3f}")
    r = m["roles"]
    L += ["", "2. Mixing up the roles of Q, K and V",
          *wrap(["Q is what a query looks for, K what each item is matched on, V what "
                  "each item gives back. In the worked example (q = (1, 0), keys apple "
                  "(1, 0), cheese (0, 1), values (10, 0), (0, 10)):"], width, indent=3),
          f"   attention(q, k, v) = {vec(r['right'], 2)}   right",
          f"   attention(q, v, k) = {vec(r['keys_values_swapped'], 2)}   keys and values swapped"]
    bl = m["blend"]
    L += ["", "3. Expecting the best-matching value to be copied",
          *wrap([f"apple matches best, but the output is {vec(bl['output'], 2)}, not apple's "
                  f"value {vec(bl['best_value'], 0)}: attention blends the values by their "
                  "weights. Only a larger scale sharpens it toward a copy:"], width, indent=3),
          f"   {'scale':>7}  {'weights (apple, cheese)':>24}  {'output':>16}"]
    for c, w, o in zip(bl["scales"], bl["weights"], bl["outputs"]):
        L.append(f"   {c:>7g}  {vec(w, 3):>24}  {vec(o, 2):>16}")
    o = m["order"]
    L += ["", "4. Order blindness",
          *wrap([f"Self-attention over 4 items with no positions: reorder the items "
                  f"(permutation {o['perm']}) and the outputs are the same rows reordered "
                  f"(max difference {o['max_diff']:.1e}). 'dog bites man' and 'man bites "
                  "dog' look alike, so positional information must be added to the "
                  "inputs (or a causal mask used)."], width, indent=3),
          f"   item 0's output:              {vec(o['row0'], 3)}",
          f"   the same item, moved to slot 1: {vec(o['row0_after'], 3)}"]
    return "\n".join(L)
