"""The tile plan of one flash call: which heads, rows and keys each task covers.

A :class:`Unit` is one sequence of one batch element for a set of query heads: ``nk``
key-value heads side by side (a batched matmul) with ``g`` query heads each, stacked
as rows — ``g`` is the GQA group when a whole group's rows fit in one tile (so each
key-value head is read once for its whole group: decoding, short sequences), else 1.
Small heads are batched ``nk`` at a time so that a task is worth its Python overhead
(a BERT batch: 12 heads of 128 × 128 per task). A tile is rows × keys of a unit,
shaped (nk, g·rows, keys).

Every choice here depends on the shapes only, never on the thread count, so the bits
do not either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import philox
from ..spec import Spec, broadcast_to
from ..spec import geometry as geo
from . import kernels


def block_sizes(D: int, dtype: str, backward: bool = False) -> tuple[int, int]:
    """The tuning table: (BLOCK_M, BLOCK_N) — query rows and keys per tile. A plain
    function; override per call with ``block_m=`` / ``block_n=``.

    Parameters
    ----------
    D : int
        The larger of the query-key and value head dims.
    dtype : str
        The accumulation dtype ("float32" or "float64"; it does not change the table
        today).
    backward : bool
        The backward pass's tiles instead of the forward's.

    Examples
    --------
    >>> block_sizes(64, "float32")
    (1024, 512)
    """
    if backward:
        return (256, 256) if D <= 128 else (128, 256)
    return (1024, 512) if D <= 128 else (512, 512)


SUB_M = 128            # row strips for the tiles that causal/window cut through
LOOP_SUB_M = 64        # the same in the compiled tile loop, where a strip costs no Python
DECODE_ROWS = 64       # units with at most this many rows stream their keys (decoding)
SMALL_TILE = 1 << 18   # heads whose whole score matrix is at most this many elements are batched
MIN_TASKS = 8          # split keys (split-KV) or chunk the backward until this many tasks exist
MIN_SPLIT = 1024       # keys per split-KV part at least
KEPT, KEPT_SIZE = 256, 1 << 14   # plans kept across calls: how many, how large (entries)
NO_BOUNDS = np.zeros(0, dtype=np.int64)
BUDGET = 1 << 22       # scores per compiled tile_tasks call before it returns (an interrupt is seen then)
_KEPT: dict[tuple[Any, ...], Any] = {}


@dataclass(frozen=True)
class Unit:
    """Query heads h0 … h0 + nk·g − 1 of batch element b over one sequence: tile
    index a holds query heads h0 + a·g … h0 + a·g + g − 1, which share kv head
    (h0 + a·g) // group."""

    b: tuple[int, ...]
    h0: int
    nk: int
    g: int
    seg: geo.Segment
    n: int                  # b's index in the batch flattened (C order)

    @property
    def heads(self) -> slice:
        return slice(self.h0, self.h0 + self.nk * self.g)


def tile_ready(x: Any, dtype: Any) -> np.ndarray:
    """x in dtype with rows BLAS can read in place (unit stride along the last dim, rows
    at least a row apart: transformers' (B, S, H, D) → (B, H, S, D) view qualifies);
    copies only when needed, and never expands broadcast batch dims."""
    x = np.asarray(x)
    if x.dtype == dtype and not blas_cannot_read(x):
        return x
    return np.ascontiguousarray(x, dtype=dtype)


def blas_cannot_read(x: np.ndarray) -> bool:
    """Whether BLAS cannot read x's last two dims in place (see :func:`tile_ready`)."""
    it = x.dtype.itemsize
    return not (x.strides[-1] == it and (x.shape[-2] == 1 or (
        x.strides[-2] >= x.shape[-1] * it and x.strides[-2] % it == 0)))


def _flat(x: np.ndarray) -> np.ndarray | None:
    """x (..., A, B, C) as (N, A, B, C) without a copy (None where the batch dims do not
    merge: broadcast over some but not all of them)."""
    y = x.view()
    try:
        y.shape = (-1,) + x.shape[-3:]
    except AttributeError:
        return None
    return y


def flat_own(x: np.ndarray, batch_dims: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """(x as a read-only (N, A, B, C), its batch shape padded to batch_dims): a view,
    or a C-ordered copy where x's batch dims do not merge (odd strides)."""
    own = (1,) * (batch_dims - (x.ndim - 3)) + tuple(x.shape[:-3])
    x = x.reshape(own + x.shape[-3:])                    # leading 1s: a view
    y = _flat(x)
    if y is None:
        y = np.ascontiguousarray(x).reshape((-1,) + x.shape[-3:])
    y = y.view()
    y.flags.writeable = False               # as every call's operands: one compiled specialization
    return y, own


def _own_index(b: tuple[int, ...], own: tuple[int, ...]) -> int:
    """The flat index in an operand of batch shape ``own`` of batch element b (its
    broadcast dims taken at 0)."""
    i = 0
    for bi, n in zip(b, own):
        i = i * n + (bi if n > 1 else 0)
    return i


@functools.lru_cache(maxsize=64)
def _batch_index(batch: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Every index of the batch dims, in C order."""
    return tuple(np.ndindex(*batch))


def unit_rows(x: np.ndarray) -> np.ndarray:
    """x, or its C-ordered copy where its last dim is not of unit stride (the streaming
    kernels read rows as vectors; any other strides they follow, in one order of sums
    whatever the layout)."""
    return x if x.strides[-1] == x.itemsize else np.ascontiguousarray(x)


class Call:
    """Operands, settings and the tile plan shared by every task of one call."""

    def __init__(self, spec: Spec, block_m: int | None, block_n: int | None, backward: bool = False,
                 pages: Any = None) -> None:
        self.spec = spec
        self.acc = np.dtype(spec.acc_dtype)
        bm, bn = block_sizes(max(spec.D, spec.Dv), spec.acc_dtype, backward)
        self.BLOCK_M = int(bm if block_m is None else block_m)
        self.BLOCK_N = int(bn if block_n is None else block_n)
        if self.BLOCK_M < 1 or self.BLOCK_N < 1:
            raise ValueError(f"block sizes must be positive, got {self.BLOCK_M}, {self.BLOCK_N}")
        self.tuned = block_m is None and block_n is None
        self.kern = kernels.for_dtype(self.acc)
        self.band = geo.band(spec.causal, spec.window)
        self.qs = spec.scale / spec.softcap if spec.softcap else spec.scale   # folded into q
        self.batch_index = _batch_index(spec.batch)
        self.q = broadcast_to(np.asarray(spec.q), spec.batch + tuple(spec.q.shape[-3:]))
        # paged keys (attention_kvcache): (k_pages, v_pages, block_table, page_size)
        self.pages = pages
        own: list[Any] = [None, None]
        if pages is None:
            own = [tile_ready(spec.k, self.acc), None if spec.v is None else tile_ready(spec.v, self.acc)]
            self.k = broadcast_to(own[0], spec.batch + tuple(spec.k.shape[-3:]))
            self.v = None if own[1] is None else broadcast_to(own[1], spec.batch + tuple(spec.v.shape[-3:]))
        self.masked = spec.keep is not None or spec.drop is not None
        # NaN/inf in an operand of a product whose other side is 0 on excluded keys:
        # the exempt products (attnkit.nonfinite), the plain ones otherwise. Checked on
        # the workers, where the products are made: the forward checks each tile's p v
        # (hot, just made; the values, a KV cache among them, are never read again),
        # the backward each key block's operands.
        # causal/window alone: the softmax tile takes each row's key bounds
        self.fuse_index = not self.masked
        self.slopes = (None if spec.alibi_slopes is None else
                       broadcast_to(np.asarray(spec.alibi_slopes, dtype=self.acc), spec.batch + (spec.H,)))
        self.sinks = (None if spec.sinks is None else
                      broadcast_to(np.asarray(spec.sinks, dtype=self.acc), spec.lse_shape))
        self.drop_thr = 0
        if spec.dropout > 0:
            self.drop_thr = philox.threshold(spec.dropout)
            self.drop_scale = 1.0 / (1.0 - spec.dropout)
        # plain scores in float32 (no mask arrays, bias, softcap, ALiBi or dropout; dense
        # keys): the tasks run compiled (numba_loop's forward, numba_backward's
        # backward), products by BLAS
        self.loop = (kernels.USE_LOOP and getattr(self.kern, "backward_tasks" if backward else "tile_tasks",
                                                  None) is not None
                     and not self.masked and spec.bias is None and not spec.softcap and self.slopes is None
                     and not self.drop_thr and pages is None and self.v is not None)
        # few rows against many keys (decoding): the compiled streaming kernel reads each
        # key and value row once for the unit's rows (float32, no mask arrays, no dropout)
        # (pages in another dtype, float16, take the tiles: each tile's pages are gathered
        # and converted, where the kernel would need the whole pool converted first)
        self.stream = (not backward and self.tuned and getattr(self.kern, "decode_part", None) is not None
                       and not self.masked and spec.bias is None and not self.drop_thr
                       and (pages is None or pages[0].dtype == self.acc))
        # the compiled loop's operands (numba_loop.tile_tasks), once per call: q, k, v in
        # float32 (float16 converted here, not per task), each as (N, heads, rows, D)
        # over its own batch dims flattened (broadcast ones never expanded), read only
        self.flat: list[tuple[np.ndarray, tuple[int, ...]]] | None = None
        if self.loop and own[0] is not None and own[1] is not None:
            self.flat = [flat_own(x, len(spec.batch)) for x in (tile_ready(spec.q, self.acc), own[0], own[1])]
        self._plans: dict[Any, Any] = {}
        # what the plan's keys leave out: the band, the tile sizes and the strip heights
        self._geom = (self.band, self.BLOCK_M, self.BLOCK_N, self.tuned, SUB_M, LOOP_SUB_M)
        self.units = self._units(backward)
        if self.stream and pages is not None and any(
                self.streams(u, r0, r1) for u in self.units for r0, r1 in self.row_blocks(u)):
            # the streaming kernel reads rows of unit stride (dense keys: tile_ready's): a
            # pool strided along D is read from a copy
            self.pages = (unit_rows(pages[0]), unit_rows(pages[1])) + tuple(pages[2:])

    # ---- the plan -----------------------------------------------------------------
    def _units(self, backward: bool) -> list[Unit]:
        """The call's units, kept across calls (:meth:`_kept`) under everything they
        are made from: the sequences' geometry (lengths and offsets by value) and the
        choices below (48 of a BERT layer's 76 µs of planning, made again per call)."""
        spec = self.spec
        key = ("units", backward, spec.bias is None, self.stream, self.pages is None, spec.batch, spec.group,
               spec.H, spec.Hkv, spec.L, spec.S, spec.align, spec.origin, spec.extent, SMALL_TILE, DECODE_ROWS,
               MIN_TASKS, *(None if x is None else (np.shape(x), np.asarray(x).dtype.str, np.asarray(x).tobytes())
                            for x in (spec.q_lengths, spec.kv_lengths, spec.kv_starts, spec.cu_seqlens_q,
                                      spec.cu_seqlens_k)))
        self._units_key = key
        return list(self._kept(key, lambda: self._make_units(backward)))

    def kept_for_units(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """make() kept as :meth:`_kept` keeps plans, for a plan made from the whole list
        of units (the forward's row blocks and tasks): under the units' own key too."""
        return self._kept(key + self._units_key, make)

    def _make_units(self, backward: bool) -> list[Unit]:
        spec = self.spec
        G, H, Hkv = spec.group, spec.H, spec.Hkv
        stackable = not (backward and spec.bias is not None)   # dbias adds per head
        units = []
        for n, b in enumerate(self.batch_index):
            for seg in geo.segments(spec, b):
                Lq, Sk = seg.q1 - seg.q0, max(seg.k1 - seg.k0, 1)
                if stackable and G * Lq <= self.BLOCK_M:
                    per_head = G * Lq * Sk
                    nk = max(1, min(Hkv, SMALL_TILE // per_head)) if Sk <= self.BLOCK_N else 1
                    # decoding: all kv heads in one pass over the keys from pages (a page
                    # holds every head's rows) and from dense keys where the batch alone
                    # gives the workers enough units (B ≥ MIN_TASKS / 2: 7–15% faster at
                    # B = 4–16, 32 heads, 8 kv heads, S = 2–4k); fewer sequences keep one
                    # kv head per unit (more units, fewer split-KV merges)
                    if self.stream and G * Lq <= DECODE_ROWS and (
                            self.pages is not None or len(self.batch_index) >= MIN_TASKS // 2):
                        nk = Hkv
                    units += [Unit(b, hk * G, min(nk, Hkv - hk), G, seg, n) for hk in range(0, Hkv, nk)]
                else:
                    units += [Unit(b, h, 1, 1, seg, n) for h in range(H)]
        return units

    def row_blocks(self, u: Unit) -> list[tuple[int, int]]:
        """Query row blocks [r0, r1) covering the unit's sequence."""
        q0, q1 = u.seg.q0, u.seg.q1
        if u.g > 1 or u.nk > 1:
            return [(q0, q1)]
        return [(i, min(i + self.BLOCK_M, q1)) for i in range(q0, q1, self.BLOCK_M)]

    def key_block(self, u: Unit, r0: int, r1: int) -> int:
        """Keys per tile of rows [r0, r1) of unit u: BLOCK_N, wider for few rows
        (decoding) at the same tile size (all of the unit's heads counted)."""
        rows = u.nk * u.g * (r1 - r0)
        if not self.tuned or rows >= self.BLOCK_M:
            return self.BLOCK_N
        return max(self.BLOCK_N, (self.BLOCK_M * self.BLOCK_N // max(rows, 1)) // self.BLOCK_N * self.BLOCK_N)

    def tile_buffer(self, u: Unit, r0: int, r1: int) -> np.ndarray:
        """Scratch for one tile of rows [r0, r1) of unit u (scores, then weights)."""
        return np.empty(u.nk * u.g * (r1 - r0) * self.key_block(u, r0, r1), dtype=self.acc)

    def splits(self, n_tasks: int, keys: int) -> int:
        """How many parts (split-KV) each row block's keys are cut into, by shape."""
        if n_tasks >= MIN_TASKS or keys < 2 * MIN_SPLIT:
            return 1
        return max(1, min(-(-MIN_TASKS // n_tasks), keys // MIN_SPLIT))

    def key_blocks(self, u: Unit, r0: int, r1: int, lo: int | None = None, hi: int | None = None
                   ) -> list[tuple[int, int]]:
        """Key tiles [c0, c1) for rows [r0, r1) inside the band (tiles outside are fully
        excluded and skipped), optionally within [lo, hi)."""
        a, z = geo.key_range(u.seg, self.band, r0, r1)
        a, z = (a if lo is None else max(a, lo)), (z if hi is None else min(z, hi))
        bn = self.key_block(u, r0, r1)
        return [(c, min(c + bn, z)) for c in range(a, z, bn)]

    def partial(self, u: Unit, r0: int, r1: int, c0: int, c1: int) -> bool:
        return geo.tile_partial(u.seg, self.band, r0, r1, c0, c1)

    def tiles(self, u: Unit, r0: int, r1: int, lo: int | None = None, hi: int | None = None
              ) -> list[tuple[int, int, int, int, bool]]:
        """[(a0, a1, c0, c1, partial)]: tiles covering what rows [r0, r1) can see, key
        block by key block. Where the band cuts through a block of a single head, its
        rows are taken in strips of SUB_M: strips that see the whole key block are
        merged, the others clipped to their own key bounds. Worked out once for each
        (sequence, row block, range) and geometry (see :meth:`_kept`)."""
        return self._kept(("tiles", u.seg, u.nk, u.g, r0, r1, lo, hi),
                          lambda: [t + (self.partial(u, *t),) for t in self._tiles(u, r0, r1, lo, hi)])

    def _kept(self, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """make() for a plan key, once per call, and kept across calls where small (a
        model repeats its geometry in every layer: a Llama layer's call spent 124 of its
        3,000 µs on one thread planning tiles and bounds again): at most KEPT plans of
        at most KEPT_SIZE entries. Plans are only read."""
        key = self._geom + key
        plan = _KEPT.get(key)
        if plan is None:
            plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
            size = plan.size if isinstance(plan, np.ndarray) else sum(np.size(x) for x in plan)
            if size <= KEPT_SIZE:
                if len(_KEPT) >= KEPT:
                    _KEPT.clear()
                _KEPT[key] = plan
        return plan

    def _tiles(self, u: Unit, r0: int, r1: int, lo: int | None, hi: int | None) -> Any:
        for c0, c1 in self.key_blocks(u, r0, r1, lo, hi):
            if u.g * u.nk > 1 or r1 - r0 <= SUB_M or not self.partial(u, r0, r1, c0, c1):
                yield r0, r1, c0, c1
            else:
                yield from self._strips(u, r0, r1, c0, c1, SUB_M)

    def _strips(self, u: Unit, r0: int, r1: int, c0: int, c1: int, sub: int) -> Any:
        """One head's rows [r0, r1) against a key block the band cuts, in strips of
        ``sub`` rows: (a0, a1, c0, c1) with each strip's keys clipped to its own
        bounds, and consecutive strips that see the whole block merged."""
        run = None                                       # rows [run, a0) see all of [c0, c1)
        for a0 in range(r0, r1, sub):
            a1 = min(a0 + sub, r1)
            if not self.partial(u, a0, a1, c0, c1):
                run = a0 if run is None else run
                continue
            if run is not None:
                yield run, a0, c0, c1
                run = None
            s0, s1 = geo.key_range(u.seg, self.band, a0, a1)
            if max(c0, s0) < min(c1, s1):
                yield a0, a1, max(c0, s0), min(c1, s1)
        if run is not None:
            yield run, r1, c0, c1

    def flat_tiles(self, u: Unit, r0: int, r1: int, lo: int | None = None, hi: int | None = None) -> np.ndarray:
        """The tiles of rows [r0, r1) for the compiled loop (kernels' ``tile_tasks``):
        int64 (n, 5) of rows [f0, f1) among the g·rows each of the unit's kv heads
        stacks, keys [c0, c1), partial. Where the band cuts a key block, every query
        head of a GQA group is taken in strips, as :meth:`tiles` takes a single head's
        but of LOOP_SUB_M rows (in one compiled call a strip costs no Python: causal
        B = 4, 8 query and 2 kv heads, L = 256, D = 32 took 1.8 ms against 2.3 as one
        tile per group and 2.0 in strips of 128); elsewhere a group's rows stay one
        tile."""
        return self._kept(("flat", u.seg, u.nk, u.g, r0, r1, lo, hi), lambda: self._flat_tiles(u, r0, r1, lo, hi))

    def _flat_tiles(self, u: Unit, r0: int, r1: int, lo: int | None, hi: int | None) -> np.ndarray:
        m, rows = r1 - r0, []
        for c0, c1 in self.key_blocks(u, r0, r1, lo, hi):
            if m <= LOOP_SUB_M or not self.partial(u, r0, r1, c0, c1):
                rows.append((0, u.g * m, c0, c1, self.partial(u, r0, r1, c0, c1)))
                continue
            strips = list(self._strips(u, r0, r1, c0, c1, LOOP_SUB_M))
            rows += [(a0 - r0 + j * m, a1 - r0 + j * m, s0, s1, self.partial(u, a0, a1, s0, s1))
                     for j in range(u.g) for a0, a1, s0, s1 in strips]
        return np.array(rows, dtype=np.int64).reshape(-1, 5)

    def query_tiles(self, u: Unit, c0: int, c1: int) -> list[tuple[int, int, bool]]:
        """[(r0, r1, partial)]: the row blocks of the unit that see any of keys [c0, c1)
        (the backward's loop; fully excluded tiles skipped)."""
        def make() -> list[tuple[int, int, bool]]:
            lo, hi = geo.query_range(u.seg, self.band, c0, c1)
            return [(r0, r1, self.partial(u, r0, r1, c0, c1)) for r0, r1 in self.row_blocks(u) if r0 < hi and r1 > lo]
        return self._kept(("keys", u.seg, u.g, u.nk, c0, c1), make)

    # ---- operands of a tile -----------------------------------------------------
    def q_tile(self, u: Unit, r0: int, r1: int) -> np.ndarray:
        """(nk, g·rows, D): q of the unit's heads times qs, in the accumulation dtype."""
        m, D = r1 - r0, self.spec.D
        x = self.q[u.b][u.heads, r0:r1].reshape(u.nk, u.g, m, D)
        out = np.empty((u.nk, u.g * m, D), dtype=self.acc)
        np.multiply(x, self.qs, out=out.reshape(u.nk, u.g, m, D), dtype=self.acc)
        return out

    def task_table(self, blocks: list[tuple[Unit, int, int]], tasks: list[tuple[int, int, int, int, int]]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """The compiled loop's tasks (numba_loop.tile_tasks): for each (block, part i of
        n, keys [lo, hi)) a row of (n, q's, k's and v's batch index, h0, its kv head, nk,
        g, r0, r1, the tiles [t0, t1), the bounds' offset b0 (−1: no banded tile), the
        state's row offset (split parts; −1: finished into out and lse), whether the
        sinks start it); the tiles, lo, hi; the state rows the parts need. Kept across
        calls (see :meth:`_kept`): the units, rows and key ranges name every task."""
        assert self.flat is not None
        key = ("table", self.sinks is not None, tuple(own for _, own in self.flat), tuple(tasks))
        return self.kept_for_units(key, lambda: self._task_table(blocks, tasks))

    def _task_table(self, blocks: list[tuple[Unit, int, int]], tasks: list[tuple[int, int, int, int, int]]
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        assert self.flat is not None
        rows, tiles, bounds = [], [], []
        nt = nb = ns = 0
        for n_b, i, n, lo, hi in tasks:
            u, r0, r1 = blocks[n_b]
            t = self.flat_tiles(u, r0, r1, lo, hi)
            b0 = so = -1
            if t[:, 4].any():
                bounds.append(self.bounds(u, r0, r1))
                b0, nb = nb, nb + bounds[-1][0].size
            if n > 1:
                so, ns = ns, ns + u.nk * u.g * (r1 - r0)
            rows.append((u.n, *(_own_index(u.b, own) for _, own in self.flat), u.h0, u.h0 // self.spec.group, u.nk,
                         u.g, r0, r1, nt, nt + len(t), b0, so, int(self.sinks is not None and i == 0)))
            tiles.append(t)
            nt += len(t)
        lo_all, hi_all = ((np.concatenate(x) for x in zip(*bounds)) if bounds else (NO_BOUNDS, NO_BOUNDS))
        return (np.array(rows, dtype=np.int64).reshape(-1, 15),
                np.concatenate(tiles) if tiles else np.zeros((0, 5), dtype=np.int64), lo_all, hi_all, ns)

    def backward_table(self, tasks: list[tuple[Unit, int, list[tuple[int, int]]]]
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The compiled backward's tasks (numba_backward.backward_tasks): for each (unit,
        dq chunk, its key blocks) a row of (n, q's, k's and v's own batch indices, h0,
        its kv head, nk, g, the unit's rows [r0, r1), the tiles [t0, t1), the chunk);
        the tiles (keys [c0, c1), rows [a0, a1), banded, the unit's bounds' offset in
        lo/hi), lo, hi. Kept across calls (see :meth:`_kept`)."""
        assert self.flat is not None
        key = ("btable", self.spec.group, tuple(own for _, own in self.flat),
               tuple((u, ch, tuple(b)) for u, ch, b in tasks))
        return self._kept(key, lambda: self._backward_table(tasks))

    def _backward_table(self, tasks: list[tuple[Unit, int, list[tuple[int, int]]]]
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        assert self.flat is not None
        rows, bounds = [], []
        tiles: list[tuple[int, ...]] = []
        nb = 0
        for u, ch, blocks in tasks:
            r0, r1 = u.seg.q0, u.seg.q1
            t = [(c0, c1, a0, a1, int(partial)) for c0, c1 in blocks for a0, a1, partial in self.query_tiles(u, c0, c1)]
            bo = 0
            if any(x[4] for x in t):
                lo, hi = geo.row_key_bounds(u.seg, self.band, r0, r1)
                bounds.append((np.tile(lo, u.g), np.tile(hi, u.g)))
                bo, nb = nb, nb + u.g * (r1 - r0)
            rows.append((u.n, *(_own_index(u.b, own) for _, own in self.flat), u.h0, u.h0 // self.spec.group, u.nk,
                         u.g, r0, r1, len(tiles), len(tiles) + len(t), ch))
            tiles += [x + (bo,) for x in t]
        lo_all, hi_all = ((np.concatenate(x) for x in zip(*bounds)) if bounds else (NO_BOUNDS, NO_BOUNDS))
        return (np.array(rows, dtype=np.int64).reshape(-1, 13), np.array(tiles, dtype=np.int64).reshape(-1, 6),
                lo_all, hi_all)

    def kv(self, u: Unit, c0: int, c1: int) -> tuple[np.ndarray, np.ndarray | None]:
        """(nk, keys, D) and (nk, keys, Dv) views of the unit's kv heads (GQA: shared, no
        copy); from a paged cache, the tile's pages gathered (one copy of the tile)."""
        hk = u.h0 // self.spec.group
        if self.pages is not None:
            k_pages, v_pages, table, P = self.pages
            p0, p1 = c0 // P, -(-c1 // P)
            idx = table[u.b[0], p0:p1]
            out = []
            for cache in (k_pages, v_pages):
                g = cache[idx, hk:hk + u.nk]                 # (pages, nk, P, D)
                g = g.transpose(1, 0, 2, 3).reshape(u.nk, (p1 - p0) * P, -1)
                out.append(tile_ready(g[:, c0 - p0 * P:c1 - p0 * P], self.acc))
            return out[0], out[1]
        k = self.k[u.b][hk:hk + u.nk, c0:c1]
        return k, (None if self.v is None else self.v[u.b][hk:hk + u.nk, c0:c1])

    def visible(self, u: Unit, q_t: np.ndarray, k_t: np.ndarray, r0: int, r1: int, c0: int, c1: int,
                partial: bool) -> np.ndarray:
        """Which (row, key) pairs of a tile are visible (its final scores, recomputed with
        every exclusion as −inf, are not −inf): the exempt product's pairs, wanted only
        where the tile's values hold a NaN or inf."""
        s = np.empty((u.nk, q_t.shape[1], c1 - c0), dtype=self.acc)
        self.scores(s, u, q_t, k_t, r0, r1, c0, c1, partial)
        return s != -np.inf

    def rows(self, arr: Any, u: Unit, r0: int, r1: int) -> np.ndarray:
        """A (..., H, L) array's entries for the tile's rows, flat (nk·g·rows,)."""
        return np.asarray(arr[u.b][u.heads, r0:r1]).reshape(-1)

    def flat_heads(self, u: Unit) -> np.ndarray:
        """n·H + h of every head of the unit (dropout's counter)."""
        n = int(np.ravel_multi_index(u.b, self.spec.batch)) if self.spec.batch else 0
        return n * self.spec.H + np.arange(u.heads.start, u.heads.stop, dtype=np.int64)

    def scores(self, s: np.ndarray, u: Unit, q_t: np.ndarray, k_t: np.ndarray, r0: int, r1: int,
               c0: int, c1: int, partial: bool, fused: bool = False,
               tanh_out: np.ndarray | None = None) -> None:
        """Fill s (nk, g·rows, keys) with the final scores of one tile: q kᵀ, softcap,
        bias, ALiBi, −inf where excluded (keep, drop, and the band where it cuts the
        tile — unless ``fused``: the caller's softmax applies the band itself). tanh_out
        (optional) receives tanh(s / softcap)."""
        spec = self.spec
        np.matmul(q_t, k_t.transpose(0, 2, 1), out=s)
        if spec.softcap:
            np.tanh(s, out=s)                            # q was scaled by scale / softcap
            if tanh_out is not None:
                tanh_out[...] = s
            s *= spec.softcap
        per_head = s.reshape(u.nk * u.g, r1 - r0, c1 - c0)
        if spec.bias is not None:
            per_head += geo.mask_tile(spec, spec.bias, u.b, u.heads, r0, r1, c0, c1)
        if self.slopes is not None:
            self.kern.alibi_tile(per_head, np.ascontiguousarray(self.slopes[u.b][u.heads]), r0, c0, u.seg.sigma)
        index = partial and not fused
        if self.masked or index:
            ex = geo.tile_excluded(spec, u.seg, u.b, u.heads, r0, r1, c0, c1, index=index)
            if ex is not None:
                np.copyto(per_head, -np.inf, where=ex)

    def streams(self, u: Unit, r0: int, r1: int) -> bool:
        """Whether rows [r0, r1) of unit u take the streaming decode kernel."""
        return self.stream and u.g * (r1 - r0) <= DECODE_ROWS

    def cache_rows(self, u: Unit) -> tuple[Any, Any, np.ndarray, int, int]:
        """(k, v, table, row, P) for the streaming kernel: key p of the unit's sequence
        is ``k[table[row, p // P], hk, p % P]`` (a dense array is one page)."""
        if self.pages is not None:
            k_pages, v_pages, table, P = self.pages
            return k_pages, v_pages, table, u.b[0], P
        assert self.v is not None
        k, v = self.k[u.b][None], self.v[u.b][None]
        return k, v, np.zeros((1, 1), dtype=np.int64), 0, k.shape[-2]

    def bounds(self, u: Unit, r0: int, r1: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-row key bounds of rows [r0, r1) repeated for every head of the unit (the
        bounded softmax's lo, hi)."""
        def make() -> tuple[np.ndarray, np.ndarray]:
            lo, hi = geo.row_key_bounds(u.seg, self.band, r0, r1)
            return np.tile(lo, u.nk * u.g), np.tile(hi, u.nk * u.g)
        return self._kept(("bounds", u.seg, u.nk, u.g, r0, r1), make)

    def dropout(self, p: np.ndarray, u: Unit, r0: int, r1: int, c0: int) -> None:
        """p (nk, g·rows, keys) ← dropout(p), in place."""
        if self.drop_thr:
            r, c = self.spec.origin                      # a block of a larger problem: global positions
            self.kern.dropout_tile(p.reshape(u.nk * u.g, r1 - r0, -1), self.flat_heads(u), r0 + r, c0 + c,
                                   philox.int64(int(self.spec.seed)), self.drop_thr, self.drop_scale)
