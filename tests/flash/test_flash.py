"""The flash rung against the rung below (the reference; float64 ≤ 1e-12, low
precision by the 2× rule of DESIGN.md §6), PyTorch autograd as a peer, weights from
lse, determinism across thread counts, tile skipping, and linear memory."""

import numpy as np
import pytest

import attnkit
from attnkit import flash, reference
from attnkit.flash import plan
from attnkit.spec import geometry as geo
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error
from cases import SGEMM_LAYOUT_BITS, assert_grads_close, both, peak_bytes, random_case

F = dict(backend="flash")


@pytest.mark.parametrize("seed", range(48))
def test_float64_matches_reference(seed, monkeypatch):
    q, k, v, kw, blocks = random_case(seed, extras=True)
    monkeypatch.setattr(plan, "SUB_M", 1 + seed % 5)      # row strips along the diagonal band
    spec = validate(q, k, v, **kw)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(flash, spec, blocks, seed)
    assert o1.dtype == np.float64 and l1.dtype == np.float64
    assert max_error(o1, o0) <= 1e-12
    assert max_error(l1, l0) <= 1e-12
    assert max_error(w1, w0) <= 1e-12
    assert_grads_close(g1, g0, 1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_default_tiles_match_reference(seed):
    """The tuned plan (stacked GQA groups, batched small heads, split-KV, wide key
    tiles for few rows) on shapes that take each path."""
    rng = np.random.default_rng(seed)
    shapes = [((2, 8, 1, 32), (2, 2, 3000, 32)),        # decoding: split-KV, one read per group
              ((3, 4, 7, 16), (3, 4, 9, 16)),          # small heads batched
              ((1, 6, 130, 8), (1, 2, 900, 8)),        # a group stacked, several key tiles
              ((1, 2, 1500, 8), (1, 1, 1200, 8))][seed % 4]
    q, k, v = make_qkv(*shapes, seed=seed)
    kw = [dict(), dict(causal=True), dict(window=(40, 3)), dict(kv_lengths=rng.integers(0, shapes[1][-2], 1)
                                                                 .repeat(shapes[0][0]))][seed // 2 % 4]
    spec = validate(q, k, v, **kw)
    (o1, l1, _, g1), (o0, l0, _, g0) = both(flash, spec, {}, seed, need_weights=False)
    assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12
    assert_grads_close(g1, g0, 1e-12)


@pytest.mark.parametrize("kind", ["causal", "window", "keep", "drop", "bias", "softcap", "all"])
@pytest.mark.parametrize("L, S", [(13, 30), (30, 13), (1, 17), (17, 1), (33, 33)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_each_mask_kind_alone_and_combined(kind, L, S, align, monkeypatch):
    monkeypatch.setattr(plan, "SUB_M", 5)
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
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(flash, spec, dict(block_m=12, block_n=7))
    for a, b in zip((o1, l1, w1), (o0, l0, w0)):
        assert max_error(a, b) <= 1e-12
    assert_grads_close(g1, g0, 1e-12)


def test_window_one_side_unbounded_and_long_rows():
    q, k, v = make_qkv((1, 1025, 8), (1, 97, 8), 8, seed=9)
    for window in [(None, 3), (5, None), (0, 0)]:
        spec = validate(q, k, v, window=window)
        (o1, l1, _, g1), (o0, l0, _, g0) = both(flash, spec, dict(block_m=64, block_n=16), need_weights=False)
        assert max(max_error(a, b) for a, b in zip((o1, l1) + g1[:3], (o0, l0) + g0[:3])) <= 1e-12


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("seed", range(0, 48, 4))
def test_low_precision_within_twice_the_reference_error(seed, dtype, kernels):
    q, k, v, kw, blocks = random_case(seed, dtype, extras=True)
    spec = validate(q, k, v, **kw)
    oracle_spec = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(flash, spec, blocks, seed)
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


def test_backward_of_a_key_block_with_global_out_and_lse():
    """Ring attention: a key block's gradient from the global out and lse is that
    block's share; dq sums over blocks, dk/dv are the block's slices."""
    q, k, v = make_qkv((2, 20, 8), (2, 30, 8), seed=4)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, **F)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    dq, dk, dv = attnkit.attention_backward(dout, q, k, v, out, lse, causal=True, **F)
    keep = geo.index_visible(validate(q, k, v, causal=True))
    dq_sum = 0
    for a, b in [(0, 12), (12, 30)]:
        g = attnkit.attention_backward(dout, q, k[:, a:b], v[:, a:b], out, lse, keep=keep[..., a:b], **F)
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
    assert_grads_close(got, ref, 1e-12)
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
    dec = validate(*make_qkv((2, 8, 1, 16), (2, 2, 4000, 16), dtype="float32", seed=7))   # split-KV decoding
    results = []
    for n in (1, 2, 3, 2):
        with flash.threads(n):
            out, lse, _ = flash.rung_forward(spec, **blocks)
            results.append((out, lse) + tuple(flash.rung_backward(spec, dout, out, lse, **blocks))[:4]
                           + flash.rung_forward(dec)[:2])
    for r in results[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(results[0], r))


def test_causal_skips_excluded_tiles(monkeypatch):
    """Causal L = S computes about half the tiles, and none of the skipped ones."""
    seen = []
    scores = plan.Call.scores

    def spy(self, s, u, q_t, k_t, r0, r1, c0, c1, *a, **kw):
        seen.append((r0, c0))
        return scores(self, s, u, q_t, k_t, r0, r1, c0, c1, *a, **kw)

    monkeypatch.setattr(plan.Call, "scores", spy)
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
    call = plan.Call(validate(q, k, v), None, None)
    assert {u.g for u in call.units} == {4}               # each group's four heads as one tile
    for u in call.units:
        kh, vh = call.kv(u, 0, 6)
        hk = u.h0 // 4
        assert np.shares_memory(kh, k[u.b[0], hk]) and np.shares_memory(vh, v[u.b[0], hk])


def test_forward_and_backward_never_allocate_an_L_by_S_array():
    L = S = 8192
    q, k, v = make_qkv((1, L, 16), (1, S, 16), dtype="float32", seed=0)
    spec = validate(q, k, v, causal=True)
    warm = validate(q[:, :256], k[:, :256], v[:, :256], causal=True)   # compile / warm up outside the trace
    w_out, w_lse, _ = flash.rung_forward(warm)
    flash.rung_backward(warm, w_out, w_out, w_lse)
    (out, lse, _), fwd_peak = peak_bytes(lambda: flash.rung_forward(spec))
    _, bwd_peak = peak_bytes(lambda: flash.rung_backward(spec, out, out, lse))
    assert fwd_peak < L * S // 8                         # a boolean L × S mask alone is 8× this
    assert bwd_peak < L * S // 2


def test_auto_picks_flash_for_numpy_unless_every_head_is_small():
    from attnkit import backends, small
    q, k, v = make_qkv((2, 800, 4), (2, 700, 4), seed=0)
    assert backends.select(validate(q, k, v)) is flash
    assert backends.select(validate(q[:, :3], k[:, :5], v[:, :5])) is small
    assert backends.select(validate(q[:, :3], k[:, :5], v[:, :5], cu_seqlens_q=np.array([0, 3]),
                                    cu_seqlens_k=np.array([0, 5]))) is flash
    q, k, v = make_qkv((300, 2, 100, 4), (300, 2, 100, 4), seed=0)   # small heads, but many
    assert backends.select(validate(q, k, v)) is flash


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


@pytest.mark.parametrize("rung", [flash, reference])
def test_blocks_of_a_larger_problem_merge_to_the_whole(rung):
    """A call that is one block of a larger problem (Spec.origin/extent, as ring
    attention makes them) uses the global positions for causal, ALiBi, key lengths
    and dropout: blocks merged by lse give the whole, and their backward passes (with
    the whole's out and lse) add up to the whole's gradients."""
    from attnkit.merge import merge
    from attnkit.spec import Spec
    q, k, v = make_qkv((2, 2, 12, 8), (2, 1, 10, 8), seed=31)
    kw = dict(causal=True, alibi_slopes=np.array([0.3, 0.7]), kv_lengths=np.array([7, 10]), dropout=0.25, seed=9)
    whole = validate(q, k, v, **kw)
    out, lse, _ = reference.rung_forward(whole)
    dout = np.random.default_rng(2).standard_normal(out.shape)
    want = reference.rung_backward(whole, dout, out, lse)
    rows, cols = [(0, 5), (5, 12)], [(0, 4), (4, 10)]
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for r0, r1 in rows:
        parts = []
        for c0, c1 in cols:
            blk = Spec.from_arrays(q[..., r0:r1, :], k[..., c0:c1, :], v[..., c0:c1, :], scale=whole.scale,
                                   causal=True, alibi_slopes=whole.alibi_slopes, kv_lengths=whole.kv_lengths,
                                   dropout=0.25, seed=9, origin=(r0, c0), extent=(12, 10))
            o, l, _ = rung.rung_forward(blk) if rung is reference else rung.rung_forward(blk, block_m=3, block_n=3)
            parts.append((o, l))
            g = rung.rung_backward(blk, dout[..., r0:r1, :], out[..., r0:r1, :], lse[..., r0:r1])
            dq[..., r0:r1, :] += g.dq
            dk[..., c0:c1, :] += g.dk
            dv[..., c0:c1, :] += g.dv
        o, l = merge([p[0] for p in parts], [p[1] for p in parts])
        assert max_error(o, out[..., r0:r1, :]) <= 1e-12 and max_error(l, lse[..., r0:r1]) <= 1e-12
    for a, b in zip((dq, dk, dv), want):
        assert max_error(a, b) <= 1e-12


def test_alibi_and_sinks_keep_memory_linear():
    """ALiBi is computed per tile: at L = S = 16,384 no L × S array is ever allocated."""
    n = 16384
    q, k, v = make_qkv((1, n, 16), (1, n, 16), dtype="float32", seed=1)
    spec = validate(q, k, v, causal=True, alibi_slopes=np.array([0.01]), sinks=np.array([0.5]))
    flash.rung_forward(validate(q[:, :64], k[:, :64], v[:, :64], alibi_slopes=np.array([0.01])))   # warm up
    _, peak = peak_bytes(lambda: flash.rung_forward(spec))
    assert peak < n * n // 8                              # a boolean L × S mask alone is 8× this


def test_dropout_drops_the_same_entries_on_every_rung_kernel_and_thread_count(monkeypatch):
    q, k, v = make_qkv((2, 3, 70, 16), (2, 3, 90, 16), dtype="float32", seed=2)
    kw = dict(dropout=0.35, seed=2 ** 40 + 3, causal=True)
    spec = validate(q, k, v, **kw)
    ref = reference.rung_forward(spec)[0]
    outs = []
    for use in (False, True):
        monkeypatch.setattr(flash.kernels, "USE_COMPILED", use)
        for n in (1, 2):
            with flash.threads(n):
                for blocks in (dict(block_m=16, block_n=8), {}):
                    outs.append(flash.rung_forward(spec, **blocks)[0])
    zero = np.isclose(ref, 0)                             # the same dropped pattern: compare exactly where 0
    for o in outs:
        assert max_error(o, ref) <= 1e-5 and np.array_equal(np.isclose(o, 0), zero)
    for a, b in ((0, 2), (1, 3), (4, 6), (5, 7)):        # the same bits whatever the thread count
        assert np.array_equal(outs[a], outs[b])
    assert np.array_equal(flash.rung_forward(validate(q, k, v, dropout=0.0, seed=1, causal=True))[0],
                          flash.rung_forward(validate(q, k, v, causal=True))[0])   # p = 0 is no dropout, bitwise


def test_float32_decoding_with_empty_rows_minus_inf_sinks_and_weights():
    """The streaming kernel's shapes (float32, one row per head, split-KV): a sequence
    with no keys gives out 0 and lse −inf (or the sink), a −inf sink is no sink, and
    the exact weights of those rows agree with the reference's."""
    from attnkit.testing import error_budget
    q, k, v = make_qkv((3, 8, 1, 32), (3, 2, 3000, 32), dtype="float32", seed=4)
    sinks = np.array([-np.inf, 0.5, -np.inf, 1.0, -np.inf, -np.inf, 2.0, 0.0])
    kw = dict(kv_lengths=np.array([0, 2999, 1700]), sinks=sinks, causal=True)
    out, lse, w = attnkit.attention(q, k, v, **kw, return_lse=True, return_weights=True, backend="flash")
    f64 = [x.astype(np.float64) for x in (q, k, v)]
    o64, l64, w64 = attnkit.attention(*f64, **kw, return_lse=True, return_weights=True, backend="reference")
    o32, l32, w32 = attnkit.attention(q, k, v, **kw, return_lse=True, return_weights=True, backend="reference")
    assert np.all(out[0] == 0) and np.all(w[0] == 0)
    assert np.array_equal(lse[0, :, 0], sinks.astype(np.float32))      # the sink alone, or −inf
    for got, want, ref in ((out, o64, o32), (lse, l64, l32), (w, w64, w32)):
        assert max_error(got, want) <= error_budget(want, ref)


@pytest.mark.parametrize("shape", ["2-D", "3-D"])
def test_dropout_without_batch_dims_equals_the_reference(shape):
    """Dropout's head counter on inputs without batch dims (2-D, or heads only): the
    flash rung drops the same entries as the reference, forward and backward."""
    if shape == "2-D":
        q, k, v = make_qkv((30, 8), (41, 8), 6, seed=5)
    else:
        q, k, v = make_qkv((3, 30, 8), (3, 41, 8), 6, seed=5)
    spec = validate(q, k, v, dropout=0.3, seed=7, causal=True)
    (o1, l1, w1, g1), (o0, l0, w0, g0) = both(flash, spec, dict(block_m=8, block_n=16), 3)
    assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12 and max_error(w1, w0) <= 1e-12
    assert_grads_close(g1, g0, 1e-12)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_split_kv_parts_with_far_apart_maxima_and_fully_masked_rows(dtype):
    """Decoding shapes whose keys are cut into split-KV parts: a row whose best scores
    are ~800 above the rest sit in the first part or in the last (a merge shifted by
    anything but the largest part maximum overflows exp), a row that sees no key is out
    0 / lse -inf, and the weights of split rows are exact too."""
    q, k, v = make_qkv((2, 4, 1, 16), (2, 2, 3000, 16), seed=6)
    bias = np.zeros((4, 1, 3000))
    bias[0] = -np.inf                                    # head 0 sees no key
    bias[1, :, :5] = 800.0                               # the first part holds the maximum
    bias[2, :, -5:] = 800.0                              # the last part holds it
    spec = validate(*(x.astype(dtype) for x in (q, k, v)), bias=bias)
    call = plan.Call(spec, None, None)
    blocks = [(u, r0, r1) for u in call.units for r0, r1 in call.row_blocks(u)]
    assert call.splits(len(blocks), 3000) > 1           # the split-KV path is taken
    o1, l1, w1 = flash.rung_forward(spec, True)
    f64 = validate(q, k, v, bias=bias)
    o0, l0, w0 = reference.rung_forward(f64, True)
    assert np.all(o1[:, 0] == 0) and np.all(l1[:, 0] == -np.inf) and np.all(w1[:, 0] == 0)
    tol = 1e-12 if dtype == "float64" else 1e-4
    no_v, l2, _ = flash.rung_forward(validate(q.astype(dtype), k.astype(dtype), None, need_v=False, bias=bias))
    assert no_v is None and np.array_equal(l2, l1)      # lse alone (no values): the same parts, merged
    for got, want in ((o1, o0), (l1, l0), (w1, w0)):
        assert np.isfinite(got[:, 1:]).all()
        assert max_error(got, want) <= tol * max(1.0, float(np.abs(want[np.isfinite(want)]).max()))


def test_alibi_on_the_streaming_kernel_for_packed_sequences():
    """The streaming (decoding) kernel with ALiBi for row blocks that do not start at
    row 0 (the second of packed sequences): each head's slope on each of its rows."""
    cq, ck = np.array([0, 3, 5, 9]), np.array([0, 40, 90, 150])
    q, k, v = make_qkv((4, 9, 16), (2, 150, 16), dtype="float32", seed=7)
    slopes = np.array([0.5, 0.05, 0.25, 0.9])
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, alibi_slopes=slopes, causal=True)
    spec = validate(q, k, v, **kw)
    call = plan.Call(spec, None, None)
    assert call.stream and any(u.seg.q0 > 0 and call.streams(u, u.seg.q0, u.seg.q1) for u in call.units)
    out, lse, _ = flash.rung_forward(spec)
    o64, l64, _ = reference.rung_forward(validate(*(x.astype(np.float64) for x in (q, k, v)), **kw))
    o32, l32, _ = reference.rung_forward(spec)
    assert max_error(out, o64) <= error_budget(o64, o32) and max_error(lse, l64) <= error_budget(l64, l32)


@pytest.mark.parametrize("kind", ["broadcast", "float16"])
def test_backward_takes_a_broadcast_or_half_precision_dout(kind):
    """dout of a shape that broadcasts to out's (no batch dims), or in float16: the
    gradients of the reference given the same dout."""
    dtype = "float16" if kind == "float16" else "float64"
    q, k, v = (x.astype(dtype) for x in make_qkv((2, 3, 20, 8), (2, 3, 30, 8), 8, seed=3))
    spec = validate(q, k, v, causal=True)
    o, lse, _ = reference.rung_forward(spec)
    rng = np.random.default_rng(0)
    if kind == "broadcast":
        dout = rng.standard_normal((3, 20, 8))
        full = np.broadcast_to(dout, o.shape).copy()
    else:
        dout = full = rng.standard_normal(o.shape).astype(np.float16)
    got = flash.rung_backward(spec, dout, o, lse, block_m=8, block_n=8)
    want = reference.rung_backward(spec, full, o, lse)
    if kind == "float16":
        f32 = reference.rung_backward(validate(*(x.astype(np.float32) for x in (q, k, v)), causal=True),
                                      full.astype(np.float32), o.astype(np.float32), lse)
        for g, w, r in zip(got, want, f32):
            if g is not None:
                assert g.dtype == np.float16 and max_error(g, r) <= 2 * max(max_error(w, r), 1e-3)
    else:
        assert_grads_close(got, want, 1e-12)


def test_backward_takes_lse_in_any_float_dtype(kernels):
    """lse may come in another float dtype than the call's (a float64 forward's): it is
    taken in the accumulation dtype, the same bits as that lse rounded to it."""
    q, k, v = make_qkv((2, 2, 20, 8), (2, 2, 33, 8), dtype="float32", seed=9)
    spec = validate(q, k, v, causal=True, sinks=np.array([0.3, -1.0]))
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    lse64 = lse.astype(np.float64) + 1e-9 * np.random.default_rng(2).standard_normal(lse.shape)
    got = flash.rung_backward(spec, dout, out, lse64, block_m=8, block_n=8)
    want = flash.rung_backward(spec, dout, out, lse64.astype(np.float32), block_m=8, block_n=8)
    for a, b in zip(got, want):
        assert a is None and b is None or np.array_equal(a, b)


@pytest.mark.parametrize("shape", [(64, 1), (2, 2, 64, 1)])
def test_dbias_broadcast_over_keys_has_the_same_bits_for_any_thread_count(shape):
    """A bias broadcast over the keys (..., L, 1) sums each row's key gradients into
    one entry: that sum stays in one task (fixed order), so 1 and 2 threads give the
    same bits."""
    q, k, v = make_qkv((2, 2, 64, 8), (2, 2, 256, 8), seed=10)
    bias = np.random.default_rng(3).standard_normal(shape)
    spec = validate(q, k, v, bias=bias)
    out, lse, _ = reference.rung_forward(spec)
    dout = np.random.default_rng(4).standard_normal(out.shape)
    with flash.threads(1):
        want = flash.rung_backward(spec, dout, out, lse, block_m=16, block_n=4)
    with flash.threads(2):
        for _ in range(3):
            got = flash.rung_backward(spec, dout, out, lse, block_m=16, block_n=4)
            assert np.array_equal(got.dbias, want.dbias) and np.array_equal(got.dk, want.dk)


def test_backward_when_no_row_sees_any_key():
    """Every sequence without keys (kv_lengths all 0): out 0, lse -inf, and every
    gradient 0 — the backward has no key block at all to cut into chunks."""
    q, k, v = make_qkv((2, 2, 5, 8), (2, 2, 7, 8), seed=12)
    spec = validate(q, k, v, kv_lengths=np.array([0, 0]))
    (o1, l1, _, g1), (o0, l0, _, g0) = both(flash, spec, {}, 5, need_weights=False)
    assert np.all(o1 == 0) and np.all(l1 == -np.inf)
    assert_grads_close(g1, g0, 0.0) and all(np.all(g == 0) for g in g1 if g is not None)


def test_weights_without_lse_count_the_sinks():
    """attention_weights without a saved lse runs the forward over its rows for lse: the
    sink logit is in that softmax too (rows then sum to less than 1)."""
    q, k, v = make_qkv((1, 2, 9, 8), (1, 2, 12, 8), seed=13)
    kw = dict(sinks=np.array([0.5, 2.0]), causal=True)
    got = attnkit.attention_weights(q, k, **kw, backend="flash")
    want = attnkit.attention_weights(q, k, **kw, backend="reference")
    assert max_error(got, want) <= 1e-12 and np.all(got.sum(-1) < 1)


@pytest.mark.parametrize("layout", ["float16", "strided"])
def test_decoding_with_half_precision_or_strided_caches(layout):
    """The streaming (decoding) kernel's operands: float16 keys and values, or keys and
    values in a (B, S, H, D) layout seen as (B, H, S, D), are read as the float32 C
    arrays they stand for (within the 2x rule of the reference, the same bits as the
    contiguous float32 copy)."""
    q, k, v = make_qkv((2, 4, 1, 32), (2, 2, 700, 32), dtype="float32", seed=14)
    if layout == "float16":
        q, k, v = (x.astype(np.float16) for x in (q, k, v))
        want = attnkit.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True, backend="reference")
        ref = attnkit.attention(q, k, v, causal=True, backend="reference")
        got = attnkit.attention(q, k, v, causal=True, backend="flash")
        assert got.dtype == np.float16 and max_error(got, want) <= error_budget(want, ref)
    else:
        ks, vs = (np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2) for x in (k, v))
        assert not ks.flags.c_contiguous
        got = attnkit.attention(q, ks, vs, causal=True, backend="flash")
        assert np.array_equal(got, attnkit.attention(q, k, v, causal=True, backend="flash"))


@pytest.mark.parametrize("L", [1, pytest.param(100, marks=SGEMM_LAYOUT_BITS)], ids=["decoding", "tiles"])
def test_a_transposed_layout_gives_the_bits_of_its_contiguous_copy(L):
    """q, k, v in a (B, S, H, D) layout seen as (B, H, S, D) (what transformers hands
    over; read in place by the tiles) give the same bits as the C-ordered arrays."""
    q, k, v = make_qkv((2, 4, L, 32), (2, 2, 300, 32), dtype="float32", seed=16)
    t = [np.swapaxes(np.ascontiguousarray(np.swapaxes(x, 1, 2)), 1, 2) for x in (q, k, v)]
    assert not any(x.flags.c_contiguous for x in t[1:])
    for kw in ({}, dict(causal=True), dict(kv_lengths=np.array([300, 170]))):
        assert np.array_equal(attnkit.attention(*t, backend="flash", **kw),
                              attnkit.attention(q, k, v, backend="flash", **kw))


def test_block_sizes_must_be_positive():
    q, k, v = make_qkv((1, 1, 4, 8), (1, 1, 5, 8), seed=15)
    spec = validate(q, k, v)
    for blocks in (dict(block_m=0), dict(block_n=0), dict(block_m=0, block_n=0), dict(block_m=-3, block_n=4)):
        with pytest.raises(ValueError, match="block sizes must be positive"):
            flash.rung_forward(spec, **blocks)


@pytest.mark.parametrize("case", ["heads_not_a_multiple", "one_head_over_small_tile", "empty_query_sequence"])
def test_default_plan_edges_match_reference(case):
    """The tuned plan where small heads are batched two at a time out of three (the last
    batch has one head), where one head's scores are more than SMALL_TILE (one head a
    task), and a GQA-stacked unit whose sequence has no query rows."""
    if case == "heads_not_a_multiple":
        q, k, v = make_qkv((1, 3, 256, 8), (1, 3, 512, 8), seed=16)       # 2**18 // (256·512) = 2 heads a task
        kw = dict(causal=True)
    elif case == "one_head_over_small_tile":
        q, k, v = make_qkv((1, 2, 600, 8), (1, 2, 500, 8), seed=21)       # 600·500 > 2**18
        kw = dict(causal=True)
    else:
        q, k, v = make_qkv((2, 4, 3, 8), (2, 2, 50, 8), seed=17)
        kw = dict(q_lengths=np.array([0, 3]), causal=True)
    spec = validate(q, k, v, **kw)
    (o1, l1, _, g1), (o0, l0, _, g0) = both(flash, spec, {}, 6, need_weights=False)
    assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12
    assert_grads_close(g1, g0, 1e-12)


def test_weights_of_scattered_rows_and_of_decoding_shapes():
    """attention_weights for rows that are not one run ([1, 3, 4, 8]), on packed GQA
    sequences (rows outside a sequence), and on a float32 decoding shape without lse
    (the streaming kernel's shape, no values given)."""
    q, k, v = make_qkv((1, 2, 10, 8), (1, 2, 12, 8), seed=18)
    full = attnkit.attention_weights(q, k, causal=True, backend="flash")
    got = attnkit.attention_weights(q, k, causal=True, rows=[1, 3, 4, 8], backend="flash")
    assert max_error(got, full[..., [1, 3, 4, 8], :]) <= 1e-12
    cq, ck = np.array([0, 3, 5]), np.array([0, 4, 9])
    q, k, v = make_qkv((4, 5, 8), (2, 9, 8), seed=19)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
    got = attnkit.attention_weights(q, k, rows=[0, 1], **kw, backend="flash")
    assert max_error(got, attnkit.attention_weights(q, k, rows=[0, 1], **kw, backend="reference")) <= 1e-12
    q, k, _ = make_qkv((1, 4, 1, 16), (1, 2, 300, 16), dtype="float32", seed=20)
    got = attnkit.attention_weights(q, k, backend="flash")
    want = attnkit.attention_weights(*(x.astype(np.float64) for x in (q, k)), backend="reference")
    assert got.dtype == np.float32 and max_error(got, want) <= 1e-6
