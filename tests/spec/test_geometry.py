"""Mask geometry: the band rule row by row, tiles, sequences (lengths and packed),
and the whole-array masks against masks built independently with tril/triu."""

import numpy as np
import pytest

from attnkit.spec import geometry as geo
from attnkit.spec import validate
from attnkit.testing import make_qkv


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
