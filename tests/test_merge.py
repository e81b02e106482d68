"""merge: attention over disjoint key blocks combined by lse equals attention over all
keys (NumPy arrays and torch tensors); fully masked rows and NaN blocks."""

import numpy as np
import pytest

import attnkit
from attnkit.testing import make_qkv, max_error


@pytest.mark.parametrize("seed", range(6))
def test_merge_of_random_key_blocks_is_the_whole(seed):
    """Split keys into random disjoint blocks, attend to each, merge: the full result
    (NumPy arrays and torch tensors). Rows fully masked inside a block have lse -inf."""
    rng = np.random.default_rng(seed)
    L, S = 11, int(rng.integers(5, 40))
    q, k, v = make_qkv((2, 3, L, 8), (2, 3, S, 8), 5, seed=seed)
    keep = rng.random((L, S)) < 0.6
    keep[0] = False                                      # masked in every block
    cuts = np.sort(rng.choice(np.arange(1, S), size=min(3, S - 1), replace=False))
    edges = [0, *cuts.tolist(), S]
    parts = [attnkit.attention(q, k[..., a:b, :], v[..., a:b, :], keep=keep[:, a:b], return_lse=True,
                               backend="flash") for a, b in zip(edges[:-1], edges[1:])]
    whole, whole_lse = attnkit.attention(q, k, v, keep=keep, return_lse=True, backend="reference")
    out, lse = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    assert max_error(out, whole) <= 1e-12 and max_error(lse, whole_lse) <= 1e-12
    assert np.all(out[..., 0, :] == 0) and np.all(lse[..., 0] == -np.inf)
    torch = pytest.importorskip("torch")
    tout, tlse = attnkit.merge([torch.tensor(p[0]) for p in parts], [torch.tensor(p[1]) for p in parts])
    assert max_error(tout.numpy(), whole) <= 1e-12 and max_error(tlse.numpy(), whole_lse) <= 1e-12


def test_a_nan_block_makes_its_rows_nan():
    out = [np.ones((2, 3)), np.zeros((2, 3))]
    lse = [np.array([0.0, np.nan]), np.array([0.0, 0.0])]
    o, l = attnkit.merge(out, lse)
    assert np.isfinite(o[0]).all() and np.isnan(o[1]).all() and np.isnan(l[1])


def test_one_block_is_itself_and_far_apart_blocks_do_not_overflow():
    """merge of one block returns it; blocks whose lse are 1000 apart (exp would
    overflow without the running max) weigh 1 and 0; huge equal lse stay exact."""
    rng = np.random.default_rng(3)
    o1, o2 = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 4, 3))
    l1 = rng.standard_normal((2, 4))
    o, lse = attnkit.merge([o1], [l1])
    assert max_error(o, o1) <= 1e-15 and max_error(lse, l1) <= 1e-15
    o, lse = attnkit.merge([o1, o2], [l1 + 1000.0, l1])
    assert max_error(o, o1) <= 1e-15 and max_error(lse, l1 + 1000.0) <= 1e-12
    big = np.full((2, 4), 1e4)
    o, lse = attnkit.merge([o1, o2], [big, big])
    assert max_error(o, (o1 + o2) / 2) <= 1e-15 and max_error(lse, big + np.log(2)) <= 1e-12


def test_torch_one_block_and_far_apart_blocks():
    """The torch path as the NumPy one: one block is itself (in its dtype), blocks 1000
    apart in lse weigh 1 and 0 whichever comes first, and the merge is differentiable."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    o1, o2 = (torch.tensor(rng.standard_normal((2, 4, 3))) for _ in range(2))
    l1 = torch.tensor(rng.standard_normal((2, 4)))
    o, lse = attnkit.merge([o1.float()], [l1])
    assert o.dtype == torch.float32 and torch.equal(o, o1.float()) and torch.allclose(lse, l1)
    for first in (True, False):
        outs, lses = [o1, o2], [l1 + 1000.0, l1]
        if not first:
            outs, lses = outs[::-1], lses[::-1]
        o, lse = attnkit.merge(outs, lses)
        assert torch.isfinite(o).all() and max_error(o.numpy(), o1.numpy()) <= 1e-15
        assert max_error(lse.numpy(), (l1 + 1000.0).numpy()) <= 1e-12


def test_numpy_scalar_lses_and_an_infinite_lse():
    """lse of a 1-row block indexed out is a NumPy scalar: merged as a 0-d array; an
    +inf lse makes the row NaN without a warning (the tests turn warnings into errors)."""
    o, lse = attnkit.attention(np.eye(2)[:1], np.eye(2), np.eye(2), return_lse=True)
    out, l2 = attnkit.merge([o[0], o[0]], [lse[0], lse[0]])
    assert np.allclose(out, o[0]) and np.isclose(l2, lse[0] + np.log(2))
    out, l2 = attnkit.merge([o, o], [np.array([np.inf]), lse])
    assert np.isnan(out).all() and np.isnan(l2).all()
