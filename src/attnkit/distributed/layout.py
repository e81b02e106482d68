"""Where each rank's part of the sequence lies, and which blocks of the global problem
a rank computes: ``shard`` / ``unshard`` in the contiguous and zigzag layouts, and
``plan`` (the :class:`Block` list for one query shard and one key shard).

Layouts, shown for P = 2 ranks and a sequence cut into 4 chunks::

    contiguous   rank 0: chunks 0 1        rank 1: chunks 2 3
    zigzag       rank 0: chunks 0 3        rank 1: chunks 1 2
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from attnkit.spec import band, check_layout, check_world
from attnkit.spec.geometry import Segment, key_range, query_range


# ---------------------------------------------------------------------------
# sharding helpers
# ---------------------------------------------------------------------------
def _chunk_ids(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """Which of the 2·world equal chunks of the sequence rank ``rank`` holds."""
    if layout == "contiguous":
        return (2 * rank, 2 * rank + 1)
    check_layout(layout)
    return (rank, 2 * world - 1 - rank)


def shard(x: torch.Tensor, rank: int, world: int, *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` (length N along ``dim``).

    ``contiguous``: the rank-th of ``world`` equal pieces. ``zigzag``: the sequence
    is cut into 2·world chunks and rank r gets chunks r and 2·world−1−r, concatenated.
    N must be divisible by ``world`` (by ``2·world`` for zigzag); the result is a
    view for contiguous and a new tensor for zigzag.

    Parameters
    ----------
    x : torch.Tensor
        The full sequence (any shape; the sequence along ``dim``).
    rank, world : int
        This rank and the number of ranks.
    layout : str
        "contiguous" or "zigzag".
    dim : int
        The sequence dimension.

    Examples
    --------
    >>> import torch
    >>> x = torch.arange(8)
    >>> shard(x, 0, 2, dim=0), shard(x, 0, 2, layout="zigzag", dim=0)
    (tensor([0, 1, 2, 3]), tensor([0, 1, 6, 7]))
    """
    check_world(rank, world)
    check_layout(layout)
    n = x.shape[dim]
    parts = 2 * world if layout == "zigzag" else world
    if n % parts:
        raise ValueError(f"x: length {n} along dim {dim} is not divisible by {parts} "
                         f"({'2 · ' if layout == 'zigzag' else ''}world={world}) for layout={layout!r}")
    if layout == "contiguous":
        return x.narrow(dim, rank * (n // world), n // world)
    c = n // parts
    a, b = _chunk_ids(rank, world, layout)
    return torch.cat([x.narrow(dim, a * c, c), x.narrow(dim, b * c, c)], dim=dim)


def unshard(parts: Iterable[torch.Tensor], *, layout: str = "contiguous", dim: int = -2) -> torch.Tensor:
    """Reassemble the full sequence from every rank's shard, in rank order (the list
    ``torch.distributed.all_gather`` fills). Inverse of :func:`shard`.

    Parameters
    ----------
    parts : iterable of torch.Tensor
        Every rank's shard, in rank order.
    layout : str
        "contiguous" or "zigzag" (as the shards were cut).
    dim : int
        The sequence dimension.

    Examples
    --------
    >>> import torch
    >>> x = torch.arange(8)
    >>> unshard([shard(x, r, 2, layout="zigzag", dim=0) for r in range(2)], layout="zigzag", dim=0)
    tensor([0, 1, 2, 3, 4, 5, 6, 7])
    """
    parts = list(parts)
    check_layout(layout)
    if layout == "contiguous":
        return torch.cat(parts, dim=dim)
    world = len(parts)
    chunks: list[Any] = [None] * (2 * world)
    for r, p in enumerate(parts):
        if p.shape[dim] % 2:
            raise ValueError(f"parts[{r}]: zigzag shard length {p.shape[dim]} along dim {dim} is odd")
        a, b = _chunk_ids(r, world, layout)
        chunks[a], chunks[b] = p.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = -2) -> torch.Tensor:
    """``shard(x, rank, world, layout="zigzag", dim=dim)``: chunks r and 2·world−1−r.

    Parameters
    ----------
    x : torch.Tensor
        The full sequence.
    rank, world : int
        This rank and the number of ranks.
    dim : int
        The sequence dimension.
    """
    return shard(x, rank, world, layout="zigzag", dim=dim)


def zigzag_unshard(parts: Iterable[torch.Tensor], dim: int = -2) -> torch.Tensor:
    """``unshard(parts, layout="zigzag", dim=dim)``.

    Parameters
    ----------
    parts : iterable of torch.Tensor
        Every rank's zigzag shard, in rank order.
    dim : int
        The sequence dimension.
    """
    return unshard(parts, layout="zigzag", dim=dim)


# ---------------------------------------------------------------------------
# block planning: which part of a (query shard, key shard) pair is visible
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One block of the global problem: local query rows [r0, r1) of the rank's shard
    against keys [c0, c1) of the key shard in hand, whose first row and key sit at
    global positions (gr, gc). The rung computes it with the global positions
    (``Spec.origin``), so causal, window, ALiBi, key lengths and dropout are those of
    the whole sequence; rows or keys the band hides entirely are cropped away."""

    r0: int
    r1: int
    c0: int
    c1: int
    gr: int
    gc: int


def _segments(rank, world, n, layout):
    """(global start, local start, length) of each contiguous piece of a shard of
    length n."""
    if layout == "contiguous":
        return ((rank * n, 0, n),)
    c = n // 2
    a, b = _chunk_ids(rank, world, layout)
    return ((a * c, 0, c), (b * c, c, c))


def _plan_pair(gq, lq, m, gk, lk, n, sigma, b):
    """Block for query rows [gq, gq+m) (global) stored at local lq, against keys
    [gk, gk+n) stored at local lk, under the band b with the global diagonal
    diag(i) = i + sigma: cropped to the rows and keys that see anything (the rungs'
    own rule, :mod:`attnkit.spec.geometry`). None if empty."""
    seg = Segment(gq, gq + m, gk, gk + n, sigma)
    r0, r1 = query_range(seg, b, gk, gk + n)
    if r0 >= r1:
        return None
    c0, c1 = key_range(seg, b, r0, r1)
    if c0 >= c1:
        return None
    return Block(lq + r0 - gq, lq + r1 - gq, lk + c0 - gk, lk + c1 - gk, r0, c0)


def _coalesce(blocks):
    """Join blocks over the same keys whose rows touch (locally and globally), then
    blocks over the same rows whose keys touch, so a step is one call where it can be."""
    out = []
    for b in sorted(blocks, key=lambda b: (b.c0, b.c1, b.r0)):
        p = out[-1] if out else None
        if p is not None and (p.c0, p.c1, p.gc) == (b.c0, b.c1, b.gc) and p.r1 == b.r0 and p.gr + p.r1 - p.r0 == b.gr:
            out[-1] = Block(p.r0, b.r1, p.c0, p.c1, p.gr, p.gc)
        else:
            out.append(b)
    joined = []
    for b in sorted(out, key=lambda b: (b.r0, b.r1, b.c0)):
        p = joined[-1] if joined else None
        if p is not None and (p.r0, p.r1, p.gr) == (b.r0, b.r1, b.gr) and p.c1 == b.c0 and p.gc + p.c1 - p.c0 == b.gc:
            joined[-1] = Block(p.r0, p.r1, p.c0, b.c1, p.gr, p.gc)
        else:
            joined.append(b)
    return joined


def plan(rank: int, src: int, world: int, Lr: int, Sr: int, *, L: int | None = None, S: int | None = None,
         causal: bool = False, window: tuple[int | None, int | None] | None = None, align: str = "bottom_right",
         layout: str = "contiguous") -> list[Block]:
    """The attention calls rank ``rank`` makes for the key shard of rank ``src``:
    a list of :class:`Block` (empty when causal/window hide that shard entirely).

    Parameters
    ----------
    rank, src : int
        The rank whose queries, and the rank whose key shard is in hand.
    world : int
        Ranks in the ring.
    Lr, Sr : int
        Query and key shard lengths.
    L, S : int, optional
        Global lengths (default world·Lr, world·Sr).
    causal, window, align
        As for :func:`attnkit.attention`, in global positions.
    layout : str
        "contiguous" or "zigzag".

    Examples
    --------
    Causal blocks in the contiguous layout, P = 2:

    >>> plan(1, 0, 2, 4, 4, causal=True)        # keys before the queries: all visible
    [Block(r0=0, r1=4, c0=0, c1=4, gr=4, gc=0)]
    >>> plan(0, 0, 2, 4, 4, causal=True)        # the diagonal block
    [Block(r0=0, r1=4, c0=0, c1=4, gr=0, gc=0)]
    >>> plan(0, 1, 2, 4, 4, causal=True)        # keys after the queries: skipped
    []
    """
    L = world * Lr if L is None else L
    S = world * Sr if S is None else S
    sigma = Segment.of(0, L, 0, S, align).sigma
    bd = band(causal, window)
    qsegs, ksegs = _segments(rank, world, Lr, layout), _segments(src, world, Sr, layout)
    blocks = [b for gq, lq, m in qsegs for gk, lk, n in ksegs
              if (b := _plan_pair(gq, lq, m, gk, lk, n, sigma, bd)) is not None]
    return _coalesce(blocks)
