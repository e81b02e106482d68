"""Mask geometry: the band rule row by row, tiles, sequences (lengths and packed),
and the whole-array masks against masks built independently with tril/triu."""

import numpy as np
import pytest

from attnkit.spec import geometry as geo
from attnkit.spec import validate
from attnkit.testing import make_qkv, max_error


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("L, S", [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(2, 1)), dict(window=(None, 3)),
                                  dict(window=(0, None)), dict(causal=True, window=(3, 2))])
def test_row_key_bounds_is_the_index_rule_row_by_row(mask, L, S, align):
    spec = validate(*make_qkv((L, 4), (S, 4), seed=0), align=align, **mask)
    seg = geo.segments(spec, ())[0]
    b = geo.band(spec.causal, spec.window)
    lo, hi = geo.row_key_bounds(seg, b, 0, L)
    assert lo.dtype == hi.dtype == np.int64 and np.all(lo <= hi)
    for r in range(L):
        assert (lo[r], hi[r]) == geo.key_range(seg, b, r, r + 1)
    keep = geo.index_visible(spec)[0]
    cols = np.arange(S)
    assert np.array_equal(keep, (cols >= lo[:, None]) & (cols < hi[:, None]))
    sub = geo.row_key_bounds(seg, b, 2, min(L, 5))
    assert all(np.array_equal(a[2:5], s) for a, s in zip((lo, hi), sub))
    for c0 in range(S):                                   # query_range is key_range's inverse
        for c1 in range(c0 + 1, S + 1):
            r0, r1 = geo.query_range(seg, b, c0, c1)
            sees = keep[:, c0:c1].any(axis=1)
            assert np.array_equal(sees, (np.arange(L) >= r0) & (np.arange(L) < r1)), (c0, c1)


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_index_visible_matches_tril_triu(align):
    torch = pytest.importorskip("torch")
    from peers import torch_index_keep
    for L, S in [(4, 9), (9, 4), (6, 6)]:
        for kw in (dict(causal=True), dict(window=(2, 1)), dict(causal=True, window=(1, None))):
            spec = validate(*make_qkv((L, 4), (S, 4), seed=0), align=align, **kw)
            want = torch_index_keep(L, S, spec.causal, spec.window, align).numpy()
            assert np.array_equal(geo.index_visible(spec)[0], want)
    assert torch


def test_lengths_align_per_sequence_and_pad_rows():
    """Sequence b sees keys [0, kv_len[b]); bottom-right puts its last query on its
    last key; rows past q_len[b] see nothing."""
    q, k, v = make_qkv((3, 1, 5, 4), (3, 1, 7, 4), seed=1)
    spec = validate(q, k, v, causal=True, q_lengths=np.array([5, 2, 0]), kv_lengths=np.array([7, 3, 4]))
    vis = np.broadcast_to(geo.index_visible(spec), (3, 1, 5, 7))
    assert np.array_equal(vis[0, 0], np.tri(5, 7, 2, dtype=bool))
    want = np.zeros((5, 7), bool)
    want[0, :2] = want[1, :3] = True                     # 2 queries on keys 0..2: diag = i + 1
    assert np.array_equal(vis[1, 0], want)
    assert not vis[2].any()
    assert np.array_equal(geo.padding_rows(spec)[..., 0, :], np.arange(5) >= np.array([[5], [2], [0]]))


def test_packed_sequences_are_block_diagonal():
    q, k, v = make_qkv((2, 6, 4), (2, 8, 4), seed=2)
    spec = validate(q, k, v, causal=True, cu_seqlens_q=np.array([0, 2, 2, 6]), cu_seqlens_k=np.array([0, 3, 4, 8]))
    vis = geo.index_visible(spec)
    want = np.zeros((6, 8), bool)
    want[0, :2] = True; want[1, :3] = True              # noqa: E702 — seq 0: 2 queries, 3 keys
    for i in range(4):                                   # seq 2: 4 queries on keys 4..7, square
        want[2 + i, 4:5 + i] = True
    assert np.array_equal(np.broadcast_to(vis, (6, 8)), want)     # seq 1 has no queries
    assert [(s.q0, s.q1, s.k0, s.k1) for s in geo.segments(spec, ())] == [(0, 2, 0, 3), (2, 6, 4, 8)]


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
# key_range, query_range and tile_partial decide which tiles are skipped or masked; a
# merely conservative answer (a tile called partial when it is whole, keys kept that no
# row sees) only costs time, so the rungs' results cannot tell. Here each is checked to
# be exact against the visibility matrix worked out pair by pair.
def _visible(seg, b, n_rows, n_keys):
    """(rows, keys) booleans: query i of seg sees key j, from the band rule itself."""
    i = np.arange(n_rows)[:, None]
    j = np.arange(n_keys)[None, :]
    left, right = b
    ok = (i >= seg.q0) & (i < seg.q1) & (j >= seg.k0) & (j < seg.k1)
    if left is not None:
        ok &= j >= i + seg.sigma - left
    if right is not None:
        ok &= j <= i + seg.sigma + right
    return ok


def _span(mask):
    idx = np.flatnonzero(mask)
    return (int(idx[0]), int(idx[-1]) + 1) if idx.size else None


@pytest.mark.parametrize("seed", range(4))
def test_tile_helpers_are_exact(seed):
    rng = np.random.default_rng(seed)
    n_rows, n_keys = 12, 14
    for _ in range(40):
        q0 = int(rng.integers(0, n_rows))
        q1 = int(rng.integers(q0 + 1, n_rows + 1))
        k0, k1 = sorted(rng.integers(0, n_keys + 1, 2))
        seg = geo.Segment.of(q0, q1, k0, k1, ["bottom_right", "top_left"][rng.integers(2)])
        b = (None if rng.random() < 0.3 else int(rng.integers(0, 4)),
             None if rng.random() < 0.3 else int(rng.integers(0, 4)))
        vis = _visible(seg, b, n_rows, n_keys)
        for r0 in range(seg.q0, seg.q1):
            for r1 in range(r0 + 1, seg.q1 + 1):
                lo, hi = geo.key_range(seg, b, r0, r1)
                want = _span(vis[r0:r1].any(axis=0))
                assert (lo, hi) == want if want else lo == hi, (seg, b, r0, r1)
        for c0 in range(0, n_keys + 1):
            for c1 in range(c0, n_keys + 1):
                lo, hi = geo.query_range(seg, b, c0, c1)
                want = _span(vis[:, c0:c1].any(axis=1))
                assert (lo, hi) == want if want else lo == hi, (seg, b, c0, c1)
        for _ in range(30):                               # tiles of seg's rows, keys anywhere
            r0, r1 = sorted(rng.integers(seg.q0, seg.q1 + 1, 2))
            c0, c1 = sorted(rng.integers(0, n_keys + 1, 2))
            if r0 == r1 or c0 == c1:
                continue
            assert geo.tile_partial(seg, b, r0, r1, c0, c1) == (not vis[r0:r1, c0:c1].all()), \
                (seg, b, r0, r1, c0, c1)


def _block_spec(spec, r0, r1, c0, c1):
    """Rows [r0, r1) against keys [c0, c1) of spec, placed in the whole problem the way
    ring attention builds its blocks (attnkit.distributed.ring._block_spec)."""
    from attnkit.spec import Spec
    return Spec.from_arrays(spec.q[..., r0:r1, :], spec.k[..., c0:c1, :], spec.v[..., c0:c1, :],
                            scale=spec.scale, causal=spec.causal, window=spec.window, align=spec.align,
                            alibi_slopes=spec.alibi_slopes, q_lengths=spec.q_lengths, kv_lengths=spec.kv_lengths,
                            dropout=spec.dropout, seed=spec.seed, origin=(r0, c0), extent=(spec.L, spec.S))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(2, 3), align="top_left"),
                                dict(causal=True, alibi_slopes=np.array([0.5, 0.25]), dropout=0.3, seed=5)],
                         ids=["causal", "window", "alibi_dropout"])
def test_blocks_of_a_larger_problem_are_its_pieces(kw):
    """Every (row block, key block) of a problem with per-sequence lengths, run as a
    block (origin, extent), merges over its key blocks into the whole's rows, and its
    gradients (from the whole's out and lse) add up to the whole's — on the reference
    and the flash rung. Row 5 starts a block exactly where sequence 1's queries end."""
    import attnkit
    from attnkit import flash, reference
    q, k, v = make_qkv((2, 2, 9, 4), (2, 1, 11, 4), 3, seed=3)
    spec = validate(q, k, v, q_lengths=np.array([9, 5]), kv_lengths=np.array([11, 6]), **kw)
    out, lse, _ = reference.rung_forward(spec)
    dout = np.random.default_rng(4).standard_normal(out.shape)
    whole = reference.rung_backward(spec, dout, out, lse)
    rows, keys = [(0, 5), (5, 9)], [(0, 4), (4, 8), (8, 11)]
    for rung, blocks in ((reference, {}), (flash, dict(block_m=2, block_n=3))):
        dk, dv = np.zeros_like(whole.dk), np.zeros_like(whole.dv)
        for r0, r1 in rows:
            parts, dq = [], 0
            for c0, c1 in keys:
                b = _block_spec(spec, r0, r1, c0, c1)
                parts.append(rung.rung_forward(b, **blocks)[:2])
                g = rung.rung_backward(b, dout[..., r0:r1, :], out[..., r0:r1, :], lse[..., r0:r1], **blocks)
                dq = dq + g.dq
                dk[..., c0:c1, :] += g.dk
                dv[..., c0:c1, :] += g.dv
            o, l = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
            assert max_error(o, out[..., r0:r1, :]) <= 1e-12 and max_error(l, lse[..., r0:r1]) <= 1e-12
            assert max_error(dq, whole.dq[..., r0:r1, :]) <= 1e-12
        assert max_error(dk, whole.dk) <= 1e-12 and max_error(dv, whole.dv) <= 1e-12
