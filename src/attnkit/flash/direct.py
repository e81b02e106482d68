"""The flash rung's kept call: a call that repeats a signature (every layer of a model
repeats its shapes and lengths) runs the compiled tile loop on the plan and packed
arguments made for the first, with none of the per-call planning, checks and packing
(about 200 µs of a 1.7 ms BERT layer alone, and more inside a model, whose other ops
leave the interpreter's caches cold: 450–600 µs there).

:func:`direct_at` makes the call for addresses and strides (the torch op's
``TorchRung.direct``), :func:`direct` for NumPy arrays; :func:`attnkit.api.attention`
keeps them under the call's signature. Either runs a call only where the full path
would run it the same way: the compiled loop on every task (float32, no mask arrays,
bias, softcap, ALiBi, dropout or sinks), no key split, every query row written, and the
operands readable in place; the same plan and tasks give the same bits.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..spec import Spec
from ..spec.validate import GEOMETRY
from . import blas, forward, kernels, plan
from .numba_loop import AT_COUNTER, AT_INNER, AT_K, AT_LSE, AT_M0, AT_OUT, AT_Q, AT_STATUS, AT_V
from .plan import MIN_SPLIT, Call

# the slots a call rewrites in the packed block (numba_loop.pack; an array's slots are
# its address, sizes, strides and extent): q's, k's, v's, out's and lse's, one run of
# slots from AT_Q to the end of lse's; the counter's and the status' addresses; whether
# out has its heads inner
_RUN = slice(AT_Q, AT_M0)
assert (AT_K, AT_V, AT_OUT, AT_LSE, AT_M0) == (AT_Q + 10, AT_Q + 20, AT_Q + 30, AT_Q + 40, AT_Q + 48)


def _settings() -> tuple[Any, ...]:
    """What the plan and the loop read besides the call (replace them to change them)."""
    return (kernels.USE_COMPILED, kernels.USE_LOOP, plan.block_sizes, plan.SUB_M, plan.LOOP_SUB_M, plan.DECODE_ROWS,
            plan.SMALL_TILE, plan.MIN_TASKS, plan.MIN_SPLIT, forward.BUDGET, forward.NATIVE_WORK,
            blas.small_product_limit())


def _as_numpy(spec: Spec) -> Spec:
    """spec with its operands and lengths as NumPy arrays (views of CPU tensors)."""
    return spec.replace(**{n: np.asarray(getattr(spec, n)) for n in ("q", "k", "v", *GEOMETRY)
                           if getattr(spec, n) is not None})


def _operand(address: int, strides: tuple[int, ...], shape: tuple[int, ...]) -> list[int] | None:
    """An operand's slots (address, sizes, strides, extent) as (N, A, B, C) (a 3-D one
    with N = 1), or None where BLAS cannot read its rows in place (plan.tile_ready
    would copy it) or a stride is negative."""
    if len(strides) == 3:
        strides = (0, *strides)
    if strides[3] != 1 or (shape[2] > 1 and strides[2] < shape[3]) or min(strides) < 0:
        return None
    return [address, *shape, *strides, 1 + sum((n - 1) * s for n, s in zip(shape, strides))]


def _out_slots(shape: tuple[int, ...], inner: bool) -> tuple[int, ...]:
    """out's sizes, strides and extent as the loop writes it: (N, H, L, Dv) C-ordered,
    or heads inner: (N, L, H, Dv) C-ordered (numba_loop.Tasks.pack)."""
    if inner:
        shape = (shape[0], shape[2], shape[1], shape[3])
    return (*shape, shape[1] * shape[2] * shape[3], shape[2] * shape[3], shape[3], 1, int(np.prod(shape)))


def direct_at(spec: Spec) -> Callable[..., bool] | None:
    """For calls that repeat spec's signature: ``call(q, q_strides, k, k_strides, v,
    v_strides, S, out, out_strides, lse) -> bool`` with addresses of float32 memory
    and strides in elements (q, k, v of spec's shapes; out of its out shape, C-ordered
    or with its heads inner; lse its lse shape, C-ordered, or 0), as
    :func:`attnkit.small.direct_at`. False where the call takes the full path: another
    key length or settings (:func:`_settings`), operands or an out it cannot take, or a
    tile whose product is not finite (the full path's Python loop takes those); out may
    then be partly written. None unless spec's forward runs whole on the compiled loop
    as described above (3-D or 4-D operands)."""
    if spec.dtype != "float32" or spec.v is None or len(spec.batch) > 1 or spec.sinks is not None:
        return None
    try:
        spec = _as_numpy(spec)
    except (RuntimeError, TypeError):                    # a tensor NumPy cannot view (a negative bit)
        return None
    call = Call(spec, None, None)
    if call.flat is None:
        return None
    blocks, tasks, covered, streams = call.kept_for_units(("forward", MIN_SPLIT), lambda: forward._plan(call))
    if not tasks or not covered or any(streams) or any(t[2] > 1 for t in tasks):
        return None
    table, tiles, lo, hi, _ = call.task_table(blocks, tasks)
    (q4, _), (k4, _), (v4, _) = call.flat
    N, H, L, Dv = int(np.prod(spec.batch, dtype=np.int64)), spec.H, spec.L, spec.Dv
    loop, work, n_tasks, stamp, S0 = call.kern.tile_tasks, forward._work(table, tiles), len(table), _settings(), spec.S
    hold = not loop.one_thread(tiles, spec.D, Dv)
    none = forward._NO_STATE
    scratch = np.empty((N, H, L), np.float32)           # lse where the caller wants none: written, never read
    packed = loop.pack(q4, call.qs, k4, v4, table, tiles, lo, hi, np.zeros(1, np.int64), np.zeros(n_tasks, np.int8),
                       none, none, np.empty((N, H, L, Dv), np.float32), scratch, np.empty(0, np.float32),
                       np.empty(0, np.float32), np.empty((0, Dv), np.float32), forward.BUDGET)
    template, lse_slots = array.array("q", packed.tobytes()), [int(x) for x in packed[AT_LSE + 1:AT_M0]]
    shapes = [x.shape for x in (q4, k4, v4)]
    # out's strides (as (N, H, L, Dv)) → its slots and whether its heads are inner
    layouts: dict[tuple[int, ...], tuple[list[int], int]] = {
        (H * L * Dv, L * Dv, Dv, 1): (list(_out_slots((N, H, L, Dv), False)), 0),
        (H * L * Dv, Dv, H * Dv, 1): (list(_out_slots((N, H, L, Dv), True)), 1)}
    status_bytes = 8 * (1 + (n_tasks + 7) // 8)          # the counter, then a byte per task
    arrays, scratch_at = (table, tiles, lo, hi, scratch), scratch.ctypes.data

    def run(q: int, q_strides: tuple[int, ...], k: int, k_strides: tuple[int, ...], v: int,
            v_strides: tuple[int, ...], S: int, out: int, out_strides: tuple[int, ...], lse: int,
            alive: tuple[Any, ...] = arrays) -> bool:           # (the block points into them)
        if S != S0 or _settings() != stamp:
            return False
        values: list[int] = []
        for address, strides, shape in zip((q, k, v), (q_strides, k_strides, v_strides), shapes):
            slots = _operand(address, tuple(strides), shape)
            if slots is None:
                return False
            values += slots
        layout = layouts.get((H * L * Dv, *out_strides) if len(out_strides) == 3 else tuple(out_strides))
        if layout is None:
            return False
        state = array.array("q", bytes(status_bytes))    # zeros: the task counter, each task's status
        at = state.buffer_info()[0]
        block = array.array("q", template)
        block[_RUN] = array.array("q", values + [out] + layout[0] + [lse or scratch_at] + lse_slots)
        block[AT_COUNTER], block[AT_STATUS], block[AT_INNER] = at, at + 8, layout[1]
        forward._run_block(loop, block, work, n_tasks, hold)
        return state.tobytes().find(b"\0", 8, 8 + n_tasks) < 0
    return run


def direct(spec: Spec) -> Callable[[Any, Any, Any, bool], tuple[np.ndarray, np.ndarray] | None] | None:
    """:func:`direct_at` for NumPy arrays: ``call(q, k, v, need_lse) -> (out, lse)``
    (q, k, v of spec's signature, not checked; out C-ordered, as the full path gives a
    NumPy caller), or None where the call takes the full path."""
    if spec.torch:
        return None
    at = direct_at(spec)
    if at is None:
        return None
    new = functools.partial(np.empty, dtype=np.float32)
    out_shape, lse_shape = spec.out_shape, spec.lse_shape

    def items(x: np.ndarray) -> tuple[int, ...] | None:
        st = x.strides
        return None if any(s % 4 for s in st) else tuple(s // 4 for s in st)

    def call(q: Any, k: Any, v: Any, need_lse: bool) -> tuple[np.ndarray, np.ndarray] | None:
        qs, ks, vs = items(q), items(k), items(v)
        if qs is None or ks is None or vs is None:
            return None
        out, lse = new(out_shape), new(lse_shape)
        ok = at(q.ctypes.data, qs, k.ctypes.data, ks, v.ctypes.data, vs, k.shape[-2], out.ctypes.data,
                items(out), lse.ctypes.data)
        return (out, lse) if ok else None
    return call

