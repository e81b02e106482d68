"""The flash rung's plan: operands taken in place when they can be, and decoding units
that read each kv head once for its whole GQA group."""

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.flash import plan


def test_tile_ready_takes_c_ordered_tiles_in_place():
    """Last two dims C-contiguous in the dtype: the same memory, broadcast batch dims
    kept (no copy of a cache); a single row may have any row stride."""
    a = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)
    assert plan.tile_ready(a, np.float32) is a
    wide = np.broadcast_to(a[None], (5, 2, 3, 4))
    got = plan.tile_ready(wide, np.float32)
    assert got.strides[0] == 0 and np.shares_memory(got, a)
    one_row = a[:, :1, :2]                               # row stride 16 bytes, rows of 8
    assert one_row.strides[-2] != one_row.shape[-1] * 4
    assert np.shares_memory(plan.tile_ready(one_row, np.float32), a)


@pytest.mark.parametrize("view", ["transposed", "strided columns", "one column", "transposed, one head",
                                  "float64"])
def test_tile_ready_copies_everything_else_to_c_order(view):
    a = np.arange(3 * 4 * 6, dtype=np.float32).reshape(3, 4, 6)
    x = {"transposed": a.transpose(0, 2, 1), "strided columns": a[..., ::2], "one column": a[..., :1],
         "transposed, one head": a[:1].transpose(0, 2, 1), "float64": a.astype(np.float64)}[view]
    got = plan.tile_ready(x, np.float32)
    assert got.dtype == np.float32 and got.flags.c_contiguous and np.array_equal(got, x)
    assert not np.shares_memory(got, a)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("L", [1, 3])
def test_decoding_units_read_each_kv_head_once_for_its_group(paged, L, monkeypatch):
    """The query heads of a GQA group are one unit's rows, and the units cover every
    (sequence, kv head) exactly once: each cached key is read once per step."""
    B, H, Hkv, S, D, P = 2, 8, 2, 64, 16, 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, L, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    lengths = np.array([40, 64])
    kw = {}
    if paged:
        table = rng.permutation(B * S // P).reshape(B, S // P)
        kp = np.empty((B * S // P, Hkv, P, D), np.float32)
        vp = np.empty_like(kp)
        kp[table.reshape(-1)] = k.reshape(B, Hkv, S // P, P, D).transpose(0, 2, 1, 3, 4).reshape(-1, Hkv, P, D)
        vp[table.reshape(-1)] = v.reshape(B, Hkv, S // P, P, D).transpose(0, 2, 1, 3, 4).reshape(-1, Hkv, P, D)
        k, v, kw = kp, vp, dict(block_table=table)
    seen = []
    forward = flash._forward.forward

    def spy(call, *args):
        seen.extend(call.units)
        return forward(call, *args)

    monkeypatch.setattr(flash._forward, "forward", spy)
    attnkit.attention_kvcache(q, k, v, lengths, backend="flash", **kw)
    group = H // Hkv
    covered = []
    for u in seen:
        assert u.g == group and u.h0 % group == 0
        covered += [(u.b, u.h0 // group + a) for a in range(u.nk)]
    assert sorted(covered) == sorted(((b,), hk) for b in range(B) for hk in range(Hkv))
