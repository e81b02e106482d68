"""The flash rung's plan: operands taken in place when they can be, and decoding units
that read each kv head once for its whole GQA group."""

import numpy as np
import pytest

import attnkit
from attnkit import flash
from attnkit.flash import forward, plan
from attnkit.spec import validate
from attnkit.testing import make_qkv
from cases import peak_bytes


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
    zero = np.lib.stride_tricks.as_strided(a, shape=(2, 1, 4), strides=(a.strides[0], 0, 4))
    assert plan.tile_ready(zero, np.float32) is zero    # a single row: any row stride, even 0


@pytest.mark.parametrize("view", ["(B, S, H, D) as (B, H, S, D)", "one column", "first columns"])
def test_tile_ready_takes_rows_apart_in_place(view):
    """Rows of unit stride that lie further apart than a row (BLAS's leading dimension)
    are read in place: transformers' query, key and value views cost no copy."""
    a = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4)
    x = {"(B, S, H, D) as (B, H, S, D)": a.transpose(0, 2, 1, 3), "one column": a[..., :1],
         "first columns": a[..., :3]}[view]
    got = plan.tile_ready(x, np.float32)
    assert np.shares_memory(got, a) and np.array_equal(got, x)


def test_tile_ready_copies_rows_that_overlap_or_are_misaligned():
    """Rows closer than a row apart, or a row stride that is not a whole number of
    elements: BLAS cannot read them in place, so they are copied (same values)."""
    a = np.arange(40, dtype=np.float32)
    overlap = np.lib.stride_tricks.as_strided(a, shape=(2, 3, 4), strides=(48, 8, 4))   # rows 2 elements apart
    buf = np.zeros(2 * 3 * 18 + 16, dtype=np.uint8)
    odd = np.ndarray((2, 3, 4), dtype=np.float32, buffer=buf, strides=(54, 18, 4))        # rows 18 bytes apart
    odd[...] = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    for x in (overlap, odd):
        got = plan.tile_ready(x, np.float32)
        assert not np.shares_memory(got, x) and got.flags.c_contiguous and np.array_equal(got, x)


@pytest.mark.parametrize("view", ["transposed", "strided columns", "transposed, one head", "float64"])
def test_tile_ready_copies_everything_else_to_c_order(view):
    a = np.arange(3 * 4 * 6, dtype=np.float32).reshape(3, 4, 6)
    x = {"transposed": a.transpose(0, 2, 1), "strided columns": a[..., ::2],
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


def _tile_cover(q_shape, k_shape, backward, **kw):
    """How many tiles of the default plan cover each (row, key) of the first head: the
    forward's tiles, or the backward's (query row blocks per key block)."""
    q, k = np.zeros(q_shape, np.float32), np.zeros(k_shape, np.float32)
    spec = validate(q, k, k, **kw)
    call = plan.Call(spec, None, None, backward=backward)
    cover = np.zeros((q_shape[-2], k_shape[-2]), np.int64)
    for u in call.units:
        if u.h0 != 0:
            continue
        if backward:
            for c0 in range(u.seg.k0, u.seg.k1, call.BLOCK_N):
                c1 = min(c0 + call.BLOCK_N, u.seg.k1)
                for r0, r1, _ in call.query_tiles(u, c0, c1):
                    cover[r0:r1, c0:c1] += 1
        else:
            for r0, r1 in call.row_blocks(u):
                for a0, a1, c0, c1, _ in call.tiles(u, r0, r1):
                    cover[a0:a1, c0:c1] += 1
    return cover


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
@pytest.mark.parametrize("case", ["causal", "causal L<S", "window", "window 256", "packed causal", "padded"])
def test_tiles_cover_every_visible_pair_once_and_little_else(case, backward):
    """Each (row, key) a query sees lies in exactly one tile, forward and backward;
    tiles the band or a sequence's end excludes are skipped, and the forward's row
    strips along the diagonal keep the computed area within a few percent of the
    visible pairs (causal costs about half of full)."""
    L, S, kw = 4096, 4096, dict(causal=True)
    # the computed area over the visible pairs, at most (the backward has no strips)
    budget = {"causal": (1.04, 1.07), "causal L<S": (1.03, 1.10), "window": (1.45, 2.5), "window 256": (1.5, 2.0),
              "packed causal": (1.10, 1.17), "padded": (1.0, 1.0)}[case][backward]
    i = np.arange(L)[:, None]
    j = np.arange(S)[None]
    if case == "causal":
        vis = j <= i
    elif case == "causal L<S":
        L = 1500
        i = np.arange(L)[:, None]
        vis = j <= i + S - L                             # bottom-right
    elif case.startswith("window"):                     # 256: the band's edges on tile edges
        w = 256 if case == "window 256" else 300
        kw = dict(window=(w, 0))
        vis = (j <= i) & (j >= i - w)
    elif case == "packed causal":
        cu = np.array([0, 700, 2000, 2100, 4096])
        kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        seq = np.searchsorted(cu, np.arange(L), side="right")
        vis = (seq[:, None] == seq[None]) & (j <= i)
    else:
        kw = dict(kv_lengths=np.array([1000]))
        vis = np.broadcast_to(j < 1000, (L, S))
    shape = (1, L, 64) if case == "packed causal" else (1, 1, L, 64)
    cover = _tile_cover(shape, (1, S, 64) if case == "packed causal" else (1, 1, S, 64), backward, **kw)
    assert (cover[vis] == 1).all() and cover.max() == 1
    assert cover.sum() <= budget * vis.sum()


def test_few_rows_against_many_keys_use_one_tiles_worth_of_scratch():
    """Few query rows get wider key tiles, but a task's scratch stays one default
    tile (BLOCK_M × BLOCK_N elements): memory never grows with the key count."""
    q = np.ones((1, 1, 8, 64))
    k = np.ones((1, 1, 1 << 17, 64))
    spec = validate(q, k, k)
    call = plan.Call(spec, None, None)
    u = call.units[0]
    (r0, r1), = call.row_blocks(u)
    assert call.key_block(u, r0, r1) > call.BLOCK_N                   # wider than a full-height tile
    assert call.tile_buffer(u, r0, r1).size <= call.BLOCK_M * call.BLOCK_N
    _, peak = peak_bytes(lambda: flash.rung_forward(spec))
    assert peak < 4 * call.BLOCK_M * call.BLOCK_N * 8                 # float64: a few tiles at most


def test_decoding_copies_a_strided_cache_once_and_a_broadcast_one_never(monkeypatch):
    """The streaming decode kernel reads each sequence in C order: keys and values of
    a (B, S, Hkv, D) layout seen as (B, Hkv, S, D) are copied once per call (not once
    per kv head or split-KV part), a cache broadcast over the batch is read in place;
    both give the bits of the C-ordered cache."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 8, 1, 32), dtype=np.float32)
    k = rng.standard_normal((2, 4, 6000, 32), dtype=np.float32)
    v = rng.standard_normal((2, 4, 6000, 32), dtype=np.float32)
    strided = [np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2) for x in (k, v)]
    one = [np.broadcast_to(x[:1], x.shape) for x in (k, v)]
    want = {"strided": attnkit.attention(q, k, v, backend="flash"),
            "broadcast": attnkit.attention(q, *(np.ascontiguousarray(x) for x in one), backend="flash")}
    copy, copied = np.ascontiguousarray, []

    def counting(x, *a, **kw):
        x = np.asarray(x)
        if not x.flags.c_contiguous:
            copied.append(x.nbytes)
        return copy(x, *a, **kw)

    monkeypatch.setattr(np, "ascontiguousarray", counting)
    for name, (kk, vv) in {"strided": strided, "broadcast": one}.items():
        copied.clear()
        assert np.array_equal(attnkit.attention(q, kk, vv, backend="flash"), want[name])
        assert sum(copied) <= {"strided": k.nbytes + v.nbytes, "broadcast": 0}[name], (name, copied)


@pytest.mark.parametrize("loop", [False, True])
def test_the_forward_checks_products_not_values(monkeypatch, loop):
    """The forward's NaN/inf check reads each tile's p v (hot, just made), never the
    values themselves (reading them again per strip cost 2–3% of a causal call, and a
    KV cache's read doubles what decoding reads), and it still finds a NaN value — in
    the Python loop and in the compiled one (kernels' tile_tasks), which checks its
    products itself."""
    monkeypatch.setattr(flash.kernels, "USE_LOOP", loop)
    seen = []
    real = forward.all_finite
    monkeypatch.setattr(forward, "all_finite", lambda *xs: seen.extend(xs) or real(*xs))
    q, k, v = make_qkv((1, 2, 2048, 64), (1, 2, 2048, 64), dtype="float32", seed=1)
    with flash.threads(1):
        flash.rung_forward(validate(q, k, v, causal=True))
    assert not any(np.shares_memory(x, v) for x in seen)
    assert all(x.shape[-1] == v.shape[-1] and x.shape[-2] <= 1024 for x in seen)
    assert bool(seen) != (loop and flash.compiled_kernels().tile_tasks is not None)
    v[0, 1, 100, 3] = np.nan
    out, _, _ = flash.rung_forward(validate(q, k, v, causal=True))
    assert np.isnan(out[0, 1, 100:, 3]).all() and np.isfinite(out[0, 1, :100]).all()


def test_small_plans_are_kept_across_calls_and_large_ones_per_call(monkeypatch):
    """A model repeats its geometry in every layer: the second call of a geometry plans
    nothing again; a change of band or tile sizes plans anew (the key holds them), and a
    plan over KEPT_SIZE entries is kept for its call only."""
    made = []
    real = plan.Call._flat_tiles
    monkeypatch.setattr(plan.Call, "_flat_tiles", lambda self, *a: made.append(a) or real(self, *a))
    monkeypatch.setattr(plan, "_KEPT", {})
    q, k, v = make_qkv((2, 4, 300, 16), (2, 2, 300, 16), dtype="float32", seed=3)
    first = flash.rung_forward(validate(q, k, v, causal=True))[0]
    n = len(made)
    assert n > 0 and np.array_equal(flash.rung_forward(validate(q, k, v, causal=True))[0], first)
    assert len(made) == n                                # kept
    flash.rung_forward(validate(q, k, v, causal=True, window=(50, 0)))
    flash.rung_forward(validate(q, k, v, causal=True), block_m=128, block_n=64)
    assert len(made) >= n + 2                            # another band, other tiles: planned anew
    monkeypatch.setattr(plan, "KEPT_SIZE", 0)
    monkeypatch.setattr(plan, "_KEPT", {})
    made.clear()
    flash.rung_forward(validate(q, k, v, causal=True))
    flash.rung_forward(validate(q, k, v, causal=True))
    assert len(made) == 2 * n                            # not kept across calls, each made once per call


def test_units_kept_across_calls_are_those_of_each_call(monkeypatch):
    """Units are kept across calls under everything they are made from: specs that
    differ in one of those things, planned one after another, each get the units a
    fresh plan makes (a key that left one out would hand a call another's units)."""
    from attnkit.flash import plan
    q, k, v = make_qkv((2, 4, 96, 16), (2, 2, 120, 16), dtype="float32")
    base = dict(causal=True)
    specs = [validate(q, k, v, **base), validate(q, k, v, kv_lengths=np.array([120, 50]), **base),
             validate(q, k, v, kv_lengths=np.array([120, 51]), **base),
             validate(q, k, v, kv_lengths=np.array([120, 51]), q_lengths=np.array([96, 3]), **base),
             validate(q, k, v, kv_lengths=np.array([120, 51]), align="top_left", **base),
             validate(q[:1], k[:1], v[:1], **base), validate(q[:, :2], k[:, :1], v[:, :1], **base),
             validate(q[0], k[0], v[0], cu_seqlens_q=np.array([0, 40, 96]), cu_seqlens_k=np.array([0, 60, 120]),
                      **base),
             validate(q[0], k[0], v[0], cu_seqlens_q=np.array([0, 41, 96]), cu_seqlens_k=np.array([0, 60, 120]),
                      **base),
             validate(q, k, v, **base).replace(origin=(96, 0), extent=(192, 240)),
             validate(q, k, v, **base).replace(origin=(0, 120), extent=(192, 240)),
             validate(q, k, v, bias=np.zeros((96, 120)), **base)]              # the backward splits its heads
    runs = [(s, backward) for s in specs for backward in (False, True)]
    kept = [plan.Call(s, None, None, backward=backward).units for s, backward in runs + runs]
    monkeypatch.setattr(plan, "_KEPT", {})
    fresh = []
    for s, backward in runs:
        plan._KEPT.clear()
        fresh.append(plan.Call(s, None, None, backward=backward).units)
    assert kept == fresh + fresh and fresh[-1] != fresh[-2]
    assert plan.Call(specs[1], 64, 64).units != plan.Call(specs[1], None, None).units   # tile sizes count
    # the same tile sizes both ways: only the direction tells the bias's units apart
    assert plan.Call(specs[-1], 256, 256).units != plan.Call(specs[-1], 256, 256, backward=True).units


def test_forward_plans_kept_across_calls_are_those_of_each_call(monkeypatch):
    """The forward's blocks, tasks and task table are kept with the units: after calls
    of many geometries, each call's kept plan is the one a fresh plan makes, and its
    results are the fresh plan's, bit for bit."""
    from attnkit.flash import forward
    q, k, v = make_qkv((2, 4, 96, 16), (2, 2, 1200, 16), dtype="float32", seed=5)
    specs = [validate(q, k, v, causal=True), validate(q, k, v), validate(q, k, v, window=(40, 3)),
             validate(q, k, v, kv_lengths=np.array([1200, 50])), validate(q, k, v, kv_lengths=np.array([1200, 51])),
             validate(q, k, v, q_lengths=np.array([96, 7]), kv_lengths=np.array([1200, 51]), causal=True),
             validate(q[:1], k[:1], v[:1]), validate(q[:, :2], k[:, :1], v[:, :1]), validate(q, k[:1], v[:1]),
             validate(q[:1], k, v[1:]),
             validate(q[:, :, :3], k, v), validate(q[:, :, :1], k, v), validate(q[:, :1, :1], k[:, :1], v[:, :1]),
             validate(q[0], k[0], v[0], cu_seqlens_q=np.array([0, 40, 96]), cu_seqlens_k=np.array([0, 600, 1200]))]
    runs = [(s, bm) for s in specs for bm in (None, 32)]
    kept = [flash.rung_forward(s, block_m=bm, block_n=bm)[:2] for s, bm in runs + runs]
    plans = []
    for s, bm in runs:
        call = plan.Call(s, bm, bm)
        plans.append(call.kept_for_units(("forward", plan.MIN_SPLIT), lambda: pytest.fail("not kept")))
    monkeypatch.setattr(plan, "_KEPT", {})
    for (s, bm), got, (out, lse) in zip(runs, plans, kept[len(runs):]):
        plan._KEPT.clear()
        assert got == forward._plan(plan.Call(s, bm, bm))
        fresh = flash.rung_forward(s, block_m=bm, block_n=bm)
        assert np.array_equal(fresh[0], out, equal_nan=True) and np.array_equal(fresh[1], lse)
