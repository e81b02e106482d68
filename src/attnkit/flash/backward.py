"""The flash rung's backward pass: p = exp(s − lse) recomputed tile by tile from the
saved lse (FlashAttention-2 order: key blocks outside, query blocks inside), so it
also serves a block of keys of a longer sequence (ring attention, split-KV)::

    delta = rowsum(dout ∘ out) − dlse                    the softmax Jacobian term
    for each task (units, chunk of key blocks):
        for each key block: for each row block that sees it:
            p = exp(s − lse);  pz = dropout(p)
            dv += pzᵀ dout;  dp = dropout(dout vᵀ);  ds = p ∘ (dp − delta)
            dk += dsᵀ q;  dq[chunk] += ds k
    dq = Σ_chunk dq[chunk]                                 in a fixed order

Extra memory is O((L + S)·D) per head (times the key chunks for dq) plus a few tiles
per worker. Calls whose scores have nothing between the two products (float32, no
mask arrays, bias, softcap, ALiBi or dropout) run their tasks compiled
(:mod:`.numba_backward`); a task whose operands hold NaN or inf comes back to the
Python loop here.
"""

from __future__ import annotations

import math
from math import prod
from typing import Any

import numpy as np

from ..backends import Grads
from ..nonfinite import all_finite, exempt_matmul
from ..reference import sink_gradient
from ..spec import broadcast_to
from . import runtime
from .forward import cast
from .plan import MIN_TASKS, Call, Unit, flat_own, tile_ready


def _bias_shape(call: Call) -> tuple[int, ...] | None:
    """bias's shape left-padded with 1s to the score rank, or None without bias."""
    spec = call.spec
    if spec.bias is None:
        return None
    bs = tuple(spec.shapes["bias"])
    return (1,) * (len(spec.score_shape) - len(bs)) + bs


def _bias_slot(shape: tuple[int, ...], u: Unit) -> tuple[int, ...]:
    """Index of the (L, S) slice of the padded dbias that unit u (one head) adds into."""
    return tuple(0 if n == 1 else i for i, n in zip(u.b + (u.h0,), shape[:-2]))


def _groups(call: Call, shape: tuple[int, ...] | None) -> list[list[Unit]]:
    """Units grouped by the dbias slice they add into (one unit per group otherwise)."""
    if shape is None:
        return [[u] for u in call.units]
    groups: dict[tuple[int, ...], list[Unit]] = {}
    for u in call.units:
        groups.setdefault(_bias_slot(shape, u), []).append(u)
    return list(groups.values())


def _add_dbias(dbias: np.ndarray, shape: tuple[int, ...], ds: np.ndarray, u: Unit,
               r0: int, r1: int, c0: int, c1: int) -> None:
    """dbias[slot] += ds (one head's tile), summed over the rows / keys along which
    bias was broadcast."""
    ds = ds.reshape(r1 - r0, c1 - c0)
    if shape[-2] == 1:
        ds, r0, r1 = ds.sum(axis=0, keepdims=True), 0, 1
    if shape[-1] == 1:
        ds, c0, c1 = ds.sum(axis=1, keepdims=True), 0, 1
    dbias[_bias_slot(shape, u)][r0:r1, c0:c1] += ds


def _rows3(call: Call, arr: Any, u: Unit, r0: int, r1: int) -> np.ndarray:
    """(nk, g·rows, X) rows of a (..., H, L, X) array for the unit's heads."""
    x = arr[u.b][u.heads, r0:r1]
    return np.ascontiguousarray(x).reshape(u.nk, u.g * (r1 - r0), x.shape[-1])


def _norm(x: np.ndarray) -> float:
    """‖x‖ (Frobenius; inf or NaN when x holds a NaN or inf, or its squares overflow):
    |a_i · b_j| ≤ ‖a‖ ‖b‖ for any rows a_i of a and b_j of b (Cauchy–Schwarz)."""
    with np.errstate(all="ignore"):
        return math.sqrt(float(np.vdot(x, x)))


def backward(call: Call, dout: Any, out: Any, lse: Any, dlse: Any = None, need_dbias: bool = True) -> Grads:
    spec, acc = call.spec, call.acc
    dout = broadcast_to(tile_ready(dout, acc), spec.out_shape)
    lse = np.asarray(lse, dtype=acc)
    out = broadcast_to(np.asarray(out, dtype=acc), spec.out_shape)
    bias_shape = _bias_shape(call) if need_dbias else None
    groups = _groups(call, bias_shape)
    BN = call.BLOCK_N
    kblocks = {id(u): [(c, min(c + BN, u.seg.k1)) for c in range(u.seg.k0, u.seg.k1, BN)] for u in call.units}
    n_chunks = 1 if (bias_shape is not None and bias_shape[-1] == 1) else \
        max(1, min(max((len(b) for b in kblocks.values()), default=1), -(-MIN_TASKS // max(len(groups), 1))))
    compiled = call.flat is not None and bias_shape is None
    # where the compiled tasks write every element (_covered; a task that stops zeroes
    # what it wrote before the Python loop adds into it), no zero fill: it took 1.6 ms
    # of a BERT batch's 22 before the tasks began
    alloc = np.empty if compiled and _covered(call, kblocks, n_chunks) else np.zeros
    dq = alloc((n_chunks,) + spec.batch + (spec.H, spec.L, spec.D), dtype=acc)
    dk = alloc(spec.batch + (spec.H, spec.S, spec.D), dtype=acc)     # per query head, folded below
    dv = alloc(spec.batch + (spec.H, spec.S, spec.Dv), dtype=acc)
    dbias = None if bias_shape is None else np.zeros(bias_shape, dtype=acc)
    kern = call.kern
    # dp − delta cannot overflow where ‖dout rows‖ · ‖v rows‖ (times dropout's scale)
    # and |delta| stay below a quarter of the largest float: then ds is not checked
    big = float(np.finfo(acc).max) / 4
    drop_scale = call.drop_scale if call.drop_thr else 1.0
    todo = [(gi, c) for gi in range(len(groups)) for c in range(n_chunks)]
    if compiled:
        todo = _compiled(call, groups, todo, [kblocks[id(u)] for u in call.units], n_chunks,
                         dout, out, lse, dlse, dq, dk, dv)
    delta = None
    if todo or spec.sinks is not None:
        delta = np.einsum("...d,...d->...", dout, out)  # Σ_j w·dw, O(L) per head
        if dlse is not None:                             # a gradient for lse: d lse / d scores = w
            delta = delta - np.asarray(dlse, dtype=acc)

    def unit_chunk(u: Unit, chunk: int) -> None:
        blocks = kblocks[id(u)]
        n = min(len(blocks), n_chunks)
        if chunk >= n:
            return
        nk, g = u.nk, u.g
        cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool, float]] = {}
        dq_c = dq[chunk][u.b]
        slot = slice(u.h0, u.h0 + nk * g, g)             # a GQA group's sum goes to its first head
        for c0, c1 in blocks[chunk * len(blocks) // n:(chunk + 1) * len(blocks) // n]:
            bn = c1 - c0
            k_t, v_t = call.kv(u, c0, c1)
            assert v_t is not None
            kv_finite = all_finite(k_t, v_t)
            v_norm = _norm(v_t) * drop_scale
            # this task's own (still zero) slices of dk and dv: the first query tile's
            # products go straight in, the others add
            dk_j, dv_j = dk[u.b][slot, c0:c1], dv[u.b][slot, c0:c1]
            first = True
            for r0, r1, partial in call.query_tiles(u, c0, c1):
                if r0 not in cache:
                    q_t, do_t = call.q_tile(u, r0, r1), _rows3(call, dout, u, r0, r1)
                    delta_t = call.rows(delta, u, r0, r1)
                    cache[r0] = (q_t, do_t, delta_t,
                                 all_finite(q_t, delta_t) and not np.isnan(call.rows(lse, u, r0, r1)).any(),
                                 _norm(do_t) if np.abs(delta_t).max(initial=0) < big else math.inf)
                q_t, do_t, delta_t, rows_finite, do_norm = cache[r0]
                # NaN/inf in this tile's operands (q, k, v; a non-finite dout row makes its
                # delta non-finite; a NaN lse): the exempt products (attnkit.nonfinite);
                # checked here, on the workers
                careful = not (rows_finite and kv_finite)
                R = q_t.shape[1]
                p = np.empty((nk, R, bn), dtype=acc)
                tanh_t = np.empty_like(p) if spec.softcap else None
                call.scores(p, u, q_t, k_t, r0, r1, c0, c1, partial, tanh_out=tanh_t)
                vis = (p != -np.inf) if careful else None
                kern.exp_from_lse(p.reshape(nk * R, bn), call.rows(lse, u, r0, r1))   # the saved softmax
                pz = p
                if call.drop_thr:
                    pz = p.copy()
                    call.dropout(pz, u, r0, r1, c0)
                pzT = pz.transpose(0, 2, 1)
                if vis is None and first:
                    np.matmul(pzT, do_t, out=dv_j)
                else:
                    dv_j += pzT @ do_t if vis is None else exempt_matmul(pzT, do_t, vis.transpose(0, 2, 1))
                ds = np.matmul(do_t, v_t.transpose(0, 2, 1))   # dp = dout vᵀ
                call.dropout(ds, u, r0, r1, c0)
                kern.ds_tile(p.reshape(nk * R, bn), ds.reshape(nk * R, bn), delta_t)
                if vis is not None:
                    ds[~vis] = 0.0                       # excluded keys get no gradient, NaN or not
                elif not do_norm * v_norm < big and not all_finite(ds):
                    # finite operands whose dout vᵀ − delta overflowed: 0 · inf is NaN on an
                    # excluded pair (p = 0); those get 0, as on the reference
                    ds[~call.visible(u, q_t, k_t, r0, r1, c0, c1, partial)] = 0.0
                if dbias is not None and bias_shape is not None:
                    _add_dbias(dbias, bias_shape, ds, u, r0, r1, c0, c1)
                if tanh_t is not None:
                    np.multiply(tanh_t, tanh_t, out=tanh_t)   # d/dz c·tanh(z/c) = 1 − tanh²
                    np.subtract(1.0, tanh_t, out=tanh_t)
                    ds *= tanh_t
                    if vis is not None:
                        ds[~vis] = 0.0                   # (an excluded pair's tanh may be NaN: inf · 0)
                dsT = ds.transpose(0, 2, 1)
                if vis is None and first:
                    np.matmul(dsT, q_t, out=dk_j)
                else:
                    dk_j += dsT @ q_t if vis is None else exempt_matmul(dsT, q_t, vis.transpose(0, 2, 1))
                first = False
                dq_t = ds @ k_t if vis is None else exempt_matmul(ds, k_t, vis)
                dq_t *= spec.scale                       # dz/dq = scale · k
                dq_c[u.heads, r0:r1] += dq_t.reshape(nk * g, r1 - r0, spec.D)

    def task(t: tuple[int, int]) -> None:
        gi, chunk = t
        for u in groups[gi]:
            unit_chunk(u, chunk)

    if todo:
        runtime.run(todo, task)

    dq_sum = dq[0]
    for c in range(1, n_chunks):                         # fixed order: same bits for any thread count
        dq_sum += dq[c]
    if spec.softcap:                                     # q_t was q · scale / softcap; dz/dk = scale · q
        dk *= spec.softcap
    dq_u, dk_u, dv_u = (cast(x, spec.dtype) for x in spec.to_inputs(dq_sum, dk, dv))
    db = None
    if dbias is not None:
        db = cast(dbias.reshape(spec.shapes["bias"]), np.asarray(spec.bias).dtype)
    ds_ = None
    if spec.sinks is not None and delta is not None:
        ds_ = cast(sink_gradient(spec, lse, delta), np.asarray(spec.sinks).dtype)
    return Grads(dq_u, dk_u, dv_u, db, ds_)


def _covered(call: Call, kblocks: dict[int, list[tuple[int, int]]], n_chunks: int) -> bool:
    """Whether the compiled tasks write every element of dq, dk and dv: one dq chunk,
    every query head its own dk and dv (no GQA group stacked: only a group's first head
    gets them), the units' rows and keys the whole of L and S for every head, and every
    key block seen by some query tile (its first product then writes it)."""
    spec = call.spec
    units = call.units
    N = prod(spec.batch)
    return (n_chunks == 1 and all(u.g == 1 for u in units)
            and sum(u.nk * u.g * (u.seg.q1 - u.seg.q0) for u in units) == N * spec.H * spec.L
            and sum(u.nk * u.g * (u.seg.k1 - u.seg.k0) for u in units) == N * spec.H * spec.S
            and all(call.query_tiles(u, c0, c1) for u in units for c0, c1 in kblocks[id(u)]))


def _compiled(call: Call, groups: list[list[Unit]], todo: list[tuple[int, int]], blocks: list[list[tuple[int, int]]],
              n_chunks: int, dout: np.ndarray, out: np.ndarray, lse: np.ndarray, dlse: Any, dq: np.ndarray,
              dk: np.ndarray, dv: np.ndarray) -> list[tuple[int, int]]:
    """``todo`` (one unit each: no dbias) on the compiled backward (kernels'
    ``backward_tasks``), one compiled call per thread; returns the tasks left to the
    Python loop (operands with a NaN or inf, or a ds that overflowed)."""
    assert call.flat is not None
    spec = call.spec
    (q4, _), (k4, _), (v4, _) = call.flat
    do4, o4 = (flat_own(x, len(spec.batch))[0] for x in (dout, out))    # both of the full batch shape
    units = [groups[gi][0] for gi, _ in todo]
    tasks = []
    for (gi, ch), u in zip(todo, units):
        b = blocks[gi]
        n = min(len(b), n_chunks)
        if ch < n:
            tasks.append((u, ch, b[ch * len(b) // n:(ch + 1) * len(b) // n]))
    table, tiles, lo, hi = call.backward_table(tasks)
    N = int(np.prod(spec.batch, dtype=np.int64))
    lse3 = np.ascontiguousarray(broadcast_to(lse, spec.lse_shape)).reshape(N, spec.H, spec.L)
    dlse3 = _NO_DLSE if dlse is None else np.ascontiguousarray(
        broadcast_to(np.asarray(dlse, dtype=call.acc), spec.lse_shape)).reshape(N, spec.H, spec.L)
    counter, status = np.zeros(1, dtype=np.int64), np.zeros(len(table), dtype=np.int8)
    dq5 = dq.reshape((dq.shape[0], N) + dq.shape[-3:])
    dk4, dv4 = dk.reshape((N,) + dk.shape[-3:]), dv.reshape((N,) + dv.shape[-3:])
    runtime.run(range(runtime.get_threads()),
                lambda _: call.kern.backward_tasks(q4, k4, v4, do4, o4, lse3, dlse3, spec.scale, table, tiles, lo, hi,
                                                   counter, status, dq5, dk4, dv4))
    left = {(id(u), ch) for (u, ch, _), ok_ in zip(tasks, status) if not ok_}
    return [t for t, u in zip(todo, units) if (id(u), t[1]) in left]


_NO_DLSE = np.zeros((0, 0, 0), dtype=np.float32)
