"""The trace: one attention call run through :mod:`attnkit.reference` (attnkit's
definition, the code every faster backend is tested against) with its trace hook on,
every step kept by name.

:func:`explain` reads the inputs (NumPy arrays, lists or torch tensors), checks them
before any compute — including a size limit, since a trace keeps every L × S step —
and returns a :class:`Trace`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import reference
from ..nonfinite import quiet
from ..spec import broadcast_to, is_torch, prod, validate
from ..spec import geometry as geo
from ..spec.options import BY_NAME, NAMES, with_options
from . import text
from .formatting import WIDTH, jsonable

MAX_SCORES = 1_000_000      # L · S summed over the heads and batch: what one trace may hold
FLOAT_INPUTS = ("q", "k", "v")
ARRAY_OPTIONS = tuple(n for n in NAMES if BY_NAME[n].schema == "Tensor?" and n != "seed")


class Trace(Mapping):
    """The steps of one attention call, by name, in the order computed.

    A read-only mapping ``{step: array}`` with the keys ``scores, scaled,
    [softcapped, biased, alibi, excluded, masked,] weights, lse, [dropped,] out`` —
    each recorded by :mod:`attnkit.reference` as it ran. Shapes follow
    :func:`attnkit.attention`: scores-like steps are ``(..., H, L, S)``, ``lse`` is
    ``(..., H, L)`` and ``out`` is ``(..., H, L, Dv)``; a 2-D ``q`` drops the head
    axis. Arrays are in the accumulation dtype (float32 for half and float32 inputs,
    float64 for float64). ``weights`` are before dropout, ``dropped`` after it.

    NaN and inf are carried, never hidden: a row whose softmax saw a NaN or +inf
    (a NaN in the inputs, or scores that overflowed) has NaN weights and output here
    too, as in :func:`attnkit.attention`.

    ``masks`` lists what excluded keys (``causal``, ``window``, ``keep``, ``drop``,
    lengths, packing), changed scores (``softcap``, ``bias``, ALiBi) or the weights
    (sinks, dropout); ``excluded`` is the combined boolean mask (True = excluded) or
    None. ``sink_weights`` is the weight each row gave its sink, ``alibi_penalty``
    the ALiBi term. ``str(trace)`` is the step-by-step text, ``trace.to_dict()`` the
    JSON-ready form.

    >>> t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]],
    ...             labels=["apple", "cheese"])
    >>> list(t)
    ['scores', 'scaled', 'weights', 'lse', 'out']
    >>> t["weights"].round(3).tolist(), t.masks
    ([[0.67, 0.33]], [])
    >>> print(t.render().splitlines()[-2])
    Reading: q0 weighs apple most (67.0%), so its output leans toward apple's value
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
        """The scores the softmax saw: the last of masked / alibi / biased / softcapped / scaled."""
        for name in ("masked", "alibi", "biased", "softcapped", "scaled"):
            if name in self._steps:
                return self._steps[name]
        raise KeyError("scaled")

    @property
    def used_weights(self):
        """The weights that multiply v: ``dropped`` with dropout, else ``weights``."""
        return self._steps.get("dropped", self.weights)

    @property
    def sink_weights(self):
        """The weight each query row gave its sink, exp(sink − lse), lse's shape
        (0 on padding rows; NaN where the row is NaN), or None without sinks. The
        row's key weights sum to 1 minus this."""
        sinks = self.sink_logits
        if sinks is None:
            return None
        with np.errstate(invalid="ignore"):
            return reference.from_lse(sinks[..., None], self.lse)[..., 0]

    @property
    def sink_logits(self):
        """The sink logit of every query row (lse's shape), or None without sinks."""
        s = self.spec
        if s.sinks is None:
            return None
        return self._user(np.array(broadcast_to(np.asarray(s.sinks, dtype=self.lse.dtype), s.lse_shape)), "lse")

    @property
    def alibi_penalty(self):
        """The ALiBi term −slope · |diag(i) − j| that Step 2c adds (scores' shape), or
        None without ``alibi_slopes``."""
        s = self.spec
        if s.alibi_slopes is None:
            return None
        with quiet():                                    # a huge slope: -inf, as in the scores
            penalty = np.array(broadcast_to(geo.alibi_bias(s, self.weights.dtype), s.score_shape)) + 0.0
        return self._user(penalty)                       # + 0.0: no "-0.000" on the diagonal

    def sequences(self):
        """Packed inputs: [(q0, q1, k0, k1), …] per sequence (rows q0:q1 see keys
        k0:k1 only); None otherwise."""
        s = self.spec
        if not s.packed:
            return None
        cq, ck = (np.asarray(x, dtype=np.int64) for x in (s.cu_seqlens_q, s.cu_seqlens_k))
        return [(int(cq[i]), int(cq[i + 1]), int(ck[i]), int(ck[i + 1])) for i in range(len(cq) - 1)]

    def padding(self, b=()):
        """Boolean (L,): the query rows of block b that are padding (q_lengths)."""
        pad = geo.padding_rows(self.spec)
        if pad is None:
            return np.zeros(self.spec.L, dtype=bool)
        pad = np.broadcast_to(pad, self.spec.lse_shape)
        return pad[b] if b else pad[(0,) * (pad.ndim - 1)]

    def _user(self, x, kind="scores"):
        """A (…, H, L[, S]) array in the user's shape (2-D q: no head axis)."""
        if not self.spec.two_d:
            return x
        return x[..., 0, :] if kind == "lse" else x[..., 0, :, :]

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

    def pick(self, x, b=()):
        """Block ``b`` of a scores-, lse- or out-shaped array of this trace."""
        return x[b] if b else x

    # ---- renderings (attnkit.explain.text) -------------------------------------
    def render(self, width: int = WIDTH, max_blocks: int = 2) -> str:
        """Step-by-step text, readable at ``width`` columns: a header, the inputs,
        query 0 worked by hand when the sizes are small, every step as a labelled
        matrix (first ``max_blocks`` heads), and a one-line reading."""
        return text.render(self, width, max_blocks)

    def arithmetic(self, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
        """Query ``row`` of block ``b`` worked by hand: the dot products, the scaling,
        e^score and the total, the weights, and the blend of the values."""
        return text.arithmetic(self, b, row, width)

    def reading(self, b=(), row: int = 0, width: int = WIDTH) -> list[str]:
        """One line (wrapped at ``width``) saying what query ``row``'s answer means."""
        return text.reading(self, b, row, width)

    def to_dict(self) -> dict:
        """JSON-ready: shapes, scale, masks, labels and every step as nested lists
        (-inf as null, NaN as "nan", +inf as "inf"; ``excluded`` as booleans);
        ``sink_weights`` with sinks."""
        s = self.spec
        d = {
            "formula": "softmax(scale * q k^T [+ masks]) v",
            "shapes": dict(s.shapes),
            "scale": s.scale,
            "causal": s.causal,
            "window": None if s.window is None else list(s.window),
            "align": s.align,
            "softcap": s.softcap,
            "dropout": s.dropout,
            "seed": s.seed,
            "masks": self.masks,
            "labels": {"queries": self.query_labels, "keys": self.labels},
            "null_means": "-inf",
            "strings_mean": {"nan": "NaN (a non-finite value reached this row)", "inf": "+inf"},
            "steps": {name: jsonable(x) for name, x in self._steps.items()},
        }
        for name in ("alibi_slopes", "sinks", "q_lengths", "kv_lengths", "kv_starts", "cu_seqlens_q",
                     "cu_seqlens_k"):
            x = getattr(s, name)
            if x is not None:
                d[name] = jsonable(_as_given(np.asarray(x), s.shapes[name]))
        if s.sinks is not None:
            d["sink_weights"] = jsonable(self.sink_weights)
        return d


def _as_given(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """An array of the Spec back in the shape the user gave it: validate adds leading
    1s (slopes, sinks) or broadcasts to the batch dims (lengths); a broadcast array is
    taken back to one entry along each dim it was broadcast along."""
    if x.size != prod(tuple(shape)):
        x = x[(0,) * (x.ndim - len(shape)) + tuple(slice(0, 1) if n == 1 else slice(None) for n in shape)]
    return x.reshape(shape)


@with_options()
def explain(q: Any, k: Any, v: Any, *, labels: Sequence[str] | None = None,
            query_labels: Sequence[str] | None = None, **masking: Any) -> Trace:
    """Attention through attnkit's reference code (the definition) with its trace hook
    on: every step named.

    Takes the same arrays and masking keywords as :func:`attnkit.attention` (NumPy
    arrays, nested lists or torch tensors on any device — detached and copied to the
    CPU, bfloat16 read as float32; integers are read as float64), plus ``labels`` for the
    keys and ``query_labels`` for the queries (default ``k0, k1, …`` and ``q0, …``).
    Returns a :class:`Trace`. A fully masked query row has weights 0, lse -inf and
    output 0; a row whose softmax meets a NaN or +inf (NaN inputs, scores that
    overflow) is NaN, and the text says why.

    Bad input raises ``TypeError`` / ``ValueError`` naming the argument before any
    compute: meta tensors (no values), and more than ``MAX_SCORES`` = 1,000,000
    scores (L · S over every head) — a trace keeps each step whole.

    Parameters
    ----------
    q, k, v : arrays, nested lists or torch tensors
        Queries (..., H, L, D), keys (..., Hkv, S, D), values (..., Hkv, S, Dv) (2-D
        for one head).
    labels : sequence of str, optional
        Names of the S keys (default k0, k1, …).
    query_labels : sequence of str, optional
        Names of the L queries (default q0, q1, …).

    {masking}

    Returns
    -------
    Trace
        Every step by name (see :class:`Trace`).

    Examples
    --------
    >>> import numpy as np
    >>> t = explain(np.eye(2), np.eye(2), np.eye(2), causal=True)
    >>> list(t), t.masks
    (['scores', 'scaled', 'excluded', 'masked', 'weights', 'lse', 'out'], ['causal (bottom_right)'])
    >>> t["excluded"].tolist()
    [[False, True], [False, False]]
    >>> t.out.round(3).tolist()
    [[1.0, 0.0], [0.33, 0.67]]
    """
    unknown = sorted(set(masking) - set(NAMES))
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: unexpected keyword argument(s); explain takes "
                        f"labels, query_labels and the masking keywords {', '.join(NAMES)}")
    check_size(*(_shape(x) for x in (q, k, v)))
    q, k, v = (_float_array(n, x) for n, x in zip(FLOAT_INPUTS, (q, k, v)))
    masking = {n: (_numpy(n, x) if n in ARRAY_OPTIONS and x is not None else x) for n, x in masking.items()}
    spec = validate(q, k, v, **masking)
    labels = _labels("labels", labels, spec.S, "k")
    query_labels = _labels("query_labels", query_labels, spec.L, "q")
    steps = {}

    def record(name, x):
        x = np.array(x)                                # a copy, in the reference's dtype
        if spec.two_d:                                 # match attention's 2-D shapes
            x = x[..., 0, :] if name == "lse" else x[..., 0, :, :]
        steps[name] = x

    with np.errstate(all="ignore"):                    # NaN and overflow are shown, not warned about
        reference.forward(spec, trace=record)
    return Trace(steps, spec, labels=labels, query_labels=query_labels, masks=masks(spec))


def check_size(q_shape, k_shape, v_shape=None, arg=None) -> None:
    """Raise ValueError, before anything is allocated, when a trace of these shapes
    would hold more than MAX_SCORES scores (L · S summed over heads and batch) or an
    input more than MAX_SCORES values. ``arg`` names the argument in the message
    (e.g. "--random"); by default q, k (and v). Shapes that do not fit together are
    left for :func:`attnkit.spec.validate` to name.

    >>> check_size((20000, 4), (20000, 4), arg="--random")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --random: explain keeps every step of the 20000 × 20000 score matrix; 400,000,000 ...
    """
    named = [(n, tuple(s)) for n, s in zip(FLOAT_INPUTS, (q_shape, k_shape, v_shape)) if s is not None]
    for name, s in named:
        if prod(s) > MAX_SCORES:
            raise ValueError(f"{arg or name}: explain shows every value; {prod(s):,} values in "
                             f"{name} {s} is over its limit of {MAX_SCORES:,}")
    shapes = [s for _, s in named]
    if q_shape is None or k_shape is None or any(len(s) < 2 for s in shapes):
        return
    try:
        batch = np.broadcast_shapes(*(tuple(s[:-3]) for s in shapes))
    except ValueError:
        return
    H = q_shape[-3] if len(q_shape) >= 3 else 1
    L, S = q_shape[-2], k_shape[-2]
    n = prod(tuple(batch)) * H * L * S
    if n > MAX_SCORES:
        heads = f" for each of {prod(tuple(batch)) * H} heads" if n != L * S else ""
        raise ValueError(f"{arg or 'q, k'}: explain keeps every step of the {L} × {S} score matrix"
                         f"{heads}; {n:,} scores is over its limit of {MAX_SCORES:,} (L · S over all "
                         "heads; attnkit.attention has no such limit)")


def masks(spec) -> list[str]:
    """What changed the scores or the weights, in the order applied."""
    m = []
    if spec.softcap is not None:
        m.append(f"softcap {spec.softcap:g}")
    if spec.bias is not None:
        m.append("bias")
    if spec.alibi_slopes is not None:
        slopes = np.unique(np.asarray(spec.alibi_slopes, dtype=np.float64))
        m.append("ALiBi" + (f" (slope {slopes[0]:g})" if slopes.size == 1 else ""))
    if spec.causal:
        m.append(f"causal ({spec.align})")
    if spec.window is not None:
        left, right = ("∞" if x is None else x for x in spec.window)
        m.append(f"window ({left}, {right}) ({spec.align})")
    if spec.keep is not None:
        m.append("keep")
    if spec.drop is not None:
        m.append("drop")
    if spec.q_lengths is not None:
        m.append("q_lengths")
    if spec.kv_lengths is not None:
        m.append("kv_lengths")
    if spec.kv_starts is not None:
        m.append("kv_starts")
    if spec.packed:
        m.append(f"packed ({len(spec.cu_seqlens_q) - 1} sequences)")
    if spec.sinks is not None:
        m.append("sinks")
    if spec.dropout > 0:
        m.append(f"dropout {spec.dropout:g} (seed {spec.seed})")
    return m


# ---- reading the inputs -------------------------------------------------------------
def _shape(x):
    """x's shape without copying it (None when it has none that NumPy can read)."""
    if hasattr(x, "shape"):
        return tuple(int(n) for n in x.shape)
    try:
        return tuple(np.shape(x))
    except (ValueError, TypeError):
        return None


def _numpy(name, x):
    """x as a NumPy array; a torch tensor is detached and copied to the CPU (NumPy has
    no bfloat16: it becomes float32). Errors name the argument."""
    if is_torch(x):
        import torch
        if x.device.type == "meta":
            raise ValueError(f"{name}: a meta tensor has a shape but no values, so there is "
                             "nothing to explain; create it on 'cpu' or 'cuda'")
        if x.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}; "
                            "call .to_dense() first")
        x = x.detach().cpu()
        return (x.float() if x.dtype == torch.bfloat16 else x).numpy()
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: cannot be read as an array ({' '.join(str(e).split())})") from None


def _float_array(name, x):
    """q, k or v as NumPy; integers become float64 (other dtypes are left for
    validate to name)."""
    a = _numpy(name, x)
    return a.astype(np.float64) if a.dtype.kind in "iu" else a


def _labels(name, labels, n, prefix):
    if labels is None:
        return [f"{prefix}{i}" for i in range(n)]
    if isinstance(labels, str):                          # "apple,cheese", as on the command line
        labels = labels.split(",")
    if not isinstance(labels, Iterable):
        raise TypeError(f"{name}: expected a list of {n} names, got {labels!r}")
    labels = [str(x) for x in labels]
    if len(labels) != n:
        raise ValueError(f"{name}: expected {n} label{'s' if n != 1 else ''}, got {len(labels)} "
                         f"({','.join(labels)})")
    return labels
