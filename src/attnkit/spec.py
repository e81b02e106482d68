"""The contract in one place: shape legend, validation, masking rules, FLOP formulas.

Shape letters (DESIGN.md §1)::

    ...        leading batch dims; they broadcast between q, k, v and masks
    H / Hkv    query heads / key-value heads, H % Hkv == 0 (GQA; MQA when Hkv == 1)
    L / S      query length / key-value length
    D / Dv     query-key head dim / value head dim

    q: (..., H, L, D)   k: (..., Hkv, S, D)   v: (..., Hkv, S, Dv)
    out: (..., H, L, Dv)   lse: (..., H, L)   weights: (..., H, L, S)

A 2-D input ``(L, D)`` is read as one head, ``(1, L, D)``; a 2-D ``q`` gives 2-D
outputs.

Every user-facing check lives here and runs before any compute. Backends receive a
:class:`Spec` and never validate again.

Causal mask and alignment, drawn for L < S (L=2, S=4) and L > S (L=4, S=2);
``x`` = attended, ``.`` = excluded::

    bottom_right (default)     top_left
    L=2,S=4   x x x .          x . . .
              x x x x          x x . .

    L=4,S=2   . .              x .
              . .   <- fully   x x
              x .      masked  x x
              x x      rows    x x

Bottom-right puts the diagonal at ``diag(i) = i + S - L`` (the last query sees the
last key: KV-cache decoding, FlashAttention, MLX); top-left at ``diag(i) = i``
(PyTorch's ``is_causal``). A fully masked row gives out = 0, weights = 0,
lse = -inf and zero gradients.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
BACKENDS = ("auto", "reference", "flash", "torch", "triton")
ALIGNS = ("bottom_right", "top_left")


def dtype_name(x) -> str:
    """'float32' for a NumPy float32 array and for a torch.float32 tensor alike."""
    return str(x.dtype).removeprefix("torch.")


def is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def broadcast_to(x, shape):
    """A broadcast view (no copy) in x's own array library."""
    return np.broadcast_to(x, shape) if isinstance(x, np.ndarray) else x.broadcast_to(shape)


def reduce_to(grad, shape):
    """Sum a gradient over the dims along which its input was broadcast to grad's shape."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    if axes:
        grad = grad.sum(axis=axes) if isinstance(grad, np.ndarray) else grad.sum(dim=axes)
    return grad.reshape(shape)


def _as_array(name, x, want_torch):
    if x is None:
        return None
    if want_torch:
        if not is_torch(x):
            raise TypeError(f"{name}: expected a torch.Tensor like q, got {type(x).__name__}")
        return x
    if is_torch(x):
        raise TypeError(f"{name}: got a torch.Tensor but q is not one; pass one array library")
    return np.asarray(x)


def _shape(x):
    return tuple(x.shape)


def _as_4d(name, x, last):
    """(L, D) -> (1, L, D); checks that x has at least 2 dims."""
    if x.ndim < 2:
        raise ValueError(f"{name}: expected shape (..., {last}) with at least 2 dims, got {_shape(x)}")
    return x[None] if x.ndim == 2 else x


def _broadcast_shapes(what, *shapes):
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        raise ValueError(f"{what}: leading batch dims {list(shapes)} do not broadcast") from None


def _opt_int(name, x):
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0:
        raise ValueError(f"window: {name} size must be a non-negative int or None, got {x!r}")
    return int(x)


def flops(B, H, L, S, D, Dv=None, *, causal=False, backward=False) -> float:
    """The one FLOP formula: 4·B·H·L·S·D forward (2·L·S·D for q kᵀ plus 2·L·S·Dv for
    weights · v, so D is (D + Dv) / 2 when they differ), ×0.5 causal, ×2.5 backward."""
    d = D if Dv is None else (D + Dv) / 2
    f = 4.0 * B * H * L * S * d
    if causal:
        f *= 0.5
    if backward:
        f *= 2.5
    return f


@dataclass
class Spec:
    """Validated, normalised inputs. Arrays keep their library (NumPy or torch).

    ``q, k, v`` are at least 3-D here (2-D inputs got a head axis); ``batch`` is the
    broadcast shape of their leading dims; masks are the user's arrays, not expanded.
    """

    q: object
    k: object
    v: object
    batch: tuple
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int
    scale: float
    causal: bool
    window: tuple | None
    align: str
    keep: object
    drop: object
    bias: object
    softcap: float | None
    dtype: str
    two_d: bool
    shapes: dict  # the user's original shapes, by argument name

    # ---- derived facts -------------------------------------------------------
    @property
    def torch(self) -> bool:
        return is_torch(self.q)

    @property
    def acc_dtype(self) -> str:
        """Half types accumulate in float32, float64 in float64."""
        return "float64" if self.dtype == "float64" else "float32"

    @property
    def group(self) -> int:
        """Query heads per key-value head (GQA); head h reads kv head h // group."""
        return self.H // self.Hkv

    @property
    def offset(self) -> int:
        """diag(i) = i + offset: S - L for bottom_right, 0 for top_left."""
        return self.S - self.L if self.align == "bottom_right" else 0

    @property
    def has_index_mask(self) -> bool:
        return self.causal or self.window is not None

    @property
    def score_shape(self) -> tuple:
        return self.batch + (self.H, self.L, self.S)

    @property
    def out_shape(self) -> tuple:
        return self.batch + (self.H, self.L, self.Dv)

    @property
    def lse_shape(self) -> tuple:
        return self.batch + (self.H, self.L)

    def to_inputs(self, dq, dk, dv):
        """Gradients per query head (..., H, L|S, X) summed into their kv head (GQA),
        then over the dims the user's q, k, v were broadcast along: their shapes."""
        def fold(x):  # (..., H, S, X) -> (..., Hkv, S, X)
            return x.reshape(x.shape[:-3] + (self.Hkv, self.group) + x.shape[-2:]).sum(axis=-3)

        return (reduce_to(dq, self.shapes["q"]), reduce_to(fold(dk), self.shapes["k"]),
                reduce_to(fold(dv), self.shapes["v"]))

    @property
    def user_out_shape(self) -> tuple:
        """out's shape as the user sees it: 2-D inputs give no head axis."""
        return self.out_shape[:-3] + self.out_shape[-2:] if self.two_d else self.out_shape

    @property
    def user_lse_shape(self) -> tuple:
        return self.lse_shape[:-2] + self.lse_shape[-1:] if self.two_d else self.lse_shape

    # ---- masking rules (the only place they are written for array code) -------
    @property
    def band(self) -> tuple:
        """causal and window as one band around the diagonal: (left, right), key j
        visible to query i iff diag(i) - left <= j <= diag(i) + right; None = unbounded.
        Causal is right = 0 (or the window's right side if smaller)."""
        return band(self.causal, self.window)

    def key_bounds(self, r0: int, r1: int) -> tuple[int, int]:
        """Keys [lo, hi) that causal/window can leave visible to any query in [r0, r1).
        Tiles outside are fully excluded and can be skipped."""
        left, right = self.band
        lo, hi = 0, self.S
        if left is not None:
            lo = max(lo, r0 + self.offset - left)
        if right is not None:
            hi = min(hi, r1 - 1 + self.offset + right + 1)
        return lo, max(lo, hi)

    def row_key_bounds(self, r0: int, r1: int):
        """Per-row form of :meth:`key_bounds`: int64 arrays (lo, hi) of length r1 - r0,
        where query row r0 + i sees exactly the keys [lo[i], hi[i]) by causal/window
        (``key_bounds(r, r + 1)`` for each row r, computed for all rows at once; the
        same rule as :meth:`index_keep`). lo ≤ hi; both may lie outside [0, S]."""
        diag = np.arange(r0, r1, dtype=np.int64) + self.offset
        lo = np.zeros_like(diag)
        hi = np.full_like(diag, self.S)
        left, right = self.band
        if left is not None:
            lo = np.maximum(lo, diag - left)
        if right is not None:
            hi = np.minimum(hi, diag + right + 1)
        return lo, np.maximum(lo, hi)

    def index_keep(self, rows, cols):
        """Boolean (len(rows), len(cols)) NumPy array: True where causal and window
        let query rows[i] see key cols[j]; None when neither is set."""
        if not self.has_index_mask:
            return None
        diag = np.asarray(rows)[:, None] + self.offset
        j = np.asarray(cols)[None, :]
        ok = np.ones((diag.shape[0], j.shape[1]), dtype=bool)
        left, right = self.band
        if left is not None:
            ok &= j >= diag - left
        if right is not None:
            ok &= j <= diag + right
        return ok

    def excluded(self):
        """Boolean array broadcastable to (..., H, L, S), True = excluded: keep, drop,
        causal and window combined (the rule of :meth:`tile_excluded` on whole arrays);
        None when nothing is excluded."""
        return _combine(self.index_keep(np.arange(self.L), np.arange(self.S)),
                        *(None if m is None else np.asarray(m) for m in (self.keep, self.drop)))

    def tile_excluded(self, b, h, r0, r1, c0, c1, index=True):
        """Boolean (r1-r0, c1-c0) NumPy array, True = excluded, for batch index b (a
        tuple), query head h, rows [r0, r1), keys [c0, c1): keep, drop, causal and
        window combined. None when nothing is excluded there. Masks are sliced, never
        expanded. ``index=False``: the caller knows causal/window leave the tile whole."""
        ik = self.index_keep(np.arange(r0, r1), np.arange(c0, c1)) if index else None
        return _combine(ik, *(None if m is None else self.mask_tile(m, b, h, r0, r1, c0, c1)
                              for m in (self.keep, self.drop)))

    def mask_tile(self, m, b, h, r0, r1, c0, c1):
        """The (r1-r0, c1-c0) tile of a keep/drop/bias array broadcast to score_shape."""
        full = broadcast_to(m, self.score_shape)
        return np.asarray(full[b + (h,)][r0:r1, c0:c1])


def band(causal, window) -> tuple:
    """(left, right) of :attr:`Spec.band` from a causal flag and a validated window."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _combine(index_keep, keep, drop):
    """True = excluded, from the causal/window rule (True = visible), keep and drop;
    each may be None; None when all are."""
    parts = [~x for x in (index_keep, keep) if x is not None] + ([drop] if drop is not None else [])
    if not parts:
        return None
    ex = parts[0]
    for p in parts[1:]:
        ex = ex | p
    return ex


def validate(q, k, v, *, scale=None, causal=False, window=None, align="bottom_right",
             keep=None, drop=None, bias=None, softcap=None, backend="auto") -> Spec:
    """Check every argument and return a Spec. Raises TypeError / ValueError naming
    the argument, what was expected and what was given. ``v`` may be None (weights
    only)."""
    want_torch = is_torch(q)
    q = _as_array("q", q, want_torch)
    k = _as_array("k", k, want_torch)
    v = _as_array("v", v, want_torch)
    shapes = {"q": _shape(q), "k": _shape(k)}
    if v is not None:
        shapes["v"] = _shape(v)

    # dtypes
    dt = dtype_name(q)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x is None:
            continue
        d = dtype_name(x)
        if d not in FLOAT_DTYPES:
            raise TypeError(f"{name}: expected a float dtype {FLOAT_DTYPES}, got {d}")
        if d != dt:
            raise TypeError(f"{name}: dtype {d} differs from q's dtype {dt}; cast them to one dtype")

    if want_torch:
        for name, x in (("k", k), ("v", v), ("keep", keep), ("drop", drop), ("bias", bias)):
            if is_torch(x) and x.device != q.device:
                raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {x.device}")

    # shapes
    two_d = q.ndim == 2
    q = _as_4d("q", q, "H, L, D")
    k = _as_4d("k", k, "Hkv, S, D")
    v = _as_4d("v", v, "Hkv, S, Dv") if v is not None else None
    H, L, D = q.shape[-3:]
    Hkv, S, Dk = k.shape[-3:]
    if Dk != D:
        raise ValueError(f"k: expected last dim D={D} (q's head dim), got shape {shapes['k']}")
    Dv = D
    if v is not None:
        Hv, Sv, Dv = v.shape[-3:]
        if Sv != S or Hv != Hkv:
            raise ValueError(f"v: expected shape (..., Hkv={Hkv}, S={S}, Dv) like k, got {shapes['v']}")
    if 0 in (H, Hkv, L, S, D, Dv):
        raise ValueError(f"q, k, v: H, Hkv, L, S, D and Dv must be positive, got q {shapes['q']}, "
                         f"k {shapes['k']}" + (f", v {shapes['v']}" if v is not None else ""))
    if H % Hkv != 0:
        raise ValueError(f"k: query heads H={H} must be a multiple of key-value heads Hkv={Hkv} (k shape {shapes['k']})")
    lead = [q.shape[:-3], k.shape[:-3]] + ([v.shape[:-3]] if v is not None else [])
    batch = _broadcast_shapes("q, k, v", *lead)
    score_shape = batch + (H, L, S)

    # masks
    masks = {}
    for name, m in (("keep", keep), ("drop", drop), ("bias", bias)):
        m = _as_array(name, m, want_torch)
        if m is not None:
            d = dtype_name(m)
            if name != "bias" and d != "bool":
                raise TypeError(f"{name}: expected a boolean mask (True = {'attend' if name == 'keep' else 'masked out'}), got dtype {d}")
            if name == "bias" and d not in FLOAT_DTYPES:
                raise TypeError(f"bias: expected a float dtype {FLOAT_DTYPES}, got {d}")
            try:
                ok = tuple(np.broadcast_shapes(_shape(m), score_shape)) == score_shape
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{name}: expected a shape that broadcasts to (..., H, L, S) = {score_shape}, got {_shape(m)}")
            shapes[name] = _shape(m)
        masks[name] = m

    # scalars
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, numbers.Real)
                                or not softcap > 0 or not math.isfinite(softcap)):
        raise ValueError(f"softcap: expected a positive finite number or None, got {softcap!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    causal = bool(causal)
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            raise ValueError(f"window: expected (left, right) with ints or None, got {window!r}")
        window = (_opt_int("left", window[0]), _opt_int("right", window[1]))
        if window == (None, None):
            window = None
    if align not in ALIGNS:
        raise ValueError(f"align: expected one of {ALIGNS}, got {align!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")

    return Spec(q=q, k=k, v=v, batch=batch, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv,
                scale=float(scale), causal=causal, window=window, align=align,
                keep=masks["keep"], drop=masks["drop"], bias=masks["bias"],
                softcap=None if softcap is None else float(softcap), dtype=dt,
                two_d=two_d, shapes=shapes)


def _same_library(name, x, like):
    if is_torch(x) != is_torch(like) or not hasattr(x, "shape"):
        want = "a torch.Tensor" if is_torch(like) else "a NumPy array"
        raise TypeError(f"{name}: expected {want} like q, got {type(x).__name__}")
    if is_torch(x) and x.device != like.device:
        raise ValueError(f"{name}: expected a tensor on q's device {like.device}, got {x.device}")


def check_lse(spec: Spec, lse, shape):
    """A saved lse: same array library as q, a float dtype, exactly ``shape``."""
    _same_library("lse", lse, spec.q)
    if dtype_name(lse) not in FLOAT_DTYPES:
        raise TypeError(f"lse: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(lse)}")
    check_like("lse", lse, shape)


def check_grad_inputs(spec: Spec, dout, out, lse, out_shape):
    """attention_backward's dout, out (q's dtype, out's shape) and lse."""
    for name, x in (("dout", dout), ("out", out)):
        _same_library(name, x, spec.q)
        check_like(name, x, out_shape, spec.dtype)
    check_lse(spec, lse, tuple(out_shape)[:-1])


def check_rows(spec: Spec, rows):
    """``rows`` for attention_weights: 1-D integers in [-L, L) -> a NumPy int array of
    non-negative row indices."""
    r = np.asarray(rows.detach().cpu() if is_torch(rows) else rows)
    if r.ndim > 1 or (r.size and r.dtype.kind not in "iu"):
        raise TypeError(f"rows: expected an int or a 1-D sequence of ints, got {r.dtype} of shape {r.shape}")
    r = np.atleast_1d(r).astype(np.int64)
    if r.size and (r.min() < -spec.L or r.max() >= spec.L):
        raise ValueError(f"rows: expected indices in [-{spec.L}, {spec.L}) (L={spec.L}), got {r.tolist()}")
    return r % spec.L


def check_merge(outs, lses):
    """merge's blocks: equal numbers, one array library, float dtypes, matching shapes."""
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge: expected equal, non-zero numbers of outs and lses, got {len(outs)} and {len(lses)}")
    for i, (o, l) in enumerate(zip(outs, lses)):
        _same_library(f"outs[{i}]", o, outs[0])
        _same_library(f"lses[{i}]", l, outs[0])
        for name, x, shape, like in ((f"outs[{i}]", o, tuple(outs[0].shape), outs[0]),
                                     (f"lses[{i}]", l, tuple(outs[0].shape)[:-1], lses[0])):
            if dtype_name(x) not in FLOAT_DTYPES:
                raise TypeError(f"{name}: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(x)}")
            check_like(name, x, shape, dtype_name(like))
    return outs, lses


def validate_seed(Q, K, V, mask):
    """The seed function's inputs: 2-D NumPy matrices; ``mask`` any truthy array (True
    or nonzero = masked out), as the seed's np.where read it."""
    Q, K, V = (np.asarray(x) for x in (Q, K, V))
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if x.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {x.shape}")
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype.kind not in "biuf":
            raise TypeError(f"mask: expected a boolean or numeric array (True = masked out), got {mask.dtype}")
        mask = mask.astype(bool)
        LS = (Q.shape[0], K.shape[0])
        try:
            ok = tuple(np.broadcast_shapes(mask.shape, LS)) == LS
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"mask: expected a shape that broadcasts to (L, S) = {LS}, got {mask.shape}")
    return validate(Q, K, V, drop=mask)


def check_like(name, x, shape, dtype=None):
    """For attention_backward and merge: x must have exactly this shape (and dtype)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and dtype_name(x) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {dtype_name(x)}")


# ---- ring attention (attnkit.distributed) -----------------------------------------------
RING_LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout):
    if layout not in RING_LAYOUTS:
        raise ValueError(f"layout: expected one of {RING_LAYOUTS}, got {layout!r}")


def check_world(rank, world):
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank, world: expected 0 <= rank < world, got rank={rank!r}, world={world!r}")


def check_ring_shard(spec: Spec, keep, drop, layout):
    """One rank's validated shard for ring attention: key-padding masks only (the
    query side is the rank's own), even shard lengths for the zigzag layout. Returns
    the key-padding keep mask (keep and drop combined), or None."""
    check_layout(layout)
    for name, m in (("keep", keep), ("drop", drop)):
        if m is not None and (m.shape[-1] != spec.S or (m.ndim >= 2 and m.shape[-2] != 1)):
            raise ValueError(f"{name}: ring_attention takes key-padding masks of shape "
                             f"(..., 1 or H, 1, S_shard={spec.S}) sharded like k, got {tuple(m.shape)}")
    if layout == "zigzag":
        for name, n in (("q", spec.L), ("k", spec.S)):
            if n % 2:
                raise ValueError(f"{name}: layout='zigzag' needs an even shard length along dim -2 "
                                 f"(two chunks per rank), got {n}")
    ex = _combine(None, keep, drop)
    return None if ex is None else ~ex
