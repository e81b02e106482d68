"""explain: the four steps of attention on real numbers, recorded by reference.py's
trace hook — the very code the library runs, never a second copy of the math.

    Step 1  scores  = q kᵀ                 how well each query matches each key
    Step 2  scaled  = scores · scale        1/√D by default, so the softmax does
                                            not saturate as D grows
            [softcapped, biased, excluded, masked]   only when asked for
    Step 3  weights = softmax over keys     each row sums to 1 (lse is its log-sum-exp)
    Step 4  out     = weights v             each output is a blend of the values

>>> t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]])
>>> t.out.round(2).tolist()
[[6.7, 3.3]]
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

import numpy as np

from . import reference
from .spec import is_torch, validate

WIDTH = 80

# The seed's worked example: a query wanting "sweet"; keys apple and cheese.
EXAMPLE = dict(q=[[1.0, 0.0]], k=[[1.0, 0.0], [0.0, 1.0]], v=[[10.0, 0.0], [0.0, 10.0]],
               labels=("apple", "cheese"), query_labels=("q",))

STEP_TITLES = {
    "scores": "Step 1  scores = q kᵀ: how well each query matches each key",
    "scaled": "Step 2  scaled = scores · scale",
    "softcapped": "Step 2a softcapped = softcap · tanh(scaled / softcap)",
    "biased": "Step 2b biased = scores + bias",
    "excluded": "Step 2c excluded keys (x) from keep / drop / causal / window",
    "masked": "Step 2c masked = scores with excluded keys set to -inf",
    "weights": "Step 3  weights = softmax over keys: each row sums to 1",
    "lse": "        lse = log Σ e^score per query (-inf for a fully masked row)",
    "out": "Step 4  out = weights v: each output is a blend of the values",
}


# ---- the trace ------------------------------------------------------------------
class Trace(Mapping):
    """The steps of one attention call, by name, in the order computed.

    A read-only mapping ``{step: array}`` with the keys ``scores, scaled,
    [softcapped, biased, excluded, masked,] weights, lse, out`` — each recorded by
    :mod:`attnkit.reference` as it ran. Shapes follow :func:`attnkit.attention`:
    scores-like steps are ``(..., H, L, S)``, ``lse`` is ``(..., H, L)`` and ``out``
    is ``(..., H, L, Dv)``; a 2-D ``q`` drops the head axis. Arrays are in the
    accumulation dtype (float32 for half and float32 inputs, float64 for float64).

    ``masks`` lists what excluded keys (``causal``, ``window``, ``keep``, ``drop``)
    or changed scores (``softcap``, ``bias``); ``excluded`` is the combined boolean
    mask (True = excluded) or None. ``str(trace)`` is the step-by-step text,
    ``trace.to_dict()`` the JSON-ready form.

    >>> t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]],
    ...             labels=["apple", "cheese"])
    >>> list(t)
    ['scores', 'scaled', 'weights', 'lse', 'out']
    >>> t["weights"].round(3).tolist(), t.masks
    ([[0.67, 0.33]], [])
    >>> print(t.render().splitlines()[-2])
    Reading: q0 matches apple best, so its output leans 67% toward apple's value
    """

    def __init__(self, steps, spec, *, labels, query_labels, masks):
        self._steps = dict(steps)
        self.spec = spec
        self.labels = list(labels)
        self.query_labels = list(query_labels)
        self.masks = list(masks)

    def __getitem__(self, name):
        return self._steps[name]

    def __iter__(self):
        return iter(self._steps)

    def __len__(self):
        return len(self._steps)

    def __repr__(self):
        s = self.spec
        return (f"Trace(steps={list(self)}, q={s.shapes['q']}, k={s.shapes['k']}, "
                f"v={s.shapes['v']}, masks={self.masks})")

    def __str__(self):
        return self.render()

    @property
    def out(self):
        return self._steps["out"]

    @property
    def weights(self):
        return self._steps["weights"]

    @property
    def lse(self):
        return self._steps["lse"]

    @property
    def excluded(self):
        return self._steps.get("excluded")

    @property
    def final_scores(self):
        """The scores the softmax saw: the last of masked / biased / softcapped / scaled."""
        for name in ("masked", "biased", "softcapped", "scaled"):
            if name in self._steps:
                return self._steps[name]
        raise KeyError("scaled")

    def blocks(self):
        """Index tuples of the (batch…, head) blocks, each one L × S attention."""
        return list(np.ndindex(self.out.shape[:-2]))

    def block_name(self, b) -> str:
        if not b:
            return ""
        *batch, h = b
        return f"head {h}" if not batch else f"batch {tuple(batch)}, head {h}"

    def inputs(self, b=()):
        """(q, k, v) of block ``b`` as 2-D float arrays, kv heads repeated (GQA)."""
        q, k, v = reference._operands(self.spec)
        full = tuple(np.broadcast_to(x, self.spec.batch + x.shape[-3:]) for x in (q, k, v))
        if not b:
            return tuple(x[(0,) * (x.ndim - 2)] for x in full)
        return tuple(x[b] for x in full)

    # ---- renderings ------------------------------------------------------------
    def render(self, width: int = WIDTH, max_blocks: int = 2) -> str:
        """Step-by-step text, readable at ``width`` columns: a header, the inputs,
        query 0 worked by hand when the sizes are small, every step as a labelled
        matrix (first ``max_blocks`` heads), and a one-line reading."""
        s = self.spec
        lines = ["Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V", ""]
        lines += _wrap([f"q {s.shapes['q']}", f"k {s.shapes['k']}", f"v {s.shapes['v']}",
                        f"scale {_scale_text(s)}",
                        "masks: " + (", ".join(self.masks) if self.masks else "none")],
                       width, sep=";  ")
        blocks = self.blocks()
        small = s.S <= 6 and s.D <= 4 and s.Dv <= 4
        single = len(blocks) == 1
        if single:
            q, k, v = self.inputs(blocks[0])
            lines.append("")
            lines += _matrix("q", q, self.query_labels, [f"d{j}" for j in range(s.D)], width)
            lines += _matrix("k", k, self.labels, [f"d{j}" for j in range(s.D)], width)
            lines += _matrix("v", v, self.labels, [f"d{j}" for j in range(s.Dv)], width)
        if small:
            lines.append("")
            who = self.query_labels[0]
            head = f" ({self.block_name(blocks[0])})" if blocks[0] else ""
            if s.L > 1 or not single:
                lines.append(f"Query {who}{head}, worked by hand:")
            lines += self.arithmetic(blocks[0], 0, width)
        if s.L > 1 or not single or not small:
            for b in blocks[:max_blocks]:
                lines.append("")
                if b:
                    lines.append(f"== {self.block_name(b)} ==")
                lines += self._steps_text(b, width)
            if len(blocks) > max_blocks:
                lines.append("")
                lines.append(f"... {len(blocks) - max_blocks} more heads not shown "
                             "(use --json or the Trace for all)")
        lines.append("")
        lines += self.reading(blocks[0], 0, width)
        return "\n".join(lines)

    def _steps_text(self, b, width):
        s = self.spec
        keys, queries = self.labels, self.query_labels
        lines = []
        for name, arr in self._steps.items():
            x = arr[b] if b else arr
            title = STEP_TITLES[name]
            if name == "scaled":
                title += f" ({_scale_text(s)})"
            lines.append(title)
            if name == "excluded":
                lines += _matrix("", np.where(x, "x", "·"), queries, keys, width)
            elif name == "lse":
                lines += _matrix("", x[:, None], queries, ["lse"], width)
            elif name == "out":
                lines += _matrix("", x, queries, [f"d{j}" for j in range(s.Dv)], width)
            else:
                lines += _matrix("", x, queries, keys, width)
        return lines

    def arithmetic(self, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
        """Query ``row`` of block ``b`` worked by hand: the dot products, the scaling,
        e^score and the total, the weights, and the blend of the values."""
        s = self.spec
        q, k, v = self.inputs(b)
        pick = (lambda name: self._steps[name][b][row]) if b else (lambda name: self._steps[name][row])
        dots, scaled, w, out = (pick(n) for n in ("scores", "scaled", "weights", "out"))
        final = self.final_scores[b][row] if b else self.final_scores[row]
        keys = self.labels
        pad = max(len(x) for x in keys)
        qname = self.query_labels[row]
        L = ["Step 1  dot products q·k: how well the query matches each key"]
        for j, key in enumerate(keys):
            terms = [f"{_paren(a)}·{_paren(c)}" for a, c in zip(q[row], k[j])]
            terms = [t + " +" for t in terms[:-1]] + [f"{terms[-1]} {_eq(dots[j])} {_n(dots[j])}"]
            L += _wrap(terms, width, indent=8, first=f"{qname}·{key:<{pad}} = ")
        if _default_scale(s):
            root = math.sqrt(s.D)
            L.append(f"Step 2  divide by √d_k = √{s.D} {_eq(root)} {_n(root)} "
                     "(keeps the softmax from saturating)")
            parts = [f"{_n(d)} / {_n(root)} {_eq(x)} {_n(x)}" for d, x in zip(dots, scaled)]
        else:
            L.append(f"Step 2  multiply by scale = {_n(s.scale)}")
            parts = [f"{_n(d)} · {_n(s.scale)} {_eq(x)} {_n(x)}" for d, x in zip(dots, scaled)]
        L += _wrap(parts, width, indent=8, sep="      ")
        if self.masks:
            L += _wrap([_n(x) for x in final], width, indent=8, sep=", ",
                       first=f"then {', '.join(self.masks)}: scores ")
        top = np.max(final[np.isfinite(final)]) if np.isfinite(final).any() else 0.0
        shift = top if top > 20 else 0.0
        e = np.exp(final - shift)                      # display only: the weights below come from the trace
        L.append("Step 3  softmax: weight = e^score / total (the weights sum to 1)")
        if shift:
            L.append(f"        (subtracting the largest score m = {_n(shift)} first: "
                     "same weights, no overflow)")
        expo = (lambda x: f"e^({_n(x)} − m)") if shift else (lambda x: f"e^{_paren(x)}")
        parts = [f"{expo(x)} {_eq(ex)} {_n(ex)}" if np.isfinite(x) else f"{expo(x)} = 0 (excluded)"
                 for x, ex in zip(final, e)]
        L += _wrap(parts + [f"total {_n(e.sum())}"], width, indent=8, sep="   ")
        L += _wrap([f"{key} {w[j]:.3f}" for j, key in enumerate(keys)], width, indent=8,
                   sep=", ", first="weights: ")
        terms = [f"{w[j]:.3f}·{_vec(v[j])}" for j in range(s.S) if w[j] > 0]
        L.append("Step 4  output = Σ weight · value")
        if not terms:
            L.append(f"        every key is excluded, so the output is {_vec(out, 2)} (not NaN)")
        else:
            L += _wrap([" + ".join(terms) + f" = {_vec(out, 2)}"], width, indent=8)
        return L

    def reading(self, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
        """One line (wrapped at ``width``) saying what query ``row``'s answer means."""
        w = self.weights[b][row] if b else self.weights[row]
        _, _, v = self.inputs(b)
        who = self.query_labels[row]
        if not w.any():
            text = (f"Reading: every key is excluded for {who}, so its output is 0 "
                    "(weights 0, lse -inf), never NaN.")
        else:
            j = int(np.argmax(w))
            key = self.labels[j]
            if w[j] > 0.995:
                text = (f"Reading: {who} sees {key} almost alone (weight {w[j]:.3f}), so its "
                        f"output is close to {key}'s value {_vec(v[j])}.")
            else:
                text = (f"Reading: {who} matches {key} best, so its output leans {w[j]:.0%} "
                        f"toward {key}'s value {_vec(v[j])}: a blend of the values, "
                        "not a copy.")
        return _wrap([text], width)

    def to_dict(self) -> dict:
        """JSON-ready: shapes, scale, masks, labels and every step as nested lists
        (-inf as null; ``excluded`` as booleans)."""
        s = self.spec
        return {
            "formula": "softmax(scale * q k^T [+ masks]) v",
            "shapes": dict(s.shapes),
            "scale": s.scale,
            "causal": s.causal,
            "window": None if s.window is None else list(s.window),
            "align": s.align,
            "softcap": s.softcap,
            "masks": self.masks,
            "labels": {"queries": self.query_labels, "keys": self.labels},
            "null_means": "-inf",
            "steps": {name: _jsonable(x) for name, x in self._steps.items()},
        }


def explain(q, k, v, *, scale=None, causal=False, window=None, align="bottom_right",
            keep=None, drop=None, bias=None, softcap=None, labels=None,
            query_labels=None) -> Trace:
    """Attention through the reference rung with its trace hook on: every step named.

    Takes the same arrays and masking keywords as :func:`attnkit.attention` (NumPy
    arrays, nested lists or torch tensors on any device — detached and copied to the
    CPU, bfloat16 read as float32; integers are read as float64), plus ``labels`` for the
    keys and ``query_labels`` for the queries (default ``k0, k1, …`` and ``q0, …``).
    Returns a :class:`Trace`. A fully masked query row has weights 0, lse -inf and
    output 0.

    >>> import numpy as np
    >>> t = explain(np.eye(2), np.eye(2), np.eye(2), causal=True)
    >>> list(t), t.masks
    (['scores', 'scaled', 'excluded', 'masked', 'weights', 'lse', 'out'], ['causal (bottom_right)'])
    >>> t["excluded"].tolist()
    [[False, True], [False, False]]
    >>> t.out.round(3).tolist()
    [[1.0, 0.0], [0.33, 0.67]]
    """
    q, k, v = (_float_array(x) for x in (q, k, v))
    keep, drop, bias = (None if m is None else _numpy(m) for m in (keep, drop, bias))
    spec = validate(q, k, v, scale=scale, causal=causal, window=window, align=align,
                    keep=keep, drop=drop, bias=bias, softcap=softcap)
    labels = _labels("labels", labels, spec.S, "k")
    query_labels = _labels("query_labels", query_labels, spec.L, "q")
    steps = {}

    def record(name, x):
        x = np.array(x)                                # a copy, in the reference's dtype
        if spec.two_d:                                 # match attention's 2-D shapes
            x = x[..., 0, :] if name == "lse" else x[..., 0, :, :]
        steps[name] = x

    reference.forward(spec, trace=record)
    return Trace(steps, spec, labels=labels, query_labels=query_labels, masks=_masks(spec))


def worked_example(width: int = WIDTH) -> str:
    """The seed's example, step by step with the arithmetic shown.

    >>> text = worked_example()
    >>> "e^0.707 ≈ 2.028" in text and "(6.70, 3.30)" in text
    True
    """
    ex = EXAMPLE
    t = explain(ex["q"], ex["k"], ex["v"], labels=ex["labels"], query_labels=ex["query_labels"])
    a, c = ex["labels"]
    head = [
        "Attention(Q, K, V) = softmax(Q Kᵀ / √d_k) V  — the seed's worked example",
        "",
        "query  q = (1, 0)            wants 'sweet'",
        f"keys   {a} = (1, 0)   {c} = (0, 1)",
        f"values {a} = (10, 0)  {c} = (0, 10)",
        "",
    ]
    return "\n".join(head + t.arithmetic((), 0, width) + [""] + t.reading((), 0, width))


# ---- common mistakes, made visible with numbers ----------------------------------
def entropy(weights):
    """Mean over rows of the Shannon entropy -Σ w ln w of each weight row, in nats
    (ln S for uniform weights, 0 for a one-hot row; 0 · ln 0 counts 0).

    >>> round(entropy(np.full((1, 4), 0.25)), 4), entropy(np.eye(3))
    (1.3863, 0.0)
    """
    w = np.asarray(weights, dtype=np.float64)
    logw = np.log(w, out=np.zeros_like(w), where=w > 0)
    return float(-(w * logw).sum(axis=-1).mean()) + 0.0     # + 0.0: no "-0.0"


def entropy_sweep(dims=tuple(2 ** i for i in range(1, 11)), *, S=64, L=64, trials=4,
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
    from .api import attention
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
    from .api import attention
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
         *_wrap([f"Random q, k with unit-normal entries: q·k has variance d_k, so "
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
          *_wrap(["Q is what a query looks for, K what each item is matched on, V what "
                  "each item gives back. In the worked example (q = (1, 0), keys apple "
                  "(1, 0), cheese (0, 1), values (10, 0), (0, 10)):"], width, indent=3),
          f"   attention(q, k, v) = {_vec(r['right'], 2)}   right",
          f"   attention(q, v, k) = {_vec(r['keys_values_swapped'], 2)}   keys and values swapped"]
    bl = m["blend"]
    L += ["", "3. Expecting the best-matching value to be copied",
          *_wrap([f"apple matches best, but the output is {_vec(bl['output'], 2)}, not apple's "
                  f"value {_vec(bl['best_value'], 0)}: attention blends the values by their "
                  "weights. Only a larger scale sharpens it toward a copy:"], width, indent=3),
          f"   {'scale':>7}  {'weights (apple, cheese)':>24}  {'output':>16}"]
    for c, w, o in zip(bl["scales"], bl["weights"], bl["outputs"]):
        L.append(f"   {c:>7g}  {_vec(w, 3):>24}  {_vec(o, 2):>16}")
    o = m["order"]
    L += ["", "4. Order blindness",
          *_wrap([f"Self-attention over 4 items with no positions: reorder the items "
                  f"(permutation {o['perm']}) and the outputs are the same rows reordered "
                  f"(max difference {o['max_diff']:.1e}). 'dog bites man' and 'man bites "
                  "dog' look alike, so positional information must be added to the "
                  "inputs (or a causal mask used)."], width, indent=3),
          f"   item 0's output:              {_vec(o['row0'], 3)}",
          f"   the same item, moved to slot 1: {_vec(o['row0_after'], 3)}"]
    return "\n".join(L)


# ---- helpers ------------------------------------------------------------------------
def _numpy(x):
    """x as a NumPy array; a torch tensor is detached and copied to the CPU (NumPy has
    no bfloat16: it becomes float32)."""
    if is_torch(x):
        import torch
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    return np.asarray(x)


def _float_array(x):
    a = _numpy(x)
    return a if a.dtype.kind == "f" else a.astype(np.float64)


def _labels(name, labels, n, prefix):
    if labels is None:
        return [f"{prefix}{i}" for i in range(n)]
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"{name}: expected {n} labels, got {len(labels)} ({','.join(labels)})")
    return labels


def _default_scale(spec) -> bool:
    return spec.scale == 1.0 / math.sqrt(spec.D)


def _scale_text(spec) -> str:
    if _default_scale(spec):
        return f"1/√{spec.D} {_eq(spec.scale)} {_n(spec.scale)}"
    return _n(spec.scale)


def _masks(spec) -> list[str]:
    m = []
    if spec.softcap is not None:
        m.append(f"softcap {spec.softcap:g}")
    if spec.bias is not None:
        m.append("bias")
    if spec.causal:
        m.append(f"causal ({spec.align})")
    if spec.window is not None:
        left, right = ("∞" if x is None else x for x in spec.window)
        m.append(f"window ({left}, {right}) ({spec.align})")
    if spec.keep is not None:
        m.append("keep")
    if spec.drop is not None:
        m.append("drop")
    return m


def _n(x) -> str:
    """A number as a person writes it: integers plainly, others to 3 decimals."""
    x = float(x)
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    if x == round(x) and abs(x) < 1e6:
        return str(int(round(x))) if x != 0 else "0"
    return f"{x:.3f}"


def _eq(x) -> str:
    """'=' when _n(x) is exact, '≈' when it rounds."""
    x = float(x)
    return "=" if (not math.isfinite(x) or float(_n(x).replace("inf", "0")) == x) else "≈"


def _paren(x) -> str:
    s = _n(x)
    return f"({s})" if s.startswith("-") else s


def _vec(x, digits=None, most=6) -> str:
    """(a, b, …) with at most ``most`` entries shown."""
    vals = [float(a) for a in np.ravel(x)]
    if len(vals) > most:
        return _vec(vals[:most - 2], digits)[:-1] + ", …, " + _vec(vals[-1:], digits)[1:]
    if digits is None:
        return "(" + ", ".join(_n(a) for a in vals) + ")"
    return "(" + ", ".join(f"{a:.{digits}f}" for a in vals) + ")"


def _wrap(parts, width, indent=0, sep=" ", first="") -> list[str]:
    """Join ``parts`` with ``sep`` into lines of at most ``width`` columns, breaking
    between parts (and inside a part only at spaces when it alone is too long)."""
    lines, cur = [], " " * indent + first
    base = len(cur)
    for p in parts:
        words = [p] if len(p) + indent <= width else re.split(r" (?![^()]*\))", p)
        for i, wd in enumerate(words):
            glue = (sep if i == 0 else " ") if len(cur) > base else ""
            if len(cur) + len(glue) + len(wd) > width and len(cur) > base:
                lines.append(cur.rstrip())
                cur, glue = " " * (indent + len(first) if first else indent), ""
                base = len(cur)
            cur += glue + wd
    if len(cur) > base or not lines:
        lines.append(cur.rstrip())
    return lines


def _cell(x) -> str:
    if isinstance(x, str):
        return x
    x = float(x)
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.3f}"


def _matrix(name, a, row_labels, col_labels, width, max_rows=12) -> list[str]:
    """A labelled matrix in at most ``width`` columns; middle rows and columns are
    elided with ⋮ / … when it does not fit."""
    a = np.asarray(a)
    cells = [[_cell(x) for x in row] for row in a]
    rl = [str(x)[:12] for x in row_labels]
    cl = [str(x)[:10] for x in col_labels]
    cw = max([len(c) for c in cl] + [len(c) for row in cells for c in row] + [4])
    lw = max([len(x) for x in rl] + [len(name)]) + 2
    ncol = a.shape[1]
    fit = max(2, (width - lw) // (cw + 2))
    cols = list(range(ncol)) if ncol <= fit else list(range(fit - 2)) + [None, ncol - 1]
    rows = list(range(a.shape[0])) if a.shape[0] <= max_rows else \
        list(range(max_rows - 3)) + [None] + list(range(a.shape[0] - 2, a.shape[0]))

    def line(label, items):
        return (f"  {label:<{lw - 2}}" + "".join(f"  {x:>{cw}}" for x in items)).rstrip()

    out = [line(name, [("…" if j is None else cl[j]) for j in cols])]
    for i in rows:
        if i is None:
            out.append(line("⋮", []))
            continue
        out.append(line(rl[i], [("…" if j is None else cells[i][j]) for j in cols]))
    return out


def _jsonable(x):
    x = np.asarray(x)
    if x.dtype == bool:
        return x.tolist()
    return _nulls(x.astype(np.float64).tolist())


def _nulls(x):
    if isinstance(x, list):
        return [_nulls(y) for y in x]
    return x if math.isfinite(x) else None
