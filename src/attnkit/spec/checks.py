"""Checks of the arrays a caller hands back (saved out and lse, dout, rows, merge's
blocks) and of the ring's shards: the same rule as :mod:`attnkit.spec.validate`,
for the functions that take more than q, k, v and masks."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np

from .core import Spec, dtype_name, is_torch
from .geometry import combine
from .validate import FLOAT_DTYPES, as_array, check_cu_seqlens, check_sequence_lengths, choice, dtype_kind


def _same_library(name: str, x: Any, like: Any, like_name: str = "q") -> None:
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    if is_torch(x) != is_torch(like) or not hasattr(x, "shape"):
        want = "a torch.Tensor" if is_torch(like) else "a NumPy array"
        raise TypeError(f"{name}: expected {want} like {like_name}, got {type(x).__name__}")
    if is_torch(x) and x.device != like.device:
        raise ValueError(f"{name}: expected a tensor on {like_name}'s device {like.device}, got {x.device}")


def check_flags(**flags: Any) -> None:
    """return_lse=, return_weights=: True or False (a string such as "False" is
    truthy, and would change what the call returns)."""
    for name, x in flags.items():
        if not isinstance(x, (bool, np.bool_)):
            raise TypeError(f"{name}: expected True or False, got {x!r}")


def check_like(name: str, x: Any, shape: tuple[int, ...], dtype: str | None = None) -> None:
    """x must have exactly this shape (and dtype)."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(x.shape)}")
    if dtype is not None and dtype_name(x) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {dtype_name(x)}")


def check_lse(spec: Spec, lse: Any, shape: tuple[int, ...]) -> None:
    """A saved lse: same array library as q, a float dtype, exactly ``shape``."""
    _same_library("lse", lse, spec.q)
    if dtype_name(lse) not in FLOAT_DTYPES:
        raise TypeError(f"lse: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(lse)}")
    check_like("lse", lse, shape)


def check_grad_inputs(spec: Spec, dout: Any, out: Any, lse: Any) -> None:
    """attention_backward's dout, out (q's dtype, out's user shape) and lse."""
    for name, x in (("dout", dout), ("out", out)):
        _same_library(name, x, spec.q)
        check_like(name, x, spec.user_out_shape, spec.dtype)
    check_lse(spec, lse, spec.user_lse_shape)


def _python_ints(rows: Any) -> bool:
    """An int or a list/tuple of ints, bools excluded."""
    vals = [rows] if isinstance(rows, int) else rows if isinstance(rows, (list, tuple)) else None
    return vals is not None and all(isinstance(r, int) and not isinstance(r, bool) for r in vals)


def check_rows(spec: Spec, rows: Any) -> Any:
    """``rows`` for attention_weights: an int or 1-D ints in [-L, L) -> a NumPy int64
    array of non-negative row indices (for torch inputs, Python ints given as such stay
    a list of Python ints: torch.compile keeps them constants)."""
    constant = spec.torch and _python_ints(rows)
    if constant:
        vals: list[int] = [rows] if isinstance(rows, int) else list(rows)
    else:
        r = np.asarray(rows.detach().cpu() if is_torch(rows) else as_array("rows", rows, False, required=True))
        if r.ndim > 1 or (r.size and r.dtype.kind not in "iu"):
            raise TypeError(f"rows: expected an int or a 1-D sequence of ints, got {r.dtype} of shape {r.shape}")
        vals = np.atleast_1d(r).tolist()                 # Python ints: no wrap-around in the bounds check
    if vals and (min(vals) < -spec.L or max(vals) >= spec.L):
        raise ValueError(f"rows: expected indices in [-{spec.L}, {spec.L}) (L={spec.L}), got {vals[:16]}")
    return [v % spec.L for v in vals] if constant else np.asarray(vals, dtype=np.int64) % spec.L


def check_merge(outs: Any, lses: Any) -> tuple[list[Any], list[Any]]:
    """merge's blocks: equal non-zero numbers of arrays of one library, float dtypes,
    out blocks (..., Dv) and lse blocks (...) with matching shapes."""
    blocks = []
    for name, xs in (("outs", outs), ("lses", lses)):
        if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable) or hasattr(xs, "shape"):
            raise TypeError(f"{name}: expected a list of arrays (one per key block), got {type(xs).__name__}")
        blocks.append([np.asarray(x) if isinstance(x, np.generic) else x for x in xs])   # NumPy scalars
    outs, lses = blocks
    if not outs or len(outs) != len(lses):
        raise ValueError(f"merge: expected equal, non-zero numbers of outs and lses, got {len(outs)} and {len(lses)}")
    first = outs[0]
    if not hasattr(first, "shape") or getattr(first, "ndim", 0) < 1:
        raise TypeError(f"outs[0]: expected an array of shape (..., Dv), got {type(first).__name__}"
                        + (f" of shape {tuple(first.shape)}" if hasattr(first, "shape") else ""))
    for i, (o, lse) in enumerate(zip(outs, lses)):
        _same_library(f"outs[{i}]", o, first, "outs[0]")
        _same_library(f"lses[{i}]", lse, first, "outs[0]")
        for name, x, shape, like in ((f"outs[{i}]", o, tuple(first.shape), first),
                                     (f"lses[{i}]", lse, tuple(first.shape)[:-1], lses[0])):
            if dtype_kind(x) != "f":
                raise TypeError(f"{name}: expected a float dtype {FLOAT_DTYPES}, got {dtype_name(x)}")
            check_like(name, x, shape, dtype_name(like))
    return outs, lses


# ---- ring attention (attnkit.distributed) -----------------------------------------------
RING_LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: Any) -> str:
    return choice("layout", layout, RING_LAYOUTS)


def check_world(rank: Any, world: Any) -> None:
    if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
        raise ValueError(f"rank, world: expected 0 <= rank < world, got rank={rank!r}, world={world!r}")


def check_group(group: Any) -> None:
    """ring_attention's ``group``: None (the default group) or a ProcessGroup."""
    if group is None:
        return
    import torch.distributed as dist
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected None (the default group) or a torch.distributed.ProcessGroup, "
                        f"got {group!r}")


def check_ring_shard(spec: Spec, keep: Any, drop: Any, layout: str) -> Any:
    """One rank's validated shard for ring attention: key-padding masks only (the
    query side is the rank's own), even shard lengths for the zigzag layout. Returns
    the key-padding keep mask (keep and drop combined), or None."""
    check_layout(layout)
    for name, given in (("bias", spec.bias is not None), ("q_lengths", spec.q_lengths is not None),
                        ("kv_starts", spec.kv_starts is not None), ("cu_seqlens_q", spec.packed)):
        if given:
            raise ValueError(f"{name}: not supported by ring_attention (key padding goes in keep/drop or "
                             "kv_lengths)")
    for name, m in (("keep", keep), ("drop", drop)):
        if m is not None and (m.shape[-1] != spec.S or (m.ndim >= 2 and m.shape[-2] != 1)):
            raise ValueError(f"{name}: ring_attention takes key-padding masks of shape "
                             f"(..., 1 or H, 1, S_shard={spec.S}) sharded like k, got {tuple(m.shape)}")
    if layout == "zigzag":
        for name, n in (("q", spec.L), ("k", spec.S)):
            if n % 2:
                raise ValueError(f"{name}: layout='zigzag' needs an even shard length along dim -2 "
                                 f"(two chunks per rank), got {n}")
    ex = combine(None, keep, drop)
    return None if ex is None else ~ex


# ---- attnkit.torch.MultiheadAttention ------------------------------------------------------
def check_mha_config(embed_dim: Any, num_heads: Any, num_kv_heads: Any, dropout: Any, kdim: Any = None,
                     vdim: Any = None, dtype: Any = None) -> None:
    """MultiheadAttention's constructor arguments."""
    for name, x in (("embed_dim", embed_dim), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                    ("kdim", kdim), ("vdim", vdim)):
        if (x is not None or name not in ("kdim", "vdim")) and (isinstance(x, bool) or not isinstance(x, int)
                                                               or x < 1):
            raise ValueError(f"{name}: expected a positive int, got {x!r}")
    if dtype is not None and not getattr(dtype, "is_floating_point", False):
        raise TypeError(f"dtype: expected a floating-point torch dtype for the parameters, got {dtype!r}")
    if embed_dim % num_heads:
        raise ValueError(f"embed_dim: must be divisible by num_heads={num_heads}, got {embed_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: must divide num_heads={num_heads}, got {num_kv_heads}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout: expected 0 <= dropout < 1, got {dropout!r}")


def check_mha_inputs(query: Any, key: Any, value: Any, dims: tuple[int, int, int], num_heads: int,
                     key_padding_mask: Any, attn_mask: Any, params: Any) -> None:
    """MultiheadAttention.forward's inputs, batch-first (B, L, E) / (B, S, kdim) /
    (B, S, vdim) after the layout change (torch tensors: the caller checks), of the
    dtype and device of the input projection's weight ``params``; errors name the
    module's own arguments."""
    for name, x, d, last in (("query", query, dims[0], "embed_dim"), ("key", key, dims[1], "kdim"),
                             ("value", value, dims[2], "vdim")):
        if x.device != params.device:
            raise ValueError(f"{name}: expected a tensor on the module's device {params.device}, got {x.device}")
        if x.dtype != params.dtype and not sys.modules["torch"].is_autocast_enabled(x.device.type):
            raise TypeError(f"{name}: expected the module's dtype {dtype_name(params)} (or autocast), got "
                            f"{dtype_name(x)}; move one with .to()")
        if x.dim() != 3 or x.shape[-1] != d:
            raise ValueError(f"{name}: expected shape (B, L, {last}={d}) (or unbatched (L, {d})), got {tuple(x.shape)}")
    B, L, S = query.shape[0], query.shape[1], key.shape[1]
    if key.shape[:2] != value.shape[:2]:
        raise ValueError(f"value: expected {tuple(key.shape[:2])} in its first dims like key, got {tuple(value.shape)}")
    if key.shape[0] != B:
        raise ValueError(f"key: expected batch size {B} like query, got {tuple(key.shape)}")
    for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if m is not None:
            _same_library(name, m, query, "query")
    if key_padding_mask is not None:
        kind = dtype_kind(key_padding_mask)
        if kind not in "bf":
            raise TypeError(f"key_padding_mask: expected bool (True = ignore) or float (added), got "
                            f"{dtype_name(key_padding_mask)}")
        if tuple(key_padding_mask.shape) != (B, S):
            raise ValueError(f"key_padding_mask: expected shape (B, S) = {(B, S)}, got {tuple(key_padding_mask.shape)}")
    if attn_mask is not None:
        if dtype_kind(attn_mask) not in "bf":
            raise TypeError(f"attn_mask: expected bool (True = not allowed) or float (added), "
                            f"got {dtype_name(attn_mask)}")
        ok = tuple(attn_mask.shape) in ((L, S), (B * num_heads, L, S))
        if not ok:
            raise ValueError(f"attn_mask: expected shape (L, S) = {(L, S)} or (B·num_heads, L, S) = "
                             f"{(B * num_heads, L, S)}, got {tuple(attn_mask.shape)}")


def check_sequence_values(spec: Spec) -> None:
    """The lengths', starts' and offsets' values of a Spec made without reading them
    (the torch op's, for a call torch.compile traced), by validate's own checks, against
    the whole problem's sizes (a block of ring attention: its extent)."""
    L, S = spec.extent if spec.extent is not None else (spec.L, spec.S)
    opt = {n: getattr(spec, n) for n in ("q_lengths", "kv_lengths", "kv_starts", "cu_seqlens_q", "cu_seqlens_k")}
    want_torch = not isinstance(spec.q, np.ndarray)
    check_sequence_lengths(opt, want_torch, spec.batch, L, S, {})
    check_cu_seqlens(opt, want_torch, spec.batch, spec.H, L, S, {})
