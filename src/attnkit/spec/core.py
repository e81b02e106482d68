"""The Spec: one attention call's validated, normalised inputs (immutable), and the
shape facts every rung reads from it.

Shape letters (DESIGN.md §1)::

    ...        leading batch dims; they broadcast between q, k, v and masks
    H / Hkv    query heads / key-value heads, H % Hkv == 0 (GQA; MQA when Hkv == 1)
    L / S      query length / key-value length (packed: the total tokens Tq / Tk)
    D / Dv     query-key head dim / value head dim

    q: (..., H, L, D)   k: (..., Hkv, S, D)   v: (..., Hkv, S, Dv)
    out: (..., H, L, Dv)   lse: (..., H, L)   weights: (..., H, L, S)
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

_NUMPY_NAMES: dict[Any, str] = {}     # str() of a NumPy dtype costs ~2.5 µs, a lookup ~0.1


def dtype_name(x: Any) -> str:
    """'float32' for a NumPy float32 array and for a torch.float32 tensor alike."""
    d = x.dtype
    if isinstance(d, np.dtype):
        name = _NUMPY_NAMES.get(d)
        if name is None:
            name = _NUMPY_NAMES[d] = str(d)
        return name
    return str(d).removeprefix("torch.")


def is_torch(x: Any) -> bool:
    """Whether x is a torch tensor (never imports torch; torch.compile traces it)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def autocast(*xs: Any) -> tuple[Any, ...]:
    """q, k, v as ``torch.autocast`` hands them to SDPA: where autocast is on for their
    device, floating tensors other than float64 in its dtype (a model's rotary
    embedding leaves q and k in float32 next to a bfloat16 v); otherwise as given."""
    if not is_torch(xs[0]):
        return xs
    torch = sys.modules["torch"]
    if not torch._C._is_any_autocast_enabled():          # one call where autocast is off anywhere
        return xs
    dev = xs[0].device.type
    if not (torch.amp.is_autocast_available(dev) and torch.is_autocast_enabled(dev)):   # meta: none
        return xs
    dt = torch.get_autocast_dtype(dev)
    return tuple(x.to(dt) if is_torch(x) and x.is_floating_point() and x.dtype != torch.float64 else x
                 for x in xs)


def broadcast_to(x: Any, shape: tuple[int, ...]) -> Any:
    """A broadcast view (no copy) in x's own array library (NumPy's read-only, as
    ``np.broadcast_to`` makes them; to x's own shape a plain read-only view, which
    costs a sixth of it)."""
    if not isinstance(x, np.ndarray):
        return x.broadcast_to(shape)
    if x.shape != shape:
        return np.broadcast_to(x, shape)
    y = x.view()
    y.flags.writeable = False
    return y


def reduce_to(grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum a gradient over the dims along which its input was broadcast to grad's shape."""
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1
    )
    if axes:
        grad = grad.sum(axis=axes) if isinstance(grad, np.ndarray) else grad.sum(dim=axes)
    return grad.reshape(shape)


def heads_inner(x: Any) -> bool:
    """Whether an (..., H, L, D) array or tensor has its heads closer together in memory
    than its rows (transformers' (B, L, H, D) seen as (B, H, L, D)): the forward's out
    then takes that layout too, as PyTorch SDPA's does, so the caller's transpose back
    to (B, L, H, D) costs no copy."""
    if x.ndim < 3 or x.shape[-3] < 2 or x.shape[-2] < 2:
        return False
    return strides_heads_inner(x.strides if isinstance(x, np.ndarray) else x.stride())


def strides_heads_inner(st: tuple[int, ...]) -> bool:
    """:func:`heads_inner`'s test on strides alone, for a caller that knows its heads
    and rows are two or more (a kept call, whose signature says so)."""
    return bool(st[-3] < st[-2])


def empty_out(shape: tuple[int, ...], inner: bool, new: Any) -> Any:
    """``new(shape)`` (an empty (..., H, L, Dv) array or tensor) or, ``inner``, the
    same shape with the heads inner in memory (an (..., L, H, Dv) buffer seen as
    (..., H, L, Dv))."""
    if not inner:
        return new(shape)
    return new(shape[:-3] + (shape[-2], shape[-3], shape[-1])).swapaxes(-3, -2)


def as_int(x: Any) -> Any:
    """x as an int where ``operator.index`` reads one (NumPy integers, 0-d integer
    arrays and tensors), else as it came: bools (of any library) are no ints here."""
    if type(x) is int:                                   # (most calls: no dtype to read)
        return x
    if isinstance(x, (bool, np.bool_)) or str(getattr(x, "dtype", "")) in ("bool", "torch.bool"):
        return x
    try:
        return operator.index(x)
    except TypeError:
        return x


def prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def acc_dtype(dtype: str) -> str:
    """The dtype attnkit accumulates (and returns lse) in for inputs of ``dtype``: float32
    for the half types and float32, float64 for float64."""
    return "float64" if dtype == "float64" else "float32"


@dataclass(frozen=True)
class Spec:
    """Validated, normalised inputs of one call. Arrays keep their library (NumPy or
    torch); only :func:`attnkit.spec.validate` makes one.

    ``q, k, v`` are at least 3-D (2-D inputs got a head axis); ``batch`` is the
    broadcast shape of their leading dims. Masks are the user's arrays, not expanded
    (``keep``/``drop``/``bias`` at least 2-D, ``alibi_slopes`` at least 1-D, ``sinks``
    at least 2-D: a per-head ``(H,)`` becomes ``(H, 1)``). ``q_lengths``/``kv_lengths``/``kv_starts``
    are int arrays broadcast to ``batch`` (or None); ``cu_seqlens_q``/``cu_seqlens_k``
    1-D int arrays (packed mode, ``packed`` True). ``shapes`` holds the user's own
    shapes by argument name (gradients are reduced to them).
    """

    q: Any
    k: Any
    v: Any
    batch: tuple[int, ...]
    H: int
    Hkv: int
    L: int
    S: int
    D: int
    Dv: int
    scale: float
    causal: bool = False
    window: tuple[int | None, int | None] | None = None
    align: str = "bottom_right"
    keep: Any = None
    drop: Any = None
    bias: Any = None
    softcap: float | None = None
    alibi_slopes: Any = None
    sinks: Any = None
    q_lengths: Any = None
    kv_lengths: Any = None
    kv_starts: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None
    dropout: float = 0.0
    seed: Any = None
    dtype: str = "float64"
    two_d: bool = False
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    # A block of a larger problem (ring attention, split-KV): local row i, key j are
    # global row origin[0] + i, key origin[1] + j of a problem of extent (L, S) —
    # causal/window/ALiBi/lengths and dropout's counters use the global positions.
    # Never set by users; (0, 0) and None mean the call is the whole problem.
    origin: tuple[int, int] = (0, 0)
    extent: tuple[int, int] | None = None
    # The flash forward writes out with its heads inner where q has them so
    # (heads_inner): the torch path outside the custom op, whose caller (transformers)
    # transposes out back to (B, L, H, Dv). Never set by users.
    out_like_q: bool = False
    # The rungs backends.select chose for calls of one kept check (validate reuses its
    # check for calls of the same signature), by (candidates, need); shared by the Specs
    # validate makes from that check, dropped by every other replace. Never set by users.
    chosen: dict[tuple[Any, str | None], Any] | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_arrays(cls, q: Any, k: Any, v: Any, *, two_d: bool = False,
                    shapes: Mapping[str, tuple[int, ...]] | None = None, **options: Any) -> Spec:
        """A Spec from arrays already in normal form (q, k, v at least 3-D, masks as
        :func:`~attnkit.spec.validate` leaves them) and validated options; the sizes
        are read off the arrays. Nothing is checked: for code that rebuilds a Spec
        from one (the torch op, ring attention)."""
        H, L, D = (int(n) for n in q.shape[-3:])
        Hkv, S = (int(n) for n in k.shape[-3:-1])
        Dv = D if v is None else int(v.shape[-1])
        lead = [tuple(q.shape[:-3]), tuple(k.shape[:-3])] + ([] if v is None else [tuple(v.shape[:-3])])
        batch = tuple(int(n) for n in np.broadcast_shapes(*lead))
        if shapes is None:
            shapes = {"q": tuple(q.shape), "k": tuple(k.shape)}
            if v is not None:
                shapes["v"] = tuple(v.shape)
            for name in ("bias", "sinks"):
                if options.get(name) is not None:
                    shapes[name] = tuple(options[name].shape)
        return cls(q=q, k=k, v=v, batch=batch, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv,
                   dtype=dtype_name(q), two_d=two_d, shapes=dict(shapes), **options)

    def replace(self, **changes: Any) -> Spec:
        """A copy with some fields changed (for rungs that run a sub-problem). Like
        ``dataclasses.replace`` (unknown names are a TypeError) without re-running
        ``__init__`` over every field: it runs once per torch call."""
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"Spec.replace: no field(s) {sorted(unknown)}")
        new = object.__new__(Spec)
        new.__dict__.update(self.__dict__)
        new.__dict__["chosen"] = None                    # another call: choose again
        new.__dict__.update(changes)
        return new

    # ---- derived facts -------------------------------------------------------
    @property
    def torch(self) -> bool:
        return is_torch(self.q)

    @property
    def acc_dtype(self) -> str:
        """Half types accumulate in float32, float64 in float64 (:func:`acc_dtype`)."""
        return acc_dtype(self.dtype)

    @property
    def group(self) -> int:
        """Query heads per key-value head (GQA); head h reads kv head h // group."""
        return self.H // self.Hkv

    @property
    def packed(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def varlen(self) -> bool:
        """Per-sequence lengths of any kind (padded or packed)."""
        return self.packed or self.q_lengths is not None or self.kv_lengths is not None or self.kv_starts is not None

    @property
    def block(self) -> bool:
        """True for a block of a larger problem (see ``origin``)."""
        return self.extent is not None

    @property
    def has_index_mask(self) -> bool:
        return self.causal or self.window is not None

    @property
    def score_shape(self) -> tuple[int, ...]:
        return self.batch + (self.H, self.L, self.S)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.batch + (self.H, self.L, self.Dv)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.batch + (self.H, self.L)

    @property
    def user_out_shape(self) -> tuple[int, ...]:
        """out's shape as the user sees it: 2-D inputs give no head axis."""
        return self.out_shape[:-3] + self.out_shape[-2:] if self.two_d else self.out_shape

    @property
    def user_lse_shape(self) -> tuple[int, ...]:
        return self.lse_shape[:-2] + self.lse_shape[-1:] if self.two_d else self.lse_shape

    def to_inputs(self, dq: Any, dk: Any, dv: Any) -> tuple[Any, Any, Any]:
        """Gradients per query head (..., H, L|S, X) summed into their kv head (GQA),
        then over the dims the user's q, k, v were broadcast along: their shapes."""
        def fold(x: Any) -> Any:  # (..., H, S, X) -> (..., Hkv, S, X); no GQA: x itself (a sum
            if self.group == 1:   # over a size-1 axis copies the whole gradient, serially)
                return x
            return x.reshape(x.shape[:-3] + (self.Hkv, self.group) + x.shape[-2:]).sum(axis=-3)

        return (reduce_to(dq, self.shapes["q"]), reduce_to(fold(dk), self.shapes["k"]),
                reduce_to(fold(dv), self.shapes["v"]))


_FIELDS = frozenset(f.name for f in fields(Spec))
