"""attention_kvcache's inputs: the cache layouts, the append, and their checks.

A cache is contiguous — ``k_cache (B, Hkv, S_max, D)`` — or paged — ``k_cache
(num_pages, Hkv, page_size, D)`` with ``block_table (B, max_pages)``: key position p of
sequence b lives in page ``block_table[b, p // page_size]`` at slot ``p % page_size``.
``cache_lengths[b]`` keys are valid; ``k_new``/``v_new`` (B, Hkv, L_new, D) are written
at positions cache_lengths[b] … cache_lengths[b] + L_new − 1 before the queries attend,
so the attention sees ``cache_lengths[b] + L_new`` keys per sequence, aligned
bottom-right per sequence (the last query sees the last key). With ``q_lengths``
sequence b has q_lengths[b] real query rows and appends that many of the new keys
(L_new = L).

Every check runs before the cache is touched: a rejected call leaves it as it was.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .core import Spec, as_int, dtype_name, is_torch
from .geometry import dense_row_bounds
from .options import BY_NAME, NAMES, unexpected
from .validate import (
    BY_HEAD,
    FLOAT_DTYPES,
    as_array,
    check_lengths,
    check_sequence_lengths,
    compiling,
    dtype_kind,
    geometry_key,
    host_ints,
    signature,
    validate,
)


@dataclass(frozen=True)
class KVCall:
    """One validated attention_kvcache call: ``spec`` describes the attention (q, the
    options, a key axis of the cache's capacity with ``kv_lengths`` = the lengths
    after the append); the rest says where the keys live."""

    spec: Spec
    k_cache: Any
    v_cache: Any
    cache_lengths: Any          # (B,) before the append (the caller's array)
    lengths: Any                # (B,) after the append (what the queries see)
    block_table: Any            # (B, max_pages) or None (contiguous)
    page_size: int              # S_max for a contiguous cache
    k_new: Any
    v_new: Any
    # keys appended per sequence, (B,), when they differ (q_lengths with k_new: the
    # first q_lengths[b] rows of k_new); None: all L_new rows for every sequence
    new_lengths: Any = None
    # what a rung keeps for every call of this call's signature (:func:`validate_kvcache`'s
    # kept checks: one dict per signature), or None (a call without one)
    memo: dict[Any, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def paged(self) -> bool:
        return self.block_table is not None


def check_paged_config(num_pages: Any, page_size: Any, kv_heads: Any, head_dim: Any, value_dim: Any, dtype: Any,
                       like: Any) -> tuple[int, int, int, int, int]:
    """PagedCache's constructor arguments; its sizes as ints (value_dim: head_dim when
    None)."""
    value_dim = head_dim if value_dim is None else value_dim
    sizes = (("num_pages", num_pages), ("page_size", page_size), ("kv_heads", kv_heads), ("head_dim", head_dim),
             ("value_dim", value_dim))
    for name, x in sizes:
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)) or x < 1:
            raise ValueError(f"{name}: expected a positive int, got {x!r}")
    if like is not None and (not hasattr(like, "new_zeros") or not like.is_floating_point()):
        of = f" of dtype {like.dtype}" if hasattr(like, "dtype") else ""
        raise TypeError(f"like: expected a floating-point torch tensor (its dtype and device make the "
                        f"cache), got {type(like).__name__}{of}")
    if like is None:
        try:
            dt = None if dtype is None else np.dtype(dtype)
        except TypeError:
            dt = None
        if dt is None or str(dt) not in FLOAT_DTYPES:
            raise TypeError(f"dtype: expected a NumPy float dtype {FLOAT_DTYPES} (torch caches: pass like= "
                            f"a tensor), got {dtype!r}")
    n, page, heads, d, dv = (int(x) for _, x in sizes)
    return n, page, heads, d, dv


def sequence_ids(seqs: Any) -> list[Any]:
    """PagedCache's sequence ids as a list: one id or an iterable of them, each an int
    where it is one (NumPy's, a 0-d integer tensor's: anything ``__index__`` reads)."""
    if isinstance(seqs, (int, np.integer)) or getattr(seqs, "ndim", None) == 0:
        return [as_int(seqs)]
    try:
        return [as_int(s) for s in seqs]
    except TypeError:
        raise TypeError(f"seqs: expected a sequence id (int) or a list of them, got {seqs!r}") from None


def check_paged_attend(q: Any, seqs: list[Any], cache: Any) -> None:
    """PagedCache.attend's arguments in its own words (attention_kvcache would name
    k_cache, which the user never passed): q against the cache's dtype and head dim,
    one sequence per row of q, none twice."""
    if hasattr(q, "dtype") and hasattr(q, "shape") and is_torch(q) != is_torch(cache):
        raise TypeError(f"q: a {type(q).__name__} for a cache of {type(cache).__name__}s (PagedCache(like=a "
                        "tensor) makes a torch cache)")
    if hasattr(q, "dtype") and hasattr(q, "shape"):
        if dtype_name(q) != dtype_name(cache):
            raise TypeError(f"q: dtype {dtype_name(q)} differs from the cache's {dtype_name(cache)} "
                            "(PagedCache(dtype=...), float32 by default)")
        if len(q.shape) == 4 and q.shape[0] != len(seqs):
            raise ValueError(f"seqs: {len(seqs)} sequence(s) for q's batch of {q.shape[0]} (one row each)")
        if len(q.shape) == 4 and q.shape[-1] != cache.shape[-1]:
            raise ValueError(f"q: expected head_dim {cache.shape[-1]} (the cache's) as its last dim, "
                             f"got shape {tuple(q.shape)}")
    twice = sorted({s for s in seqs if seqs.count(s) > 1})
    if twice:                                            # one row of q per sequence
        raise ValueError(f"seqs: sequence(s) {twice} appear more than once in {seqs}")


def _ints(name: str, x: Any, want_torch: bool, ndim: int, what: str) -> Any:
    if isinstance(x, (float, complex, np.floating, np.complexfloating)):   # (not "expected a tensor")
        raise TypeError(f"{name}: expected integers, got {x!r}")
    a = as_array(name, x, want_torch, required=True)
    if dtype_kind(a) not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {dtype_name(a)}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {what}, got shape {tuple(a.shape)}")
    return a


def _one_per_sequence(x: Any, B: int, q: Any, want_torch: bool, name: str = "cache_lengths") -> Any:
    """cache_lengths given as one length for every sequence — a Python int, a NumPy
    integer, or a 0-d array or tensor of the call's library (FlashAttention's
    ``cache_seqlens`` takes an int) — as (B,); anything else as it came (the checks
    after this name what is wrong with it)."""
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        n = int(x)
        if not -2**63 <= n < 2**63:
            raise ValueError(f"{name}: expected a length in int64's range, got {n}")
        if want_torch:                                   # (torch.full: traceable by torch.compile)
            import torch
            return torch.full((B,), n, dtype=torch.int64, device=q.device)
        return np.full(B, n, dtype=np.int64)
    if getattr(x, "ndim", None) == 0 and is_torch(x) == want_torch:
        return x.reshape(1).expand(B) if want_torch else np.broadcast_to(x, (B,))
    return x


# What validate_kvcache's checks of a call's structure (every check but the lengths',
# the block table's and the arrays' state: grad, strides, writeable) made of it, kept by
# the call's signature (:func:`_signature`): a decoding loop repeats one signature every
# step, and the full checks cost a small model's step (B = 4, 8 heads, 64 slots) 140 µs
_SEEN: dict[tuple[Any, ...], tuple[Spec, int, dict[Any, Any]]] = {}
_SEEN_MAX = 256
_KEYED_ARRAYS = frozenset(("q_lengths", "kv_starts"))
_READ_ARRAYS = BY_HEAD          # (validate's) keyed by dtype and shape, read afresh every call
_UNKEYED = object()


# the entry of a signature's memo (_SEEN) under which attention_kvcache keeps a rung's
# step for its calls: (step, the settings select read) or None (:func:`kept_step`)
STEP = "step"


def kept_step(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, block_table: Any, k_new: Any, v_new: Any,
              backend: str, options: Any) -> tuple[Any, Any]:
    """(the call's signature key, or None where it has none; the step kept for that
    signature — ``memo[STEP]``, which attention_kvcache puts there after a call of it —
    or None). Before a step is handed out, the check of the call's state it does not
    make itself runs (the caches' writability: validation's error); a step declines
    tensors that require grad under grad mode (the full path then raises) and checks
    the lengths' values."""
    key = _signature(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, backend, options)
    try:
        seen = None if key is None else _SEEN.get(key)
    except TypeError:                                    # an unhashable keyword: the full check names it
        return None, None
    made = None if seen is None else seen[2].get(STEP)
    if made is None:
        return key, None
    _check_writable(k_cache, v_cache, 0 if k_new is None else int(k_new.shape[-2]), type(q) is not np.ndarray)
    return key, made


def validate_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, *, block_table: Any = None,
                     k_new: Any = None, v_new: Any = None, backend: str = "auto", signature_key: Any = _UNKEYED,
                     **options: Any) -> KVCall:
    """Check every argument of attention_kvcache (shapes, dtypes, devices, lengths,
    pages, the append's room) and return a KVCall; nothing is written. A call of a
    signature seen before has its structure's checks reused and its values and state
    checked again (``signature_key``: the call's key where the caller made it,
    :func:`kept_step`)."""
    key = signature_key if signature_key is not _UNKEYED else \
        _signature(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, backend, options)
    try:
        seen = None if key is None else _SEEN.get(key)
    except TypeError:                                    # an unhashable keyword: the full check names it
        key = seen = None
    if seen is not None:
        spec, capacity, memo = seen
        want_torch = type(q) is not np.ndarray
        L_new = 0 if k_new is None else int(k_new.shape[-2])
        _check_grad(q, k_cache, v_cache, k_new, v_new, want_torch, options)
        _check_writable(k_cache, v_cache, L_new, want_torch)
        lengths = _one_per_sequence(cache_lengths, spec.batch[0], q, want_torch)
        q_lengths, starts = options.get("q_lengths"), options.get("kv_starts")
        ragged = q_lengths is not None and L_new > 0
        added = host_ints("q_lengths", q_lengths).astype(np.int64) if ragged else L_new
        total, shared = _check_values(lengths, added, capacity, block_table, int(k_cache.shape[0]),
                                      int(k_cache.shape[2]))
        total_arr = total if not want_torch else _torch_ints(total, q)
        arrays = {}
        if q_lengths is not None or starts is not None:  # values in the key; each first key checked
            checked = check_sequence_lengths(            # against the lengths after the append again
                dict(q_lengths=q_lengths, kv_lengths=total_arr, kv_starts=starts), want_torch, spec.batch, spec.L,
                spec.S, {})
            arrays = dict(q_lengths=checked[0], kv_starts=checked[2])
        for n in _READ_ARRAYS:                           # this call's values, in the kept shape
            if options.get(n) is not None:
                arrays[n] = options[n].reshape(getattr(spec, n).shape)
        spec = spec.replace(q=q, kv_lengths=total_arr, chosen=spec.chosen, **arrays)
        if shared is not None:
            _check_writes(spec, *shared, total, int(k_cache.shape[2]))
        return KVCall(spec=spec, k_cache=k_cache,
                      v_cache=v_cache, cache_lengths=lengths, lengths=total_arr, block_table=block_table,
                      page_size=int(k_cache.shape[2]), k_new=k_new, v_new=v_new, memo=memo,
                      new_lengths=arrays["q_lengths"] if ragged else None)
    kv = _validate_kvcache(q, k_cache, v_cache, cache_lengths, block_table, k_new, v_new, backend, options)
    if key is not None:
        if len(_SEEN) >= _SEEN_MAX:
            _SEEN.clear()
        capacity = kv.page_size * (1 if block_table is None else int(block_table.shape[1]))
        memo = {}
        # sinks and slopes by their shapes alone (each call reads its own: the first's not
        # held); memo: select's
        shapes = {n: np.broadcast_to(np.float32(0), getattr(kv.spec, n).shape)
                  for n in _READ_ARRAYS if getattr(kv.spec, n) is not None}
        _SEEN[key] = (kv.spec.replace(q=None, kv_lengths=None, chosen={}, **shapes), capacity, memo)
        kv = replace(kv, memo=memo)
    return kv


def _signature(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, block_table: Any, k_new: Any,
               v_new: Any, backend: str, options: dict) -> tuple[Any, ...] | None:
    """The key under which a call's structural checks are kept (:data:`_SEEN`):
    :func:`~attnkit.spec.validate.signature` of q and the caches, the values of
    q_lengths and kv_starts where given (host arrays of at most GEOMETRY_MAX: the
    checks of their own values are then kept too), then the caches' key lengths and the
    other arguments' types, dtypes, shapes (and devices); None for any other call
    (lists, mixed or nested arrays, torch.compile tracing). Sinks and ALiBi slopes enter
    by dtype and shape alone: no check reads their values."""
    key, arrays = signature(q, k_cache, v_cache, backend, True, options)
    if key is None:
        return None
    if arrays:                                           # q_lengths, kv_starts: by their values (a
        values = geometry_key(options, _READ_ARRAYS)     # serving loop repeats them)
        if values is None or not _KEYED_ARRAYS.issuperset(values[::2]):
            return None
        key += values
    parts = tuple(_part(x) for x in (cache_lengths, block_table, k_new, v_new))
    if _UNKEYED in parts:
        return None
    return key + (k_cache.shape[-2], v_cache.shape[-2]) + parts


def _part(x: Any) -> Any:
    """An argument's share of :func:`_signature`."""
    t = type(x)
    if x is None:
        return None
    if t is int or isinstance(x, np.integer):         # (bool is not: refused by the full check)
        return int
    if t is np.ndarray:
        return t, x.dtype, x.shape
    torch = sys.modules.get("torch")
    if torch is not None and t is torch.Tensor and not x.is_nested:
        return t, x.dtype, x.shape, x.device, x.layout
    return _UNKEYED


def _validate_kvcache(q: Any, k_cache: Any, v_cache: Any, cache_lengths: Any, block_table: Any, k_new: Any,
                      v_new: Any, backend: str, options: dict) -> KVCall:
    """:func:`validate_kvcache` in full."""
    options = dict(options)
    bad = sorted(n for n in options if n in BY_NAME and not BY_NAME[n].kvcache)
    if bad:
        raise TypeError(f"{', '.join(bad)}: not taken by attention_kvcache (the cache's lengths decide "
                        "which keys each sequence sees)")
    unknown = sorted(set(options) - set(NAMES))
    if unknown:
        raise TypeError(unexpected(unknown, tuple(n for n in NAMES if BY_NAME[n].kvcache),
                                   ("cache_lengths", "return_lse")))
    want_torch = is_torch(q)
    q = as_array("q", q, want_torch, required=True)
    if q.ndim != 4:
        raise ValueError(f"q: expected shape (B, H, L, D), got {tuple(q.shape)}")
    B, H, L, D = (int(n) for n in q.shape)
    if 0 in (B, H, L, D):
        raise ValueError(f"q: expected shape (B, H, L, D) with every size at least 1, got {tuple(q.shape)}")
    k_cache = as_array("k_cache", k_cache, want_torch, required=True)
    v_cache = as_array("v_cache", v_cache, want_torch, required=True)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.ndim != 4 or 0 in tuple(c.shape):
            raise ValueError(f"{name}: expected shape (B, Hkv, S_max, D) or (num_pages, Hkv, page_size, D), "
                             f"every size at least 1, got {tuple(c.shape)}")
        if dtype_name(c) != dtype_name(q):
            raise TypeError(f"{name}: dtype {dtype_name(c)} differs from q's dtype {dtype_name(q)}")
        if want_torch and c.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {c.device}")
    if dtype_name(q) not in FLOAT_DTYPES:
        raise TypeError(f"q: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(q)}")
    _check_grad(q, k_cache, v_cache, k_new, v_new, want_torch, options)
    N, Hkv, P, Dk = (int(n) for n in k_cache.shape)
    Dv = int(v_cache.shape[-1])
    if Dk != D:
        raise ValueError(f"k_cache: expected last dim D={D} (q's head dim), got shape {tuple(k_cache.shape)}")
    if tuple(v_cache.shape[:3]) != (N, Hkv, P):
        raise ValueError(f"v_cache: expected shape {(N, Hkv, P, 'Dv')} like k_cache, got {tuple(v_cache.shape)}")
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"k_cache: query heads H={H} must be a multiple of the cache's kv heads Hkv={Hkv}")
    lengths = _ints("cache_lengths", _one_per_sequence(cache_lengths, B, q, want_torch), want_torch, 1,
                    f"shape (B,) = ({B},)")
    if lengths.shape[0] != B:
        raise ValueError(f"cache_lengths: expected shape (B,) = ({B},), got {tuple(lengths.shape)}")
    if block_table is None:
        if N != B:
            raise ValueError(f"k_cache: a contiguous cache has one row per sequence: expected {B} (q's batch), "
                             f"got shape {tuple(k_cache.shape)}; pass block_table for a paged cache")
        capacity = P
    else:
        block_table = _ints("block_table", block_table, want_torch, 2, "shape (B, max_pages)")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table: expected {B} rows (q's batch), got shape {tuple(block_table.shape)}")
        capacity = int(block_table.shape[1]) * P
    q_lengths = options.pop("q_lengths", None)
    if q_lengths is not None:                            # (B,), checked as attention checks it
        q_lengths = check_lengths("q_lengths", _one_per_sequence(q_lengths, B, q, want_torch, "q_lengths"),
                                  want_torch, (B,), L, "L")
    L_new = 0
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{'v_new' if v_new is None else 'k_new'}: k_new and v_new come together")
    if k_new is not None:
        k_new = as_array("k_new", k_new, want_torch, required=True)
        v_new = as_array("v_new", v_new, want_torch, required=True)
        L_new = int(k_new.shape[-2]) if k_new.ndim == 4 else -1
        for name, x, d in (("k_new", k_new, D), ("v_new", v_new, Dv)):
            if tuple(x.shape) != (B, Hkv, L_new, d):
                want = f"({B}, {Hkv}, {L_new if L_new >= 0 else 'L_new'}, {d})"
                raise ValueError(f"{name}: expected shape (B, Hkv, L_new, D) = {want}, got {tuple(x.shape)}")
            if dtype_name(x) != dtype_name(q):
                raise TypeError(f"{name}: dtype {dtype_name(x)} differs from q's dtype {dtype_name(q)}")
            if want_torch and x.device != q.device:           # (before anything is written)
                raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {x.device}")
        if q_lengths is not None and L_new != L:
            raise ValueError(f"k_new: with q_lengths, sequence b appends the first q_lengths[b] of the new keys "
                             f"(one per query row): expected L_new = L = {L}, got shape {tuple(k_new.shape)}")
        _check_writable(k_cache, v_cache, L_new, want_torch)
    ragged = q_lengths is not None and L_new > 0         # appends of q_lengths[b] keys each
    new_lengths = q_lengths if ragged else None
    if want_torch and compiling():   # (values are unreadable while torch.compile traces: the op checks them)
        spec = validate(q, _zeros_view(q, (B, Hkv, capacity, D)), _zeros_view(q, (B, Hkv, capacity, Dv)),
                        backend=backend, kv_lengths=lengths.long() + (q_lengths.long() if ragged else L_new),
                        q_lengths=q_lengths, **options)
        return KVCall(spec=spec, k_cache=k_cache, v_cache=v_cache, cache_lengths=lengths, lengths=None,
                      block_table=block_table, page_size=P, k_new=k_new, v_new=v_new, new_lengths=new_lengths)
    added = host_ints("q_lengths", q_lengths).astype(np.int64) if ragged else L_new
    total, shared = _check_values(lengths, added, capacity, block_table, N, P)
    dummy_k = _zeros_view(q, (B, Hkv, max(capacity, 1), D))
    dummy_v = _zeros_view(q, (B, Hkv, max(capacity, 1), Dv))
    total_arr = total if not want_torch else _torch_ints(total, q)
    spec = validate(q, dummy_k, dummy_v, backend=backend, kv_lengths=total_arr, q_lengths=q_lengths, **options)
    if shared is not None:
        _check_writes(spec, *shared, total, P)
    return KVCall(spec=spec, k_cache=k_cache, v_cache=v_cache, cache_lengths=lengths, lengths=total_arr,
                  block_table=block_table, page_size=P, k_new=k_new, v_new=v_new, new_lengths=new_lengths)


def _check_grad(q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any, want_torch: bool,
                options: dict) -> None:
    """No tensor that requires grad while grad is enabled (forward only): sinks and
    slopes too (attention gives the sinks' gradient; a model's learned sinks run under
    torch.no_grad())."""
    if want_torch:
        import torch
        grad = [n for n, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                               ("v_new", v_new)) if getattr(x, "requires_grad", False)]
        grad += [n for n in _READ_ARRAYS if options.get(n) is not None and is_torch(options[n])
                 and options[n].requires_grad]           # (an array of another library: named later)
        if grad and torch.is_grad_enabled():
            raise TypeError(f"{', '.join(grad)}: attention_kvcache is forward only (no autograd); call it "
                            "under torch.no_grad() or pass tensors that do not require grad")


def _check_writable(k_cache: Any, v_cache: Any, L_new: int, want_torch: bool) -> None:
    """Caches that an append (L_new > 0) can write: their own memory, writeable."""
    torch = sys.modules.get("torch") if want_torch else None
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)) if L_new > 0 else ():
        strides = c.stride() if want_torch else c.strides
        if any(st == 0 and n > 1 for st, n in zip(strides, c.shape)):   # torch would write every slot
            raise ValueError(f"{name}: a broadcast (expanded) cache keeps several slots in one place and "
                             f"cannot take k_new / v_new (strides {tuple(strides)}); pass a cache with its "
                             "own memory")
        writable = (compiling() or c.is_inference() <= torch.is_inference_mode_enabled()   # (traced:
                    if torch is not None else c.flags.writeable)                        # the op checks)
        if not writable:
            raise ValueError(f"{name}: the cache is read-only here (a NumPy array that is not writeable, "
                             "or an inference tensor outside inference mode) and cannot take k_new / v_new")


def _check_values(lengths: Any, added: Any, capacity: int, block_table: Any, N: int,
                  P: int) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray, np.ndarray] | None]:
    """The lengths after the append, int64 (B,) on the host: each non-negative and within
    the sequence's capacity, and the block-table entries of the pages they use in
    [0, num_pages N) (pages of P keys). Then None, or (table, used entries, lengths
    before the append) where a paged append writes into a page that another used entry
    holds too, for :func:`_check_writes` once the call's geometry is known."""
    raw = host_ints("cache_lengths", lengths)
    if raw.size and raw.min() < 0:
        raise ValueError(f"cache_lengths: expected non-negative lengths, got {raw.tolist()[:16]}")
    # held to capacity + 1 before the sum (which lengths near the integer limit would wrap
    # past the check) and the cast (uint64 past int64's); the messages quote raw's values
    h_len = _at_most(raw, capacity + 1)
    total = h_len + added
    if total.size and total.max() > capacity:
        b = int(np.flatnonzero(total > capacity)[0])
        held, new = int(raw[b]), int(total[b] - h_len[b])
        what = "the append overflows" if new > 0 and held <= capacity else "beyond"
        raise ValueError(f"cache_lengths: sequence {b} holds {held} keys + {new} new = {held + new}, {what} its "
                         f"capacity of {capacity} keys")
    if block_table is not None:
        raw_bt = host_ints("block_table", block_table)
        bt = _at_most(raw_bt, N)
        used = used_entries(total, bt.shape[1], P, np.arange)        # the pages each sequence touches
        outside = used & ((bt < 0) | (bt >= N))
        if outside.any():
            b = int(np.flatnonzero(outside.any(axis=1))[0])
            pages = raw_bt[b][used[b]]
            page = int(pages.max() if pages.max() >= N else pages.min())
            raise ValueError(f"block_table: sequence {b} points at page {page} outside [0, num_pages={N})")
        new = total - h_len
        if new.max(initial=0) > 0 and not _writes_alone(bt, used, h_len, new, P):
            return total, (bt, used, h_len)
    return total, None


def _at_most(x: np.ndarray, cap: int) -> np.ndarray:
    """x as int64 with its values above ``cap`` (≥ 0) made ``cap``: an integer array of
    any dtype, uint64 past int64's range included."""
    if x.dtype == np.uint64:
        x = np.minimum(x, np.uint64(cap))
    return np.minimum(x.astype(np.int64), cap)


def _writes_alone(bt: np.ndarray, used: np.ndarray, h_len: np.ndarray, new: np.ndarray, P: int) -> bool:
    """Whether every page a paged append writes into is held by its writer's entry
    alone among the used entries (``used``, (B, max_pages): those the sequences' keys
    after the append span): no page held twice (one sort), else each page written to
    held once (two searches). Cheaper than the one-writer check it replaced (3–9 µs
    against 7.7–9.2, docs/decisions.md)."""
    held = np.sort(bt[used])
    if not (held[1:] == held[:-1]).any():
        return True
    written = bt[used & (np.arange(bt.shape[1]) >= (h_len // P)[:, None]) & (new > 0)[:, None]]
    return bool((np.searchsorted(held, written, "right") - np.searchsorted(held, written, "left") == 1).all())


def _check_writes(spec: Spec, bt: np.ndarray, used: np.ndarray, h_len: np.ndarray, total: np.ndarray,
                  P: int) -> None:
    """No new key of a paged append in a slot that another used entry of the table
    holds in view: sequences sharing a page (a common prefix, a forked beam) whose
    append lands in a slot the other sees — as its own new key (two writers: one key
    would overwrite the other) or as an old key (it would read the other's key in place
    of its own) — or a row listing a page twice while its older keys there are still in
    view. A sequence's view is the keys [lo, total) from the lowest key its rows see
    (``spec``'s window and kv_starts; padding rows' bounds too) to its length after the
    append: keys below it are out of every later row's view as well, so a ring of
    pages under a window, or a shared padding page under kv_starts, takes new keys.
    Only for calls :func:`_writes_alone` could not clear: linear in the new keys and
    the entries that hold their pages."""
    view = spec.replace(kv_lengths=total, q_lengths=None if spec.q_lengths is None else host_ints(
        "q_lengths", spec.q_lengths), kv_starts=None if spec.kv_starts is None else host_ints(
        "kv_starts", spec.kv_starts))
    lo = np.broadcast_to(dense_row_bounds(view)[0], spec.batch + (1, spec.L)).reshape(len(total), -1).min(axis=1)
    new = total - h_len
    m = int(new.max())
    seq, pos, taken = new_key_places(h_len, m, new, None, P, np.arange)
    page, slot, _ = new_key_places(h_len, m, new, bt, P, np.arange)
    b, entry, page, slot = seq[taken], pos[taken] // P, page[taken], slot[taken]   # per new key
    hb, hj = np.nonzero(used)
    order = np.argsort(bt[hb, hj], kind="stable")        # the used entries by page
    hb, hj = hb[order], hj[order]
    first = np.searchsorted(bt[hb, hj], page, "left")
    count = np.searchsorted(bt[hb, hj], page, "right") - first
    w = np.repeat(np.arange(b.size), count)              # (new key, entry holding its page) pairs
    e = np.repeat(first - np.cumsum(count) + count, count) + np.arange(w.size)
    c, at = hb[e], hj[e] * P + slot[w]                   # the other entry's sequence and key there
    bad = ~((c == b[w]) & (hj[e] == entry[w])) & (at >= lo[c]) & (at < total[c])
    if not bad.any():
        return
    k = int(np.flatnonzero(bad)[0])
    i, c_, key = int(w[k]), int(c[k]), int(at[k])
    b_, at_slot, pg = int(b[i]), int(slot[i]), int(page[i])
    where = f"slot {at_slot} of page {pg}"
    if c_ == b_:
        raise ValueError(f"block_table: sequence {b_} appends into {where}, which its row also lists for its key "
                         f"{key}, still in view: a row lists a page again only once the keys it holds there are "
                         "out of view (under a window or kv_starts)")
    what = (f"sequence {b_} appends into {where}, which sequence {c_} holds as its key {key}" if key < h_len[c_]
            else f"sequences {min(b_, c_)} and {max(b_, c_)} append into the same slot ({at_slot} of page {pg})")
    raise ValueError(f"block_table: {what}: a page sequences share takes no new keys (copy it to a page of its own "
                     "first; padding rows append nothing with q_lengths 0)")


def used_entries(lengths: Any, width: int, P: int, arange: Any) -> Any:
    """Boolean (B, width): the block-table entries that sequences of ``lengths`` keys
    span in pages of P keys (entries past them are never followed and may hold
    anything). ``lengths`` is an int array of one library, ``arange(n)`` its."""
    return arange(width).reshape(1, -1) < (lengths.reshape(-1, 1) + P - 1) // P


def new_key_places(lengths: Any, L_new: int, new_lengths: Any, table: Any, P: int,
                   arange: Any) -> tuple[Any, Any, Any]:
    """(row index, slot index, taken) of an append's new keys: int64 arrays (B, L_new)
    indexing the cache's first and third axes (a contiguous cache's row b, or a paged
    one's page ``table[b, p // P]``; P its page size), and None (all L_new keys of every
    sequence are written) or a boolean (B, L_new) of the keys written (the first
    new_lengths[b]; the others' positions are 0, inside the first page). ``lengths``,
    ``new_lengths`` and ``table`` are int64 arrays of one library, ``arange(n)`` its."""
    t = arange(L_new).reshape(1, -1)
    pos = lengths.reshape(-1, 1) + t                     # (B, L_new)
    taken = None if new_lengths is None else t < new_lengths.reshape(-1, 1)
    if taken is not None:
        pos = pos * taken
    b = arange(pos.shape[0]).reshape(-1, 1)
    rows, slots = (b + 0 * pos, pos) if table is None else (table[b, pos // P], pos % P)
    return rows, slots, taken


def _zeros_view(like: Any, shape: tuple[int, ...]) -> Any:
    """A zero-strided stand-in of ``shape`` (no memory): the attention's key axis for
    shape checks; the rungs read the keys from the cache."""
    if is_torch(like):
        return like.new_zeros(()).expand(shape)
    return np.broadcast_to(np.zeros((), dtype=like.dtype), shape)


def _torch_ints(x: np.ndarray, like: Any) -> Any:
    import torch
    if like.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(x, dtype=np.int64))
    return torch.as_tensor(x, dtype=torch.int64, device=like.device)
