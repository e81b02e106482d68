"""The flash rung's forward pass and its weights, tile by tile::

    for each task (unit, row block, key part):      tasks run on the worker pool
        m_i = sink or -inf, l_i = 1 or 0, acc = 0    running max, sum and output
        for each key tile inside the band:           fully excluded tiles are skipped
            s = q kᵀ · scale [softcap, bias, ALiBi, -inf where excluded]
            m_new = max(m_i, rowmax(s));  p = exp(s - m_new)
            alpha = exp(m_i - m_new)                 rescales the old tiles to the new max
            l_i = alpha·l_i + rowsum(p);  acc = alpha·acc + dropout(p) v
        out = acc / l_i,  lse = m_i + log(l_i)       l_i = 0 (no key, no sink): out 0, lse -inf

Key parts of one row block (split-KV, for few rows and many keys) are merged by their
(m, l) in a fixed order afterwards.
"""

from __future__ import annotations

import array
from functools import partial as partial_fn
from math import prod
from typing import Any

import numpy as np

from ..nonfinite import all_finite, exempt_matmul
from ..spec import geometry as geo
from ..spec.core import empty_out, heads_inner
from . import runtime
from .kernels import NUMPY, lse_from
from .plan import BUDGET, MIN_SPLIT, Call, Unit

NATIVE_WORK = 1 << 26   # scores of a call whose loop runs in one pass on torch's team (see _tile_tasks)

State = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    """x in the output dtype (inside quiet(): results below float16's smallest subnormal
    flush to 0, not an error under np.errstate(all='raise'))."""
    return x.astype(dtype, copy=False)


def _init(call: Call, u: Unit, r0: int, r1: int, with_sink: bool) -> tuple[np.ndarray, np.ndarray]:
    """(m_i, l_i) before the first key tile."""
    n = u.nk * u.g * (r1 - r0)
    if call.sinks is None or not with_sink:
        return np.full(n, -np.inf, dtype=call.acc), np.zeros(n, dtype=call.acc)
    return _sink_state(call.rows(call.sinks, u, r0, r1).astype(call.acc))


def _sink_state(m_i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(m, l) of rows whose only score so far is their sink logit m_i (its value 0, so
    acc starts at 0)."""
    shift = np.where(m_i == -np.inf, 0.0, m_i)
    return m_i, np.exp(m_i - shift).astype(m_i.dtype)    # +inf or NaN sink: NaN


def online_softmax(call: Call, u: Unit, q_t: np.ndarray | None, r0: int, r1: int, buf: np.ndarray,
                   want_out: bool, lo: int | None = None, hi: int | None = None, with_sink: bool = True) -> State:
    """The tiled loop for rows [r0, r1) of unit u over keys [lo, hi) (default: all):
    (m_i, l_i, acc | None) with rows flat (nk·g·rows). q_t: call.q_tile's rows, or
    None to have them made only where needed."""
    spec, kern = call.spec, call.kern
    nk, g, m = u.nk, u.g, r1 - r0
    m_i, l_i = _init(call, u, r0, r1, with_sink)
    streams = want_out and call.streams(u, r0, r1)
    if q_t is None:
        q_t = call.q_tile(u, r0, r1)
    if streams:
        return _stream(call, u, q_t, r0, r1, m_i, l_i, lo, hi)
    tiles = call.tiles(u, r0, r1, lo, hi)
    acc = pv = None
    if want_out:                                         # one tile covering every row: its
        one = len(tiles) == 1 and tiles[0][0] == r0 and tiles[0][1] == r1   # product is acc
        acc = (np.empty if one else np.zeros)((nk, g * m, spec.Dv), dtype=call.acc)
        pv = acc if one else np.empty_like(acc)
    for a0, a1, c0, c1, partial in tiles:
        rows = slice(a0 - r0, a1 - r0)                   # a strip of a single head's rows, or all
        whole = a0 == r0 and a1 == r1
        q_s = q_t if whole else q_t[:, rows]
        m_s, l_s = (m_i, l_i) if whole else (m_i[rows], l_i[rows])
        n_rows = q_s.shape[1]
        s = buf[: nk * n_rows * (c1 - c0)].reshape(nk, n_rows, c1 - c0)
        k_t, v_t = call.kv(u, c0, c1)
        fused = call.fuse_index and partial
        call.scores(s, u, q_s, k_t, a0, a1, c0, c1, partial, fused=fused)
        s2 = s.reshape(nk * n_rows, c1 - c0)
        if fused:                                        # causal/window applied row by row
            lo_b, hi_b = call.bounds(u, a0, a1)
            alpha = kern.softmax_tile_bounded(s2, m_s, l_s, lo_b, hi_b, c0)
        else:
            alpha = kern.softmax_tile(s2, m_s, l_s)
        if acc is not None and pv is not None and v_t is not None:
            call.dropout(s, u, a0, a1, c0)
            acc_s, pv_s = (acc, pv) if whole else (acc[:, rows], pv[:, rows])
            np.matmul(s, v_t, out=pv_s)
            # a NaN/inf in v_t makes a whole column of p v non-finite (0 · NaN is NaN): only
            # then the exempt product, whose visible pairs are the tile's scores again.
            # Every other tile keeps the plain product's bits, and v is never read twice
            if not all_finite(pv_s):
                pv_s[...] = exempt_matmul(s, v_t, partial_fn(call.visible, u, q_s, k_t, a0, a1, c0, c1, partial))
            if pv is acc:                                # acc was 0: alpha · 0 + pv is pv (a
                pass                                     # NaN alpha also makes l, so out, NaN)
            elif whole:
                kern.rescale_add(acc.reshape(nk * n_rows, -1), alpha, pv.reshape(nk * n_rows, -1))
            else:                                        # nk = 1 here: acc[0, rows] is a 2-D view
                kern.rescale_add(acc_s[0], alpha, pv_s[0])
    return m_i, l_i, acc


def _tile_tasks(call: Call, blocks: list[tuple[Unit, int, int]], tasks: list[tuple[Any, ...]], out: np.ndarray,
                lse: np.ndarray, parts: dict[int, list[Any]]) -> list[tuple[Any, ...]]:
    """``tasks`` (in their order) on the compiled loop (kernels' ``tile_tasks``), its
    arguments packed once for every thread, finishing each task into out and lse, or, a
    key part of split-KV, into ``parts``; returns the tasks left (a product p v not
    finite) for the Python loop. On torch's team a call of at most NATIVE_WORK scores
    runs in one pass with no Python on any thread (``runtime.run_native``); otherwise
    in passes of about BUDGET scores, so an interrupt is seen between them, each thread
    entering through ctypes (the GIL dropped). The loop scales q in its first product,
    so q is read in place where BLAS can (transformers' (B, L, H, D) queries: 5–10% of
    a BERT layer went to a strided copy of them): the same bits whatever the layout."""
    assert call.flat is not None
    (q4, _), (k4, _), (v4, _) = call.flat
    table, tiles, lo, hi, n_state = call.task_table(blocks, tasks)
    work = _work(table, tiles)
    N, Dv = int(np.prod(call.spec.batch, dtype=np.int64)), call.spec.Dv
    m0 = l0 = _NO_STATE
    if call.sinks is not None:
        m0, l0 = _sink_state(np.ascontiguousarray(call.sinks).reshape(N, *call.spec.lse_shape[-2:]))
    sm, sl, sacc = (np.empty(n_state, dtype=np.float32), np.empty(n_state, dtype=np.float32),
                    np.empty((n_state, Dv), dtype=np.float32))
    counter, status = np.zeros(1, dtype=np.int64), np.zeros(len(table), dtype=np.int8)
    out4, lse3 = out.reshape((N,) + out.shape[-3:]), lse.reshape((N,) + lse.shape[-2:])   # views: forward made them
    loop = call.kern.tile_tasks
    block = loop.pack(q4, call.qs, k4, v4, table, tiles, lo, hi, counter, status, m0, l0, out4, lse3, sm, sl, sacc,
                      BUDGET)
    _run_block(loop, array.array("q", block.tobytes()), work, len(table),
               not loop.one_thread(tiles, call.spec.D, Dv))
    if status.all() and not parts:
        return []
    left = []
    for t, row, ok in zip(tasks, table, status):
        if not ok:
            left.append(t)
        elif t[2] > 1:                                   # a key part: its state, merged later
            u, r0, r1 = blocks[t[0]]
            so, rows = int(row[13]), u.nk * u.g * (r1 - r0)
            parts[t[0]][t[1]] = (sm[so:so + rows], sl[so:so + rows], sacc[so:so + rows].reshape(u.nk, -1, Dv))
    return left


def _work(table: np.ndarray, tiles: np.ndarray) -> int:
    """The scores a task table computes."""
    heads = np.repeat(table[:, 6], table[:, 11] - table[:, 10])            # each tile's kv heads
    return int(((tiles[:, 1] - tiles[:, 0]) * (tiles[:, 3] - tiles[:, 2]) * heads).sum())


def _run_block(loop: Any, block: array.array, work: int, n_tasks: int, hold: bool) -> None:
    """The compiled loop on the arguments packed in ``block`` (``work`` scores, n_tasks
    tasks): in one pass on torch's team (a call of at most NATIVE_WORK scores), else in
    passes of about BUDGET scores on :func:`runtime.run`'s threads; BLAS held to one
    thread where ``hold`` (a product may use more: ``loop.one_thread``). A pass that stops
    for its budget did BUDGET scores: one more pass than there can be such stops (one
    per thread at least) reaches the end of the table. (An ``array.array``, not NumPy:
    inside a model, whose ops leave the caches cold, NumPy's indexing and reductions
    cost 50–60 µs a call.)"""
    n = runtime.get_threads()
    if work <= NATIVE_WORK:
        unbounded = loop.unbounded(block)
        if runtime.run_native(loop.address, unbounded.buffer_info()[0], min(n, n_tasks), blas=hold):
            return
    address = block.buffer_info()[0]
    runtime.run(range(work // BUDGET + n), lambda _: loop.run(address), blas=hold)


_NO_STATE = np.zeros((0, 0, 0), dtype=np.float32)


def _stream(call: Call, u: Unit, q_t: np.ndarray, r0: int, r1: int, m_i: np.ndarray, l_i: np.ndarray,
            lo: int | None, hi: int | None) -> State:
    """online_softmax for a few rows (decoding) by the compiled streaming kernel: each
    key and value row is read once for all of its head's rows, the unit's kv heads
    side by side."""
    spec = call.spec
    a, z = geo.key_range(u.seg, call.band, r0, r1)
    a, z = (a if lo is None else max(a, lo)), (z if hi is None else min(z, hi))
    row_lo, row_hi = call.bounds(u, r0, r1)
    acc = np.zeros((u.nk, u.g * (r1 - r0), spec.Dv), dtype=np.float32)
    slopes = diag = np.zeros(0, dtype=np.float32)
    if call.slopes is not None:                          # per row: its head's slope, its diagonal
        slopes = np.repeat(np.ascontiguousarray(call.slopes[u.b][u.heads]), r1 - r0).astype(np.float32)
        diag = np.tile(np.arange(r0, r1, dtype=np.int64) + u.seg.sigma, u.nk * u.g)
    k, v, table, row, P = call.cache_rows(u)
    if z > a:
        call.kern.decode_part(np.ascontiguousarray(q_t), k, v, table, row, u.h0 // spec.group, P, a, z,
                              row_lo, row_hi, np.float32(spec.softcap or 0.0), slopes, diag.astype(np.int64),
                              m_i, l_i, acc)
    return m_i, l_i, acc


def finish(m_i: np.ndarray, l_i: np.ndarray, acc: np.ndarray | None, kern: Any = NUMPY
           ) -> tuple[np.ndarray, np.ndarray | None]:
    """(lse, out) from the running state, out normalised in place by ``kern``'s
    ``normalize`` (rows without a key or sink 0, an infinite element NaN)."""
    if acc is not None:
        kern.normalize(acc.reshape(l_i.shape[0], -1), l_i)
    return lse_from(m_i, l_i), acc


def merge_parts(parts: list[State]) -> State:
    """(m, l, acc) of key parts of the same rows combined, in their order."""
    m = parts[0][0].copy()
    for p in parts[1:]:
        m = np.maximum(m, p[0])
    shift = np.where(m == -np.inf, 0.0, m)
    l_i = np.zeros_like(m)
    acc = None if parts[0][2] is None else np.zeros_like(parts[0][2])
    for pm, pl, pa in parts:
        w = np.exp(pm - shift)                           # part's max −inf: weight 0
        l_i += w * pl
        if acc is not None and pa is not None:
            acc += w.reshape(pa.shape[0], -1, 1) * pa
    return m, l_i, acc


def _finish_store(call: Call, lse: np.ndarray, out: np.ndarray | None, u: Unit, r0: int, r1: int,
                  state: State) -> np.ndarray:
    """The unit's rows of lse and out from its running state, out normalised straight
    into place (one pass): lse_i."""
    m_i, l_i, acc = state
    lse_u = lse[u.b][u.heads, r0:r1]
    if out is None or acc is None:
        lse_u[...] = lse_from(m_i, l_i).reshape(lse_u.shape)
    else:
        call.kern.finish_into(acc.reshape(l_i.shape[0], -1), m_i, l_i, out[u.b][u.heads, r0:r1], lse_u)
    return lse_u.reshape(-1)


def forward(call: Call, want_out: bool, want_weights: bool) -> tuple[np.ndarray | None, np.ndarray, np.ndarray | None]:
    """(out | None, lse, weights | None) in the accumulation dtype (weights in q's)."""
    spec = call.spec
    lse = np.full(spec.lse_shape, -np.inf, dtype=call.acc)
    blocks, tasks, covered, streams = call.kept_for_units(("forward", MIN_SPLIT), lambda: _plan(call))
    # every row of out is written when the blocks cover them all (no padding rows):
    # no zero fill then (a BERT batch's out is 12.6 MB, filled before the tasks start)
    alloc = np.empty if covered else np.zeros
    inner = spec.out_like_q and heads_inner(spec.q)
    out = empty_out(spec.out_shape, inner, lambda sh: alloc(sh, dtype=call.acc)) if want_out else None
    weights = np.zeros(spec.score_shape, dtype=spec.dtype) if want_weights else None
    parts: dict[int, list[Any]] = {n_b: [None] * n for n_b, i, n, _, _ in tasks if n > 1 and i == 0}

    def task(t: tuple[Any, ...]) -> None:
        n_b, i, n, lo, hi = t
        u, r0, r1 = blocks[n_b]
        buf = call.tile_buffer(u, r0, r1)
        q_t = None if weights is None else call.q_tile(u, r0, r1)   # made where needed
        state = online_softmax(call, u, q_t, r0, r1, buf, want_out, lo, hi, with_sink=i == 0)
        if n > 1:
            parts[n_b][i] = state
            return
        lse_i = _finish_store(call, lse, out, u, r0, r1, state)
        if weights is not None and q_t is not None:
            weights_rows(call, u, q_t, r0, r1, lse_i, weights, r0, buf)

    if out is not None and weights is None and call.flat is not None:
        looped = [t for t, s in zip(tasks, streams) if not s]
        tasks = [t for t, s in zip(tasks, streams) if s] + (_tile_tasks(call, blocks, looped, out, lse, parts)
                                                            if looped else [])
    # decoding: every block on the compiled streaming kernel, no matmul (online_softmax)
    streams_only = want_out and weights is None and all(call.streams(*blocks[t[0]]) for t in tasks)
    if tasks:
        runtime.run(tasks, task, blas=not streams_only)
    for n_b, states in parts.items():                    # split-KV: merge the parts in order
        u, r0, r1 = blocks[n_b]
        _finish_store(call, lse, out, u, r0, r1, merge_parts(states))
    if weights is not None and parts:
        runtime.run([blocks[n_b] for n_b in parts],
                    lambda b: weights_rows(call, b[0], call.q_tile(*b), b[1], b[2],
                                           call.rows(lse, *b), weights, b[1], None))
    return out, lse, weights


def _plan(call: Call) -> tuple[list[tuple[Unit, int, int]], list[tuple[int, int, int, int, int]], bool, list[bool]]:
    """The forward's plan, kept with the call's units (a model repeats it in every
    layer): the row blocks; the tasks (block, part i of n, keys [lo, hi)), heaviest
    first (causal: the last query blocks see the most keys); whether the blocks cover
    every row; which tasks stream (decoding)."""
    blocks = [(u, r0, r1) for u in call.units for r0, r1 in call.row_blocks(u)]
    covered = sum(u.nk * u.g * (r1 - r0) for u, r0, r1 in blocks) == prod(call.spec.lse_shape)
    tasks = []
    for n_b, (u, r0, r1) in enumerate(blocks):
        lo, hi = geo.key_range(u.seg, call.band, r0, r1)
        n = call.splits(len(blocks), hi - lo)
        cuts = [lo + (hi - lo) * i // n for i in range(n + 1)]
        tasks += [(n_b, i, n, cuts[i], cuts[i + 1]) for i in range(n)]
    tasks.sort(key=lambda t: -(t[4] - t[3]) * (blocks[t[0]][2] - blocks[t[0]][1]) * blocks[t[0]][0].nk)
    return blocks, tasks, covered, [call.streams(*blocks[t[0]]) for t in tasks]


def weights_rows(call: Call, u: Unit, q_t: np.ndarray, r0: int, r1: int, lse_i: np.ndarray,
                 w: np.ndarray, pos: int, buf: np.ndarray | None) -> None:
    """w[b][heads, pos:pos + rows] (zero-filled, keys on the last axis) ← exp(scores −
    lse) for rows [r0, r1) of unit u, tile by tile (weights before dropout)."""
    nk, m = u.nk, r1 - r0
    if buf is None:
        buf = call.tile_buffer(u, r0, r1)
    dest = w[u.b][u.heads, pos:pos + m]                  # (nk·g, rows, S)
    lse_h = lse_i.reshape(nk * u.g, m)
    for a0, a1, c0, c1, partial in call.tiles(u, r0, r1):
        rows = slice(a0 - r0, a1 - r0)
        whole = a0 == r0 and a1 == r1
        q_s = q_t if whole else q_t[:, rows]
        n_rows = q_s.shape[1]
        s = buf[: nk * n_rows * (c1 - c0)].reshape(nk, n_rows, c1 - c0)
        k_t, _ = call.kv(u, c0, c1)
        call.scores(s, u, q_s, k_t, a0, a1, c0, c1, partial)
        call.kern.exp_from_lse(s.reshape(nk * n_rows, -1), np.ascontiguousarray(lse_h[:, rows]).reshape(-1))
        dest[:, rows, c0:c1] = s.reshape(nk * u.g, a1 - a0, c1 - c0)   # float16: tiny weights flush to 0


def weights(call: Call, lse: Any, rows: np.ndarray) -> np.ndarray:
    """Weights (..., H, len(rows), S) in q's dtype for the query rows ``rows``, tile by
    tile: O(len(rows) · S) memory. Without lse each task first runs the forward over
    its rows (no v needed) to get it."""
    spec = call.spec
    w = np.zeros(spec.batch + (spec.H, rows.size, spec.S), dtype=spec.dtype)
    lse_all = None if lse is None else np.asarray(lse, dtype=call.acc)
    pieces = []
    for u in call.units:
        step = call.BLOCK_M if u.g * u.nk == 1 else None
        for pos, r0, r1 in _runs(rows):
            a, z = max(r0, u.seg.q0), min(r1, u.seg.q1)   # the run's rows inside this sequence
            for c in range(a, z, step or max(z - a, 1)):
                pieces.append((u, pos + c - r0, c, min(c + step, z) if step else z))

    def task(t: tuple[Any, ...]) -> None:
        u, pos, r0, r1 = t
        q_t = call.q_tile(u, r0, r1)
        buf = call.tile_buffer(u, r0, r1)
        if lse_all is None:
            lse_i, _ = finish(*online_softmax(call, u, q_t, r0, r1, buf, False))
        else:
            lse_i = call.rows(lse_all, u, r0, r1)
        weights_rows(call, u, q_t, r0, r1, lse_i, w, pos, buf)

    runtime.run(pieces, task)
    return w


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """Row indices as runs of consecutive rows: [(pos, r0, r1)], pos = where the run
    starts in ``rows``."""
    rows = np.asarray(rows, dtype=np.int64).ravel()
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [rows.size]))
    return [(int(p), int(rows[p]), int(rows[p]) + int(e - p)) for p, e in zip(starts, ends)]
