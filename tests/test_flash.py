"""The flash rung against the rung below (the reference; float64 ≤ 1e-12, low
precision by the 2× rule of DESIGN.md §6), PyTorch autograd as a peer, merge over
random key blocks, weights from lse, determinism across thread counts, and linear
memory (tracemalloc)."""

import tracemalloc

import numpy as np
import pytest

import attnkit
from attnkit import flash, reference
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error

F = dict(backend="flash")
KERNELS = ["numpy"] + (["numba"] if flash.compiled_kernels() is not None else [])


@pytest.fixture(params=KERNELS)
def kernels(request, monkeypatch):
    """Runs a float32 test once on the NumPy tiles and once on the numba kernels."""
    monkeypatch.setattr(flash, "USE_COMPILED", request.param == "numba")
    return request.param


def random_case(seed, dtype="float64"):
    """One randomized case: shapes (L < S, L > S, 1, blocks that do not divide), GQA,
    D != Dv, broadcast batch dims, 2-D inputs, non-contiguous inputs, every mask kind
    alone and combined, both alignments, softcap; plus small block sizes."""
    rng = np.random.default_rng(seed)
    L, S = (int(x) for x in rng.choice([1, 2, 15, 40, 97], size=2))
    D = int(rng.choice([8, 59, 64]))
    Dv = int(rng.choice([D, 5, 12]))
    two_d = rng.random() < 0.1
    if two_d:
        q, k, v = make_qkv((L, D), (S, D), Dv, seed=seed)
        H = 1
    else:
        Hkv = int(rng.choice([1, 2]))
        H = Hkv * int(rng.choice([1, 2, 3]))
        batch_q = [(), (2,), (3, 1)][rng.integers(3)]
        batch_k = batch_q if rng.random() < 0.6 else (1,) * len(batch_q)
        q, k, v = make_qkv(batch_q + (H, L, D), batch_k + (Hkv, S, D), Dv, seed=seed)
        if rng.random() < 0.3:                           # a (..., L, H, D) layout seen as (..., H, L, D)
            q = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, -2, -3)), -2, -3)
    kw = {}
    kinds = rng.choice(["causal", "window", "keep", "drop", "bias"], size=rng.integers(0, 4), replace=False)
    if "causal" in kinds:
        kw["causal"] = True
    if "window" in kinds:
        kw["window"] = (int(rng.integers(0, 5)) if rng.random() < 0.8 else None,
                        int(rng.integers(0, 5)) if rng.random() < 0.8 else None)
    if "keep" in kinds:
        kw["keep"] = rng.random([(L, S), (H, L, S), (1, S)][rng.integers(3)]) < 0.8
    if "drop" in kinds:
        kw["drop"] = rng.random([(H, 1, S), (L, 1), (L, S)][rng.integers(3)]) < 0.2
    if "bias" in kinds:
        b = rng.standard_normal([(H, L, S), (S,), (L, 1), (L, S)][rng.integers(4)])
        b[rng.random(b.shape) < 0.1] = -np.inf
        kw["bias"] = b
    if ("causal" in kinds or "window" in kinds) and rng.random() < 0.5:
        kw["align"] = "top_left"
    if rng.random() < 0.2:
        kw["softcap"] = float(rng.uniform(0.5, 5))
    blocks = dict(block_m=int(rng.integers(1, 20)), block_n=int(rng.integers(1, 20)))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, kw, blocks


def both(spec, blocks, dout_seed=0, need_weights=True):
    """Forward and backward of flash and of the reference on one spec."""
    o1, l1, w1 = flash.rung_forward(spec, need_weights, **blocks)
    o0, l0, w0 = reference.rung_forward(spec, need_weights)
    dout = np.random.default_rng(dout_seed).standard_normal(o0.shape).astype(spec.dtype)
    g1 = flash.rung_backward(spec, dout, o0, l0, **blocks)
    g0 = reference.rung_backward(spec, dout, o0, l0)
    return (o1, l1, w1, g1), (o0, l0, w0, g0)


@pytest.mark.parametrize("seed", range(48))
def test_float64_matches_reference(seed, monkeypatch):
    q, k, v, kw, blocks = random_case(seed)
    monkeypatch.setattr(flash, "SUB_M", 1 + seed % 5)     # row strips along the diagonal band
    spec = validate(q, k, v, **kw)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(spec, blocks, seed)
    assert o1.dtype == np.float64 and l1.dtype == np.float64
    assert max_error(o1, o0) <= 1e-12
    assert max_error(l1, l0) <= 1e-12
    assert max_error(w1, w0) <= 1e-12
    assert len(g1) == len(g0)
    for a, b in zip(g1, g0):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        assert max_error(a, b) <= 1e-12


@pytest.mark.parametrize("kind", ["causal", "window", "keep", "drop", "bias", "softcap", "all"])
@pytest.mark.parametrize("L, S", [(13, 30), (30, 13), (1, 17), (17, 1), (33, 33)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_each_mask_kind_alone_and_combined(kind, L, S, align, monkeypatch):
    monkeypatch.setattr(flash, "SUB_M", 5)
    rng = np.random.default_rng(L * 100 + S)
    q, k, v = make_qkv((2, 4, L, 8), (2, 2, S, 8), 6, seed=L + S)
    masks = dict(causal=dict(causal=True), window=dict(window=(3, 2)),
                 keep=dict(keep=rng.random((4, L, S)) < 0.7), drop=dict(drop=rng.random((L, S)) < 0.3),
                 bias=dict(bias=np.where(rng.random((S,)) < 0.2, -np.inf, rng.standard_normal(S))),
                 softcap=dict(softcap=1.5))
    kw = {}
    for name in (masks if kind == "all" else [kind]):
        kw.update(masks[name])
    if "causal" in kw or "window" in kw:
        kw["align"] = align
    spec = validate(q, k, v, **kw)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(spec, dict(block_m=12, block_n=7))
    assert (g1[3] is None) == (g0[3] is None)
    for a, b in zip((o1, l1, w1) + g1[:3] + g1[3:] * (g0[3] is not None), (o0, l0, w0) + g0[:3] + g0[3:]):
        assert max_error(a, b) <= 1e-12


def test_window_one_side_unbounded_and_long_rows():
    q, k, v = make_qkv((1, 1025, 8), (1, 97, 8), 8, seed=9)
    for window in [(None, 3), (5, None), (0, 0)]:
        spec = validate(q, k, v, window=window)
        (o1, l1, _, g1), (o0, l0, _, g0) = both(spec, dict(block_m=64, block_n=16), need_weights=False)
        assert max(max_error(a, b) for a, b in zip((o1, l1) + g1[:3], (o0, l0) + g0[:3])) <= 1e-12


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("seed", range(0, 48, 4))
def test_low_precision_within_twice_the_reference_error(seed, dtype, kernels):
    q, k, v, kw, blocks = random_case(seed, dtype)
    spec = validate(q, k, v, **kw)
    oracle_spec = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(spec, blocks, seed)
    oo, lo, wo = reference.rung_forward(oracle_spec, True)
    assert o1.dtype == dtype and w1.dtype == dtype and l1.dtype == np.float32
    assert max_error(o1, oo) <= error_budget(oo, o0)
    assert max_error(l1, lo) <= error_budget(lo, l0)
    assert max_error(w1, wo) <= error_budget(wo, w0)
    # backward on the same (low precision) out and lse, against the float64 oracle
    dout = np.random.default_rng(seed).standard_normal(o0.shape)
    go = reference.rung_backward(oracle_spec, dout, o0.astype(np.float64), l0.astype(np.float64))
    for a, b, c in zip(g1, g0, go):
        if c is not None:
            assert a.dtype == b.dtype
            assert max_error(a, c) <= error_budget(c, b)


def test_float32_kernels_agree_at_tile_size(kernels):
    """Default block sizes, several tiles, causal: the shape the benchmark runs."""
    q, k, v = make_qkv((2, 300, 64), (2, 700, 64), dtype="float32", seed=3)
    spec = validate(q, k, v, causal=True)
    oracle = reference.rung_forward(validate(*(x.astype(np.float64) for x in (q, k, v)), causal=True))
    same = reference.rung_forward(spec)
    out, lse, _ = flash.rung_forward(spec)
    assert max_error(out, oracle[0]) <= error_budget(oracle[0], same[0])
    assert max_error(lse, oracle[1]) <= error_budget(oracle[1], same[1])


def test_fully_masked_rows_zero_minus_inf_no_warnings(kernels):
    q, k, v = make_qkv((2, 6, 8), (2, 5, 8), dtype="float32", seed=1)
    keep = np.ones((6, 5), bool)
    keep[1] = False
    bias = np.zeros((6, 5), np.float32)
    bias[4] = -np.inf                                    # a row masked by -inf bias alone
    kw = dict(keep=keep, bias=bias, causal=True)         # bottom-right, L > S: row 0 sees nothing
    with np.errstate(all="raise"):
        out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True, **kw, **F)
        dq, dk, dv, db = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, **kw, **F)
        wr = attnkit.attention_weights(q, k, lse=lse, rows=[0, 1, 4], **kw, **F)
    for r in (0, 1, 4):
        assert np.all(out[:, r] == 0) and np.all(w[:, r] == 0) and np.all(lse[:, r] == -np.inf)
        assert np.all(dq[:, r] == 0) and np.all(db[r] == 0)
    assert np.all(wr == 0)
    assert np.all(np.isfinite(lse[:, [2, 3, 5]]))
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv, db))


def test_backward_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    from peers import torch_sdpa
    rng = np.random.default_rng(0)
    cases = [dict(), dict(causal=True, align="top_left"), dict(window=(3, 1)),
             dict(keep=rng.random((40, 33)) < 0.9, bias=rng.standard_normal((4, 40, 33))),
             dict(drop=rng.random((1, 33)) < 0.2, causal=True)]
    for i, kw in enumerate(cases):
        q, k, v = make_qkv((2, 4, 40, 16), (2, 2, 33, 16), 12, seed=i)
        out, lse = attnkit.attention(q, k, v, return_lse=True, **kw, **F)
        peer, leaves = torch_sdpa(q, k, v, requires_grad=True, **kw)
        dead = np.isnan(peer.detach().numpy()).any(-1)
        dout = rng.standard_normal(out.shape)
        dout[dead] = 0                                   # the peer's NaN rows carry no gradient
        peer.masked_fill(torch.tensor(dead)[..., None], 0).backward(torch.tensor(dout))
        grads = attnkit.attention_backward(dout, q, k, v, out, lse, **kw, **F)
        for ours, leaf in zip(grads, leaves):
            assert ours.shape == tuple(leaf.shape)
            assert max_error(ours, leaf.grad.numpy()) <= 1e-12


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
    parts = [attnkit.attention(q, k[..., a:b, :], v[..., a:b, :], keep=keep[:, a:b], return_lse=True, **F)
             for a, b in zip(edges[:-1], edges[1:])]
    whole, whole_lse = attnkit.attention(q, k, v, keep=keep, return_lse=True, backend="reference")
    out, lse = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    assert max_error(out, whole) <= 1e-12 and max_error(lse, whole_lse) <= 1e-12
    assert np.all(out[..., 0, :] == 0) and np.all(lse[..., 0] == -np.inf)
    torch = pytest.importorskip("torch")
    tout, tlse = flash.merge([torch.tensor(p[0]) for p in parts], [torch.tensor(p[1]) for p in parts])
    assert max_error(tout.numpy(), whole) <= 1e-12 and max_error(tlse.numpy(), whole_lse) <= 1e-12


def test_backward_of_a_key_block_with_global_out_and_lse():
    """Ring attention: a key block's gradient from the global out and lse is that
    block's share; dq sums over blocks, dk/dv are the block's slices."""
    q, k, v = make_qkv((2, 20, 8), (2, 30, 8), seed=4)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, **F)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    dq, dk, dv = attnkit.attention_backward(dout, q, k, v, out, lse, causal=True, **F)
    keep = validate(q, k, v, causal=True).index_keep(np.arange(20), np.arange(30))
    dq_sum = 0
    for a, b in [(0, 12), (12, 30)]:
        g = attnkit.attention_backward(dout, q, k[:, a:b], v[:, a:b], out, lse, keep=keep[:, a:b], **F)
        dq_sum = dq_sum + g[0]
        assert max_error(g[1], dk[:, a:b]) <= 1e-12 and max_error(g[2], dv[:, a:b]) <= 1e-12
    assert max_error(dq_sum, dq) <= 1e-12


def test_lse_gradient_matches_reference_and_central_differences():
    """dlse (a gradient for lse) enters the Jacobian term: flash = reference, and both
    are the derivative of lse · c by central differences."""
    q, k, v = make_qkv((2, 33, 8), (2, 41, 8), seed=6)
    spec = validate(q, k, v, causal=True, bias=np.random.default_rng(2).standard_normal((33, 41)))
    out, lse, _ = reference.rung_forward(spec)
    rng = np.random.default_rng(3)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    ref = reference.rung_backward(spec, dout, out, lse, dlse)
    got = flash.rung_backward(spec, dout, out, lse, dlse, block_m=16, block_n=16)
    for g, r in zip(got, ref):
        assert max_error(g, r) <= 1e-12
    eps, i = 1e-6, (1, 5, 3)                             # d(Σ out·dout + lse·dlse)/dq[i]

    def loss(qq):
        o, l, _ = reference.rung_forward(validate(qq, k, v, causal=True, bias=spec.bias))
        return (o * dout).sum() + (l * dlse).sum()
    qp, qm = q.copy(), q.copy()
    qp[i] += eps
    qm[i] -= eps
    assert abs((loss(qp) - loss(qm)) / (2 * eps) - ref[0][i]) < 1e-7


@pytest.mark.parametrize("with_lse", [True, False])
def test_attention_weights_rows(with_lse):
    q, k, v = make_qkv((2, 3, 50, 8), (2, 1, 70, 8), seed=5)
    kw = dict(causal=True, bias=np.random.default_rng(0).standard_normal((50, 70)))
    out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True, backend="reference", **kw)
    rows = [49, 3, 4, 5, 5, 0]                            # any order, repeats, a run of 3
    got = attnkit.attention_weights(q, k, lse=lse if with_lse else None, rows=rows, **kw, **F)
    assert got.shape == (2, 3, 6, 70)
    assert max_error(got, w[..., rows, :]) <= 1e-12
    assert max_error(attnkit.attention_weights(q[0, 0], k[0, 0], rows=-1, **F)[0],
                     attnkit.attention_weights(q[0, 0], k[0, 0], backend="reference")[-1]) <= 1e-12


def test_deterministic_bits_repeated_and_across_thread_counts(kernels):
    q, k, v = make_qkv((1, 2, 300, 16), (1, 1, 250, 16), 16, dtype="float32", seed=6)
    kw = dict(causal=True, bias=np.random.default_rng(0).standard_normal((300, 250)).astype(np.float32))
    spec = validate(q, k, v, **kw)
    blocks = dict(block_m=32, block_n=32)
    dout = np.random.default_rng(1).standard_normal((1, 2, 300, 16)).astype(np.float32)
    results = []
    for n in (1, 2, 3, 2):
        with flash.threads(n):
            out, lse, _ = flash.rung_forward(spec, **blocks)
            results.append((out, lse) + flash.rung_backward(spec, dout, out, lse, **blocks))
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], r))


def test_causal_skips_excluded_tiles(monkeypatch):
    """Causal L = S computes about half the tiles, and none of the skipped ones."""
    seen = []
    scores = flash._Call.scores
    monkeypatch.setattr(flash._Call, "scores",
                        lambda self, s, b, h, qb, kb, r0, r1, c0, c1, **kw:
                        seen.append((r0, c0)) or scores(self, s, b, h, qb, kb, r0, r1, c0, c1, **kw))
    q, k, v = make_qkv((1, 256, 8), (1, 256, 8), seed=0)
    counts = []
    for causal in (False, True):
        seen.clear()
        flash.rung_forward(validate(q, k, v, causal=causal), block_m=16, block_n=16)
        counts.append(len(seen))
        assert all(c0 <= r0 + 15 for r0, c0 in seen) or not causal
    assert counts[0] == 256 and counts[1] == 16 * 17 // 2


def test_gqa_reads_shared_kv_without_copies():
    q, k, v = make_qkv((2, 8, 5, 4), (2, 2, 6, 4), dtype="float32", seed=0)
    call = flash._Call(validate(q, k, v), None, None)
    for h in range(8):
        kh, vh = call.kv((1,), h)
        assert np.shares_memory(kh, k[1, h // 4]) and np.shares_memory(vh, v[1, h // 4])


def test_forward_and_backward_never_allocate_an_L_by_S_array():
    L = S = 8192
    q, k, v = make_qkv((1, L, 16), (1, S, 16), dtype="float32", seed=0)
    spec = validate(q, k, v, causal=True)
    flash.rung_forward(validate(q[:, :64], k[:, :64], v[:, :64]))  # compile / warm up outside the trace
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out, lse, _ = flash.rung_forward(spec)
        fwd_peak = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        flash.rung_backward(spec, out, out, lse)
        bwd_peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert fwd_peak < L * S // 8                         # a boolean L × S mask alone is 8× this
    assert bwd_peak < L * S // 2


def test_threads_knob():
    old = flash.set_threads(3)
    try:
        assert flash.get_threads() == 3
        with flash.threads(1):
            assert flash.get_threads() == 1
        assert flash.get_threads() == 3
    finally:
        flash.set_threads(old)
    with pytest.raises(ValueError, match="threads"):
        flash.set_threads(0)


def test_auto_picks_flash_for_numpy_unless_every_head_is_small():
    from attnkit import backends, reference
    q, k, v = make_qkv((2, 200, 4), (2, 300, 4), seed=0)
    assert backends.select(validate(q, k, v)) is flash
    assert backends.select(validate(q[:, :3], k[:, :5], v[:, :5])) is reference
    q, k, v = make_qkv((300, 2, 100, 4), (300, 2, 100, 4), seed=0)   # small heads, but many
    assert backends.select(validate(q, k, v)) is flash


def test_without_threadpoolctl_runs_serially_with_the_same_results(monkeypatch):
    q, k, v = make_qkv((2, 40, 8), (1, 50, 8), seed=8)
    spec = validate(q, k, v, causal=True)
    want = flash.rung_forward(spec, block_m=8, block_n=8)
    monkeypatch.setattr(flash._state, "controller", False)   # as if threadpoolctl were missing
    monkeypatch.setattr(flash, "_pool", lambda *a: pytest.fail("no pool without threadpoolctl"))
    got = flash.rung_forward(spec, block_m=8, block_n=8)
    assert max_error(got[0], want[0]) <= 1e-12 and max_error(got[1], want[1]) <= 1e-12


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("L, S", [(7, 7), (5, 11), (11, 5), (1, 9)])
@pytest.mark.parametrize("mask", [dict(causal=True), dict(window=(2, 1)), dict(window=(None, 3)),
                                  dict(window=(0, None)), dict(causal=True, window=(3, 2))])
def test_row_key_bounds_is_the_index_rule_row_by_row(mask, L, S, align):
    spec = validate(*make_qkv((L, 4), (S, 4), seed=0), align=align, **mask)
    lo, hi = spec.row_key_bounds(0, L)
    assert lo.dtype == hi.dtype == np.int64 and np.all(lo <= hi)
    for r in range(L):
        assert (lo[r], hi[r]) == spec.key_bounds(r, r + 1)
    keep = spec.index_keep(np.arange(L), np.arange(S))
    cols = np.arange(S)
    assert np.array_equal(keep, (cols >= lo[:, None]) & (cols < hi[:, None]))
    sub = spec.row_key_bounds(2, min(L, 5))
    assert all(np.array_equal(a[2:5], b) for a, b in zip((lo, hi), sub))


def test_bounded_softmax_tile_is_the_masked_tile(kernels):
    """The fused causal/window softmax (row bounds, no mask) against the plain tile
    with −inf outside the bounds, including empty rows and bounds outside the tile."""
    kern = flash.NUMPY_KERNELS if kernels == "numpy" else flash.compiled_kernels()
    rng = np.random.default_rng(0)
    rows, w, c0 = 9, 37, 20
    s = (rng.standard_normal((rows, w)) * 3).astype(np.float32)
    lo = np.array([0, 20, 25, 30, 57, 60, 40, 22, 10])
    hi = np.array([25, 57, 26, 30, 70, 80, 45, 56, 15])
    m0 = np.array([-np.inf, 1.0, -np.inf, 2.0, -np.inf, 0.5, 9.0, -np.inf, -np.inf], np.float32)
    l0 = np.where(np.isfinite(m0), 1.5, 0.0).astype(np.float32)
    cols = np.arange(c0, c0 + w)
    masked = np.where((cols >= lo[:, None]) & (cols < hi[:, None]), s, -np.inf).astype(np.float32)
    m1, l1, m2, l2 = m0.copy(), l0.copy(), m0.copy(), l0.copy()
    s1, s2 = s.copy(), masked.copy()
    a1 = kern.softmax_tile_bounded(s1, m1, l1, lo, hi, c0)
    a2 = kern.softmax_tile(s2, m2, l2)
    assert np.array_equal(m1, m2)
    for x, y in ((s1, s2), (l1, l2), (a1, a2)):
        assert np.all(np.isfinite(x)) and np.allclose(x, y, rtol=1e-6, atol=0)
    assert np.all(s1[(cols < lo[:, None]) | (cols >= hi[:, None])] == 0)


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_scale_zero_gives_uniform_weights_and_zero_dq_dk(softcap):
    q, k, v = make_qkv((2, 5, 4), (2, 7, 4), seed=21)
    kw = dict(scale=0.0, softcap=softcap)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw, **F)
    ref, rlse = attnkit.attention(q, k, v, return_lse=True, **kw, backend="reference")
    assert max_error(out, ref) <= 1e-12 and max_error(lse, rlse) <= 1e-12
    got = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, **kw, **F)
    want = attnkit.attention_backward(np.ones_like(ref), q, k, v, ref, rlse, **kw, backend="reference")
    for g, w in zip(got, want):
        assert max_error(g, w) <= 1e-12


def test_huge_negative_bias_row_on_every_kernel(kernels):
    """A row whose scores are all near float32's most negative value (an additive
    finfo.min padding mask) is a uniform row, as in the reference, on both kernel sets."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((1, 3, 8), (1, 5, 8), seed=22))
    bias = np.zeros((3, 5), np.float32)
    bias[1] = np.finfo(np.float32).min
    out = attnkit.attention(q, k, v, bias=bias, **F)
    ref = attnkit.attention(q, k, v, bias=bias, backend="reference")
    assert np.all(np.isfinite(out)) and max_error(out, ref) <= 1e-5
    assert max_error(out[0, 1], v[0].mean(0)) <= 1e-5


def test_concurrent_calls_with_different_thread_settings():
    """flash.threads is per context (thread): concurrent calls with different settings
    see their own setting, never a pool shut down under them, and give serial bits."""
    import threading
    q, k, v = make_qkv((1, 2, 200, 16), (1, 2, 180, 16), 16, dtype="float32", seed=11)
    spec = validate(q, k, v, causal=True)
    blocks = dict(block_m=16, block_n=32)
    with flash.threads(1):
        want = flash.rung_forward(spec, **blocks)
    sizes = [1, 2, 3, 4, 2, 3]
    barrier = threading.Barrier(len(sizes))
    errors, seen, results = [], [], []

    def worker(n):
        try:
            with flash.threads(n):
                barrier.wait()
                seen.append((n, flash.get_threads()))
                for _ in range(15):
                    results.append(flash.rung_forward(spec, **blocks))
                seen.append((n, flash.get_threads()))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(n,)) for n in sizes]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert all(n == got for n, got in seen)
    assert len(results) == 15 * len(sizes)
    for out, lse, _ in results:
        assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])


def test_set_threads_accepts_numpy_integers_and_rejects_bools():
    old = flash.set_threads(np.int64(2))
    try:
        assert flash.get_threads() == 2 and type(flash.get_threads()) is int
        with flash.threads(np.int32(1)):
            assert flash.get_threads() == 1
    finally:
        flash.set_threads(old)
    for bad in (True, 1.0, np.int64(0), "2"):
        with pytest.raises(ValueError, match="threads"):
            flash.set_threads(bad)
        with pytest.raises(ValueError, match="threads"):
            with flash.threads(bad):
                pass


def test_overlapping_calls_restore_the_blas_thread_count():
    """BLAS is limited on the first overlapping call's entry and restored on the last
    one's exit, even when the calls end in another order than they began."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import threading

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    before = blas_threads()
    if not before or max(before) <= 1:
        pytest.skip("no multi-threaded BLAS found by threadpoolctl")
    a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def first(_):
        a_in.set()
        assert b_in.wait(10)
        assert set(blas_threads()) == {1}

    def second(_):
        b_in.set()
        assert a_done.wait(10)
        assert set(blas_threads()) == {1}                # the first call's exit kept the limit

    def call(fn):
        try:
            flash._run([0], fn)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ta = threading.Thread(target=call, args=(first,))
    ta.start()
    assert a_in.wait(10)
    tb = threading.Thread(target=call, args=(second,))
    tb.start()
    ta.join()
    a_done.set()
    tb.join()
    assert not errors, errors
    assert blas_threads() == before


def test_float16_under_errstate_raise_does_not_underflow():
    q, k, v = make_qkv((2, 3, 70, 16), (2, 3, 90, 16), 16, dtype="float16", seed=12)
    dout = np.random.default_rng(3).standard_normal((2, 3, 70, 16)).astype(np.float16) * np.float16(1e-3)
    spec = validate(q, k, v, causal=True)
    with np.errstate(all="raise"):
        out, lse, w = flash.rung_forward(spec, need_weights=True, block_m=32, block_n=32)
        grads = flash.rung_backward(spec, dout, out, lse, block_m=32, block_n=32)
        w2 = attnkit.attention_weights(q, k, causal=True, **F)
        o2 = attnkit.attention(q, k, v, causal=True, **F)
    assert out.dtype == w.dtype == w2.dtype == o2.dtype == np.float16
    assert all(g.dtype == np.float16 and np.isfinite(g).all() for g in grads[:3])
    assert np.isfinite(out).all() and np.isfinite(w).all() and max_error(w, w2) <= 1e-3
