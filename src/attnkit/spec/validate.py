"""Argument validation: every user-facing check, run once per call before any compute.

:func:`validate` turns the user's q, k, v and masking keywords into a :class:`Spec`
or raises a ``TypeError``/``ValueError`` that names the argument as the user wrote
it, what was expected and what was given. Backends receive the Spec and never check
again.
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np

from .core import Spec, dtype_name, is_torch, prod
from .options import BY_NAME, NAMES, unexpected

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
INT_KINDS = "iu"
BACKENDS = ("auto", "reference", "flash", "small", "torch", "triton")
ALIGNS = ("bottom_right", "top_left")
_TENSOR_OPTIONS = tuple(n for n in NAMES if BY_NAME[n].schema == "Tensor?" and n != "seed")
_TENSOR_SET = frozenset(_TENSOR_OPTIONS)
_DEFAULTS = {n: BY_NAME[n].default for n in NAMES}


# ---- arrays ------------------------------------------------------------------------
def compiling() -> bool:
    """True while torch.compile traces (values of tensors cannot be read then)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.compiler.is_compiling())


def as_array(name: str, x: Any, want_torch: bool, required: bool = False) -> Any:
    """x as an array of the call's library (a torch tensor when q is one, else NumPy);
    None stays None unless ``required``."""
    if x is None:
        if required:
            raise TypeError(f"{name}: expected an array, got None")
        return None
    if want_torch:
        if not is_torch(x):
            raise TypeError(f"{name}: expected a torch.Tensor like q, got {type(x).__name__}")
        import torch
        if x.layout != torch.strided:
            raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}; "
                            "call .to_dense() first")
        if x.is_nested:
            raise TypeError(f"{name}: expected a dense tensor, got a nested tensor; pad it "
                            "(.to_padded_tensor(0.0)) and pass the lengths (q_lengths, kv_lengths), or "
                            "pack its sequences (cu_seqlens_q, cu_seqlens_k)")
        return x
    if is_torch(x):
        raise TypeError(f"{name}: got a torch.Tensor but q is not one; pass one array library")
    try:
        a = np.asarray(x)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name}: cannot be read as an array ({' '.join(str(e).split())})") from None
    if a.dtype == object:
        raise TypeError(f"{name}: expected numbers, got an object array (ragged lists or mixed types?)")
    return a


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(map(int, x.shape))


def _as_3d(name: str, x: Any, last: str) -> Any:
    """(L, D) -> (1, L, D); checks that x has at least 2 dims."""
    if x.ndim < 2:
        raise ValueError(f"{name}: expected shape (..., {last}) with at least 2 dims, got {_shape(x)}")
    return x[None] if x.ndim == 2 else x


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return tuple(np.broadcast_shapes(shape, target)) == tuple(target)
    except ValueError:
        return False


def _at_least(x: Any, nd: int) -> Any:
    """x with leading size-1 dims up to nd dims (a view)."""
    return x.reshape((1,) * (nd - x.ndim) + tuple(x.shape)) if x.ndim < nd else x


def host_ints(name: str, x: Any) -> np.ndarray:
    """x's values on the host as a NumPy array (a torch tensor is copied from its
    device); a tensor inside ``torch.func.vmap`` has none to read: a TypeError naming it."""
    if not is_torch(x):
        return np.asarray(x)
    if x.device.type == "meta":
        raise ValueError(f"{name}: its values are read to check them, and a tensor on the meta device has "
                         "none; pass it on a device with data")
    if sys.modules["torch"]._C._functorch.is_functorch_wrapped_tensor(x):
        raise TypeError(f"{name}: its values are read to check them, which torch.func transforms (vmap) do "
                        "not allow; pass it unbatched (in_dims=None) or call once per sample")
    try:
        return x.numpy()                                 # a CPU tensor: a view, in one call
    except (RuntimeError, TypeError):                    # another device, grad, a negative bit
        return np.asarray(x.detach().resolve_neg().cpu())


# ---- scalars -----------------------------------------------------------------------
def _real(name: str, x: Any, *, positive: bool = False, zero: str = "") -> float:   # zero: a 0's hint
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not math.isfinite(float(x)) \
            or (positive and not float(x) > 0):
        want = "a positive finite number" if positive else "a finite real number"
        raise ValueError(f"{name}: expected {want}, got {x!r}{zero if isinstance(x, numbers.Real) and x == 0 else ''}")
    return float(x)


UNBOUNDED = 1 << 30


def _window(window: Any) -> tuple[int | None, int | None] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(f"window: expected (left, right) with ints or None, got {window!r}")
    sides = []
    for side, x in zip(("left", "right"), window):
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Integral) or x < 0):
            hint = " (None: unbounded, where FlashAttention writes -1)" if x == -1 else ""
            raise ValueError(f"window: {side} size must be a non-negative int or None, got {x!r}{hint}")
        # a side of 2**30 keys or more is unbounded: no sequence is that long, and
        # diag ± side stays inside every rung's integers (2**63 − 1 wrapped: no key)
        sides.append(None if x is None or int(x) >= UNBOUNDED else int(x))
    return None if sides == [None, None] else (sides[0], sides[1])


def choice(name: str, x: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(x, str) or x not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {x!r}")
    return x


def check_seed(seed: Any, name: str = "seed") -> int | None:
    """A dropout seed: None or an int in [0, 2**64)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2 ** 64:
        raise ValueError(f"{name}: expected an int in [0, 2**64), got {seed!r}")
    return int(seed)


def _grad_enabled() -> bool:
    import torch
    return torch.is_grad_enabled()


# ---- the call ------------------------------------------------------------------------
# validate's result depends only on the arrays' types, dtypes, shapes, devices and
# layouts and on the scalar keywords, but for the values of array keywords (lengths,
# offsets): such calls are checked in full once per signature and the Spec is reused
# with the new arrays, the array keywords alone checked again (_array_keywords) — a
# decoding step repeats one signature in every layer, a padded batch one per layer.
# Without array keywords but sinks and slopes (BY_HEAD: no check reads their values or
# S) the key length S is left out of the signature (nothing else the check decides
# depends on it): each decoding step has one more key, and reuses the previous one's.
_SEEN: dict[tuple[Any, ...], Spec] = {}
_SEEN_MAX, BY_HEAD = 256, ("sinks", "alibi_slopes")
_PLAIN = frozenset({type(None), bool, int, float, str})  # keyword types keyed as they are


def _typed(x: Any) -> Any:
    """A keyword's value with its type, and its items' (causal=1 and window=(1.0, 2) are
    refused where causal=True and window=(1, 2) are not, though they compare equal)."""
    if isinstance(x, (tuple, list)):
        return type(x), tuple(_typed(e) for e in x)
    return type(x), x


def _library(q: Any, k: Any, v: Any, need_v: bool) -> Any:
    """The library of a call whose check can be reused — NumPy (``np``) for NumPy
    arrays, torch for torch tensors outside torch.compile tracing, k and v of at least
    2 dims — or None (other or mixed types)."""
    kind = type(q)
    if type(k) is not kind or (need_v and type(v) is not kind):
        return None
    lib: Any = np
    if kind is not np.ndarray:
        lib = sys.modules.get("torch")
        if lib is None or kind is not lib.Tensor or lib.compiler.is_compiling() \
                or q.is_nested or k.is_nested or (need_v and v.is_nested):    # (the full check refuses them)
            return None
    return lib if k.ndim >= 2 and (not need_v or v.ndim >= 2) else None


def tensor_key(q: Any, k: Any, v: Any, need_v: bool = True) -> tuple[Any, ...] | None:
    """What q, k (and v) put in the :func:`signature` of a call without array keywords:
    dtypes, shapes but the key length, and for torch devices and layouts; None where
    :func:`_library` finds none."""
    lib = _library(q, k, v, need_v)
    if lib is None:
        return None
    ks = k.shape
    if lib is np:
        key: tuple[Any, ...] = (q.dtype, q.shape, k.dtype, ks[:-2], ks[-1])
        return key + (v.dtype, v.shape[:-2], v.shape[-1]) if need_v else key
    key = (q.dtype, q.shape, q.device, q.layout, k.dtype, ks[:-2], ks[-1], k.device, k.layout)
    return key + (v.dtype, v.shape[:-2], v.shape[-1], v.device, v.layout) if need_v else key


def plain_signature(q: Any, k: Any, v: Any, backend: str, need_v: bool, options: dict) -> tuple[Any, ...] | None:
    """:func:`signature`'s key for the common case — no array keyword, every keyword
    a plain scalar (None, bool, int, float, str) — in one go; None for any other call."""
    kinds = tuple(map(type, options.values()))
    if not (_TENSOR_SET.isdisjoint(options) and _PLAIN.issuperset(kinds)):
        return None
    key = tensor_key(q, k, v, need_v)
    return None if key is None else key + (backend, need_v, tuple(options.items()), kinds)


def signature(q: Any, k: Any, v: Any, backend: str, need_v: bool,
              options: dict) -> tuple[tuple[Any, ...] | None, bool]:
    """(the key of a call whose check can be reused, or None: other array types, array
    keywords of another kind than q, torch.compile tracing; whether array keywords
    were given). Without them, k's and v's key length is not part of the key
    (:func:`tensor_key`). The keywords enter in the caller's order (another order:
    another key)."""
    key = plain_signature(q, k, v, backend, need_v, options)   # the common case, in one go
    if key is not None:
        return key, False
    lib = _library(q, k, v, need_v)
    if lib is None:
        return None, False
    ks, vs = k.shape, (v.shape if need_v else k.shape)
    arrays: tuple[Any, ...] = ()
    scalars: tuple[Any, ...] = ()
    by_S = False                                         # an array whose shape or check involves S
    for name, x in options.items():                      # arrays, numbers for array keywords,
        if x is not None and name in _TENSOR_SET:        # tuples, NumPy scalars...
            if type(x) is not type(q) and not (lib is not np and type(x) is lib.nn.Parameter) or \
                    lib is not np and x.is_nested:       # (a model's sinks; nested: the full check's)
                return None, True
            arrays += (name, x.dtype, x.shape) if lib is np else (name, x.dtype, x.shape, x.device, x.layout)
            by_S = by_S or name not in BY_HEAD
        else:
            scalars += (name, _typed(x)) if isinstance(x, (tuple, list)) else (name, type(x), x)
    if by_S:                                             # their shapes or values follow S: keep it
        key = (q.dtype, q.shape, k.dtype, ks) + ((v.dtype, vs) if need_v else ())
    else:
        key = (q.dtype, q.shape, k.dtype, ks[:-2], ks[-1]) + ((v.dtype, vs[:-2], vs[-1]) if need_v else ())
    if lib is not np:
        key += (q.device, q.layout, k.device, k.layout) + ((v.device, v.layout) if need_v else ())
    return key + arrays + (backend, need_v) + scalars, bool(arrays)


# array keywords whose values may join a call's key (attnkit.api's kept calls): the
# sequences' lengths and offsets, which fix the plan (a model's layers repeat them)
GEOMETRY = ("q_lengths", "kv_lengths", "kv_starts", "cu_seqlens_q", "cu_seqlens_k")
GEOMETRY_MAX = 4096


def geometry_key(options: dict, read: tuple[str, ...] = ()) -> tuple[Any, ...] | None:
    """The values of a call's array keywords, to key the call by with its
    :func:`signature`: each one's name and bytes where all are lengths or offsets of
    at most GEOMETRY_MAX elements in CPU memory (NumPy arrays, torch CPU tensors);
    None for any other array keyword but those named in ``read`` (keyed by the
    signature's dtype and shape alone: what keeps the call reads them every call)."""
    key: tuple[Any, ...] = ()
    for name, x in options.items():
        if x is None or name not in _TENSOR_SET or name in read:
            continue
        if name not in GEOMETRY:
            return None
        try:
            a = x if isinstance(x, np.ndarray) else x.numpy()   # another device: TypeError
        except (TypeError, RuntimeError, AttributeError):
            return None
        if a.size > GEOMETRY_MAX:
            return None
        key += (name, a.tobytes())
    return key


_NUMBERS = (bool, int, float, np.bool_, np.integer, np.floating)


def torch_numbers(q: Any, options: dict) -> dict:
    """A Python (or NumPy scalar) number given for an array keyword of a torch call —
    ``kv_lengths=5``, ``keep=True``, ``bias=0.5`` — as the 0-d tensor NumPy would read it
    as in a NumPy call, on q's device: bools bool, ints int64, floats in the
    accumulation dtype (float64 for float64 q, else float32). Arrays stay as given
    (a NumPy array with torch tensors is still refused: one library per call)."""
    numbers_given = [n for n, x in options.items() if n in _TENSOR_SET and isinstance(x, _NUMBERS)]
    if not numbers_given:
        return options
    import torch
    floats = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = dict(options)
    for n in numbers_given:
        x = options[n]
        dt = (torch.bool if isinstance(x, (bool, np.bool_)) else
              torch.int64 if isinstance(x, (int, np.integer)) else floats)
        out[n] = torch.tensor(x.item() if isinstance(x, np.generic) else x, dtype=dt, device=q.device)
    return out


def validate(q: Any, k: Any, v: Any, *, backend: str = "auto", need_v: bool = True,
             **options: Any) -> Spec:
    """Check every argument and return a Spec. Raises TypeError / ValueError naming the
    argument, what was expected and what was given. ``need_v=False`` (weights only):
    v must be None."""
    if options and is_torch(q):
        options = torch_numbers(q, options)
    key, arrays_given = signature(q, k, v, backend, need_v, options)
    try:
        seen = None if key is None else _SEEN.get(key)
    except TypeError:                                    # an unhashable keyword: check it in full
        key = seen = None
    if seen is not None:
        S = k.shape[-2]
        if S > 0 and (not need_v or v.shape[-2] == S):   # else the full check's error
            shapes = {**seen.shapes, "k": tuple(k.shape)}   # (the key length: this call's)
            if need_v:
                shapes["v"] = tuple(v.shape)
            if q.ndim == 2:                              # the arrays in normal form, as below
                q = q[None]
            if k.ndim == 2:
                k = k[None]
            if not need_v:
                v = None
            elif v.ndim == 2:
                v = v[None]
            arrays = {} if not arrays_given else _array_keywords({**_DEFAULTS, **options}, is_torch(q), seen.batch,
                                                                 seen.H, seen.L, int(S), {})
            return seen.replace(q=q, k=k, v=v, S=int(S), shapes=shapes, chosen=seen.chosen, **arrays)
    spec = _validate(q, k, v, backend, need_v, options)
    if key is not None:
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        chosen: dict[Any, Any] = {}
        _SEEN[key] = spec.replace(q=None, k=None, v=None, chosen=chosen, **dict.fromkeys(_TENSOR_OPTIONS))
        spec = spec.replace(chosen=chosen)
    return spec


def _validate(q: Any, k: Any, v: Any, backend: str, need_v: bool, options: dict) -> Spec:
    """:func:`validate` in full."""
    unknown = options.keys() - _DEFAULTS.keys()
    if unknown:
        raise TypeError(unexpected(unknown, NAMES))
    opt = {**_DEFAULTS, **options}
    want_torch = is_torch(q)
    q = as_array("q", q, want_torch, required=True)
    k = as_array("k", k, want_torch, required=True)
    v = as_array("v", v, want_torch, required=True) if need_v else None
    shapes = {"q": _shape(q), "k": _shape(k)}
    if v is not None:
        shapes["v"] = _shape(v)

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
        for name, x in (("k", k), ("v", v)) + tuple((n, opt[n]) for n in _TENSOR_OPTIONS if opt[n] is not None):
            if x is not None and is_torch(x) and x.device != q.device:
                raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {x.device}")

    two_d = q.ndim == 2
    q = _as_3d("q", q, "H, L, D")
    k = _as_3d("k", k, "Hkv, S, D")
    v = _as_3d("v", v, "Hkv, S, Dv") if v is not None else None
    H, L, D = (int(n) for n in q.shape[-3:])
    Hkv, S, Dk = (int(n) for n in k.shape[-3:])
    if Dk != D:
        raise ValueError(f"k: expected last dim D={D} (q's head dim), got shape {shapes['k']}")
    Dv = D
    if v is not None:
        Hv, Sv, Dv = (int(n) for n in v.shape[-3:])
        if Sv != S or Hv != Hkv:
            raise ValueError(f"v: expected shape (..., Hkv={Hkv}, S={S}, Dv) like k, got {shapes['v']}")
    if 0 in (H, Hkv, L, S, D, Dv):
        raise ValueError(f"q, k, v: H, Hkv, L, S, D and Dv must be positive, got q {shapes['q']}, "
                         f"k {shapes['k']}" + (f", v {shapes['v']}" if v is not None else ""))
    if H % Hkv != 0:
        raise ValueError(f"k: query heads H={H} must be a multiple of key-value heads Hkv={Hkv} "
                         f"(k shape {shapes['k']})")
    lead = [_shape(q)[:-3], _shape(k)[:-3]] + ([_shape(v)[:-3]] if v is not None else [])
    batch = lead[0]
    if any(x != batch for x in lead):
        try:
            batch = tuple(int(n) for n in np.broadcast_shapes(*lead))
        except ValueError:
            raise ValueError(f"q, k, v: leading batch dims {lead} do not broadcast") from None
    if 0 in batch:
        raise ValueError(f"q, k, v: batch dims must be non-empty, got batch shape {batch} "
                         f"(q {shapes['q']}, k {shapes['k']})")
    arrays = _array_keywords(opt, want_torch, batch, H, L, S, shapes)

    scale = 1.0 / math.sqrt(D) if opt["scale"] is None else _real("scale", opt["scale"])
    softcap = None if opt["softcap"] is None else _real("softcap", opt["softcap"], positive=True,
                                                        zero=" (None: no cap, where FlashAttention writes 0.0)")
    causal = opt["causal"]
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal: expected True or False, got {causal!r}")
    window = _window(opt["window"])
    align = choice("align", opt["align"], ALIGNS)
    choice("backend", backend, BACKENDS)
    p = opt["dropout"]
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0 <= float(p) < 1:
        raise ValueError(f"dropout: expected a probability 0 <= p < 1, got {p!r}")
    seed = check_seed(opt["seed"])
    if float(p) > 0 and seed is None and not want_torch:
        raise ValueError("seed: dropout > 0 needs a seed (an int >= 0) so that the backward pass and "
                         "every rung drop the same weights")

    return Spec(q=q, k=k, v=v, batch=batch, H=H, Hkv=Hkv, L=L, S=S, D=D, Dv=Dv, dtype=dt, two_d=two_d,
                shapes=shapes, scale=scale, causal=bool(causal), window=window, align=align,
                softcap=softcap, dropout=float(p), seed=seed, **arrays)


def _array_keywords(opt: dict, want_torch: bool, batch: tuple[int, ...], H: int, L: int, S: int,
                    shapes: dict) -> dict[str, Any]:
    """The array keywords checked (dtypes, shapes; lengths' and offsets' values) and in
    the Spec's normal form, by field name; their shapes recorded in ``shapes``."""
    score_shape = batch + (H, L, S)
    arrays: dict[str, Any] = {}
    for name in ("keep", "drop", "bias"):
        m = as_array(name, opt[name], want_torch)
        if m is not None:
            d = dtype_name(m)
            if name != "bias" and d != "bool":
                pol = "attend" if name == "keep" else "masked out"
                raise TypeError(f"{name}: expected a boolean mask (True = {pol}), got dtype {d}")
            if name == "bias" and d not in FLOAT_DTYPES:
                raise TypeError(f"bias: expected a float dtype {FLOAT_DTYPES}, got {d}")
            if not _broadcasts_to(_shape(m), score_shape):
                raise ValueError(f"{name}: expected a shape that broadcasts to (..., H, L, S) = "
                                 f"{score_shape}, got {_shape(m)}")
            shapes[name] = _shape(m)
            m = _at_least(m, 2)
        arrays[name] = m

    slopes = as_array("alibi_slopes", opt["alibi_slopes"], want_torch)
    if slopes is not None:
        if dtype_name(slopes) not in FLOAT_DTYPES:
            raise TypeError(f"alibi_slopes: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(slopes)}")
        if not _broadcasts_to(_shape(slopes), batch + (H,)):
            raise ValueError(f"alibi_slopes: expected a shape that broadcasts to (..., H) = {batch + (H,)}, "
                             f"got {_shape(slopes)}")
        if want_torch and slopes.requires_grad and _grad_enabled():
            raise TypeError("alibi_slopes: attnkit computes no gradient for the slopes; pass them without "
                            "requires_grad (e.g. slopes.detach())")
        shapes["alibi_slopes"] = _shape(slopes)
        slopes = _at_least(slopes, 1)

    sinks = as_array("sinks", opt["sinks"], want_torch)
    if sinks is not None:
        if dtype_name(sinks) not in FLOAT_DTYPES:
            raise TypeError(f"sinks: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(sinks)}")
        shapes["sinks"] = _shape(sinks)
        if sinks.ndim == 1:
            if sinks.shape[0] != H:
                raise ValueError(f"sinks: a 1-D sinks array is one logit per head, expected shape ({H},), "
                                 f"got {_shape(sinks)}")
            sinks = sinks.reshape(H, 1)
        elif sinks.ndim == 0:
            sinks = sinks.reshape(1, 1)                  # one logit for every row
        elif not _broadcasts_to(_shape(sinks), batch + (H, L)):
            raise ValueError(f"sinks: expected shape (H,) = ({H},) or a shape that broadcasts to "
                             f"(..., H, L) = {batch + (H, L)}, got {_shape(sinks)}")

    if opt["cu_seqlens_q"] is not None or opt["cu_seqlens_k"] is not None:
        both = [n for n in ("q_lengths", "kv_lengths", "kv_starts") if opt[n] is not None]
        if both:                                         # (before their shapes are checked: those
            raise ValueError(f"{', '.join(both)}: not combined with cu_seqlens_q/cu_seqlens_k (packed "
                             "sequences carry their lengths in the offsets)")   # are the batch's)
    lengths = check_sequence_lengths(opt, want_torch, batch, L, S, shapes)
    cu = check_cu_seqlens(opt, want_torch, batch, H, L, S, shapes)
    return dict(arrays, alibi_slopes=slopes, sinks=sinks, q_lengths=lengths[0], kv_lengths=lengths[1],
                kv_starts=lengths[2], cu_seqlens_q=cu[0], cu_seqlens_k=cu[1])


def dtype_kind(x: Any) -> str:
    """NumPy's kind letter of x's dtype ('f', 'i', 'u', 'b', ...) for either library."""
    name = dtype_name(x)
    if name in FLOAT_DTYPES:
        return "f"
    try:
        return np.dtype(name).kind
    except TypeError:
        return "?"


def _int_array(name: str, x: Any, want_torch: bool) -> Any:
    a = as_array(name, x, want_torch)
    if a is not None and dtype_kind(a) not in INT_KINDS:
        raise TypeError(f"{name}: expected integers, got dtype {dtype_name(a)}")
    return a


def check_lengths(name: str, x: Any, want_torch: bool, batch: tuple[int, ...], n: int, axis: str,
                  shapes: dict | None = None) -> Any:
    """Per-sequence lengths: ints broadcastable to the batch dims with values in
    [0, n] -> broadcast to the batch dims (None stays None)."""
    a = _int_array(name, x, want_torch)
    if a is None:
        return None
    shape = _shape(a)
    if shape != batch and not _broadcasts_to(shape, batch):
        raise ValueError(f"{name}: expected a shape that broadcasts to the batch dims {batch}, got {shape}")
    if shapes is not None:
        shapes[name] = shape
    if not compiling():
        h = host_ints(name, a)
        if h.size and (h.min() < 0 or h.max() > n):
            raise ValueError(f"{name}: expected lengths in [0, {axis}={n}], got {h.ravel().tolist()[:16]}")
    if shape == batch:
        return a
    return a.broadcast_to(batch) if want_torch else np.broadcast_to(a, batch)


def check_sequence_lengths(opt: dict, want_torch: bool, batch: tuple[int, ...], L: int, S: int,
                           shapes: dict) -> tuple[Any, Any, Any]:
    """q_lengths / kv_lengths / kv_starts broadcast to the batch dims, values checked
    (a sequence's first key at most its key length)."""
    kv_lengths = check_lengths("kv_lengths", opt["kv_lengths"], want_torch, batch, S, "S", shapes)
    starts = check_lengths("kv_starts", opt["kv_starts"], want_torch, batch, S, "S", shapes)
    if starts is not None and kv_lengths is not None and not compiling():
        first, n = host_ints("kv_starts", starts), host_ints("kv_lengths", kv_lengths)
        after = np.flatnonzero((first > n).ravel())
        if after.size:
            b = int(after[0])
            raise ValueError(f"kv_starts: sequence {b} starts at key {int(first.ravel()[b])}, past its "
                             f"kv_lengths of {int(n.ravel()[b])} (a sequence's keys are [kv_starts, kv_lengths))")
    return check_lengths("q_lengths", opt["q_lengths"], want_torch, batch, L, "L", shapes), kv_lengths, starts


def check_cu_seqlens(opt: dict, want_torch: bool, batch: tuple[int, ...], H: int, L: int, S: int,
                     shapes: dict) -> tuple[Any, Any]:
    """cu_seqlens_q / cu_seqlens_k (packed sequences): both or neither, one batch
    element, offsets from 0 to the query / key totals, non-decreasing."""
    cq = _int_array("cu_seqlens_q", opt["cu_seqlens_q"], want_torch)
    ck = _int_array("cu_seqlens_k", opt["cu_seqlens_k"], want_torch)
    if cq is None and ck is None:
        return None, None
    if cq is None or ck is None:
        missing = "cu_seqlens_q" if cq is None else "cu_seqlens_k"
        raise ValueError(f"{missing}: packed sequences need both cu_seqlens_q and cu_seqlens_k")
    if prod(batch) != 1:
        raise ValueError(f"q: packed sequences (cu_seqlens_q) take q (H, Tq, D) or (1, H, Tq, D), "
                         f"got batch dims {batch}")
    for name, a, total, axis in (("cu_seqlens_q", cq, L, "Tq"), ("cu_seqlens_k", ck, S, "Tk")):
        if a.ndim != 1 or a.shape[0] < 2:
            raise ValueError(f"{name}: expected a 1-D array of B + 1 >= 2 offsets, got shape {_shape(a)}")
        shapes[name] = _shape(a)
        if compiling():
            continue
        given = host_ints(name, a)
        h = given.astype(np.int64)                       # (messages quote the values as given:
        if h[0] != 0:                                    # uint64 past 2**63 wraps in int64)
            raise ValueError(f"{name}: expected offsets starting at 0, got {given.tolist()[:16]}")
        if (np.diff(h) < 0).any():
            raise ValueError(f"{name}: expected non-decreasing offsets, got {given.tolist()[:16]}")
        if h[-1] != total:
            hint = (f" (q's dim -3 is {H}: q in FlashAttention's (Tq, H, D) layout? attnkit takes (H, Tq, D): "
                    "swap q's, k's and v's first two axes)" if name == "cu_seqlens_q" and h[-1] == H else "")
            raise ValueError(f"{name}: the last offset must be the packed length {axis}={total}, "
                             f"got {given.tolist()[-1]}{hint}")
    if cq.shape[0] != ck.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cq.shape[0]} offsets like cu_seqlens_q, got {ck.shape[0]}")
    return cq, ck


def validate_seed(Q: Any, K: Any, V: Any, mask: Any) -> Spec:
    """The seed function's inputs: 2-D NumPy matrices; ``mask`` any truthy array (True
    or nonzero = masked out), as the seed's np.where read it."""
    arrays = []
    for name, x in (("Q", Q), ("K", K), ("V", V)):
        if is_torch(x):
            raise TypeError(f"{name}: the seed's function takes NumPy arrays; use attnkit.attention "
                            "for torch tensors")
        a = as_array(name, x, False, required=True)
        if a.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D matrix, got shape {a.shape}")
        arrays.append(a)
    Q, K, V = arrays
    if mask is not None:
        if is_torch(mask):
            raise TypeError("mask: the seed's function takes a NumPy array")
        mask = as_array("mask", mask, False)
        if mask.dtype.kind not in "biuf":
            raise TypeError(f"mask: expected a boolean or numeric array (True = masked out), got {mask.dtype}")
        mask = mask.astype(bool)
        if not _broadcasts_to(mask.shape, (Q.shape[0], K.shape[0])):
            raise ValueError(f"mask: expected a shape that broadcasts to (L, S) = {(Q.shape[0], K.shape[0])}, "
                             f"got {mask.shape}")
    return validate(Q, K, V, drop=mask)
