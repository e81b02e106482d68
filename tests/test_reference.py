"""The reference rung against PyTorch's SDPA (float64 ≤ 1e-12), finite differences,
and the contract's edge cases."""

import numpy as np
import pytest

import attnkit
from attnkit.testing import make_qkv, max_error
from peers import torch_sdpa


def torch_or_skip():
    """torch for the two peer tests; the rest of this file needs NumPy only."""
    return pytest.importorskip("torch")

R = dict(backend="reference")


def random_case(seed):
    """One randomized case over the grid: shapes, GQA, masks, alignment."""
    rng = np.random.default_rng(seed)
    L, S = rng.choice([1, 2, 15, 97], size=2)
    D = int(rng.choice([8, 59, 64]))
    Dv = int(rng.choice([D, 5, 12]))
    Hkv = int(rng.choice([1, 2]))
    H = Hkv * int(rng.choice([1, 2, 3]))
    batch_q = [(), (2,), (3, 1)][rng.integers(3)]
    batch_k = batch_q if rng.random() < 0.6 else (1,) * len(batch_q)
    q, k, v = make_qkv(batch_q + (H, L, D), batch_k + (Hkv, S, D), Dv, seed=seed)
    kw = {}
    kind = rng.integers(8)
    align = ["bottom_right", "top_left"][rng.integers(2)]
    if kind in (1, 5, 7):
        kw["causal"] = True
    if kind in (2, 5):
        kw["window"] = (int(rng.integers(0, 4)) if rng.random() < 0.8 else None,
                        int(rng.integers(0, 4)) if rng.random() < 0.8 else None)
    if kind in (3, 6, 7):
        kw["keep"] = rng.random((L, S)) < 0.8
    if kind in (4, 6):
        kw["drop"] = rng.random((H, 1, S)) < 0.2
    if kind in (4, 7) or rng.random() < 0.3:
        b = rng.standard_normal((H, L, S))
        b[rng.random(b.shape) < 0.1] = -np.inf
        kw["bias"] = b
    if "causal" in kw or "window" in kw:
        kw["align"] = align
    return q, k, v, kw


def compare_rows(ours, peer):
    """Peer gives NaN on fully masked rows; ours gives 0 there. Compare the rest."""
    peer = peer.detach().numpy()
    bad = np.isnan(peer).any(axis=-1)
    assert np.all(ours[bad] == 0)
    return max_error(ours[~bad], peer[~bad])


@pytest.mark.parametrize("seed", range(60))
def test_forward_matches_torch(seed):
    torch_or_skip()
    q, k, v, kw = random_case(seed)
    out = attnkit.attention(q, k, v, **kw, **R)
    peer, _ = torch_sdpa(q, k, v, **kw)
    assert compare_rows(out, peer) <= 1e-12


@pytest.mark.parametrize("seed", range(0, 60, 3))
def test_backward_matches_torch_autograd(seed):
    torch = torch_or_skip()
    q, k, v, kw = random_case(seed)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw, **R)
    peer, leaves = torch_sdpa(q, k, v, requires_grad=True, **kw)
    dout = np.random.default_rng(seed + 1).standard_normal(out.shape)
    dead = np.isnan(peer.detach().numpy()).any(-1)
    dout[dead] = 0                                         # peer's NaN rows carry no gradient
    peer.masked_fill(torch.tensor(dead)[..., None], 0).backward(torch.tensor(dout))
    grads = attnkit.attention_backward(dout, q, k, v, out, lse, **kw, **R)
    for ours, leaf in zip(grads, leaves):
        assert ours.shape == tuple(leaf.shape)
        assert max_error(ours, leaf.grad.numpy()) <= 1e-12


def central_difference(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = x[i]
        x[i] = old + eps
        fp = f()
        x[i] = old - eps
        fm = f()
        x[i] = old
        g[i] = (fp - fm) / (2 * eps)
    return g


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, align="top_left"), dict(softcap=1.5),
                                dict(window=(1, 0), drop=np.array([[False, True, False, False]]))])
def test_backward_matches_finite_differences(kw):
    q, k, v = make_qkv((2, 3, 5), (1, 4, 5), 3, seed=3)
    bias = np.random.default_rng(4).standard_normal((3, 4))
    w = np.random.default_rng(5).standard_normal((2, 3, 3))   # loss = Σ w ∘ out
    loss = lambda: float((w * attnkit.attention(q, k, v, bias=bias, **kw, **R)).sum())
    out, lse = attnkit.attention(q, k, v, bias=bias, return_lse=True, **kw, **R)
    grads = attnkit.attention_backward(w, q, k, v, out, lse, bias=bias, **kw, **R)
    for ours, x in zip(grads, (q, k, v, bias)):
        assert ours.shape == x.shape
        assert max_error(ours, central_difference(loss, x)) < 1e-7


def test_fully_masked_rows_give_zero_and_minus_inf_without_warnings():
    q, k, v = make_qkv((2, 4, 8), (2, 3, 8), seed=1)
    keep = np.ones((4, 3), bool)
    keep[1] = False
    with np.errstate(all="raise"):
        out, lse, w = attnkit.attention(q, k, v, keep=keep, return_lse=True, return_weights=True, **R)
        grads = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, keep=keep, **R)
    assert np.all(out[:, 1] == 0) and np.all(w[:, 1] == 0) and np.all(lse[:, 1] == -np.inf)
    assert np.all(np.isfinite(out)) and np.all(grads[0][:, 1] == 0)
    assert np.all(np.isfinite(lse[:, [0, 2, 3]]))


def test_causal_alignment_when_queries_outnumber_keys():
    """L > S, bottom-right: the first L − S queries see nothing; top-left: all see key 0."""
    q, k, v = make_qkv((4, 2), (2, 2), seed=2)
    _, lse_br = attnkit.attention(q, k, v, causal=True, return_lse=True, **R)
    _, lse_tl = attnkit.attention(q, k, v, causal=True, align="top_left", return_lse=True, **R)
    assert np.all(lse_br[:2] == -np.inf) and np.all(np.isfinite(lse_br[2:]))
    assert np.all(np.isfinite(lse_tl))


def test_decoding_row_sees_every_key_bottom_right():
    q, k, v = make_qkv((1, 4), (6, 4), seed=3)
    full = attnkit.attention(q, k, v, **R)
    assert max_error(attnkit.attention(q, k, v, causal=True, **R), full) == 0
    w = attnkit.attention(q, k, v, causal=True, align="top_left", return_weights=True, **R)[1]
    assert np.all(w[0, 1:] == 0)


def test_lse_is_log_sum_exp_of_final_scores():
    q, k, v = make_qkv((3, 5, 4), (3, 6, 4), seed=4)
    bias = np.random.default_rng(0).standard_normal((5, 6))
    _, lse = attnkit.attention(q, k, v, bias=bias, softcap=2.0, return_lse=True, **R)
    s = np.einsum("hld,hsd->hls", q, k) / 2.0
    s = 2.0 * np.tanh(s / 2.0) + bias
    assert max_error(lse, np.log(np.exp(s).sum(-1))) <= 1e-12


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_low_precision_accumulates_wide_and_returns_q_dtype(dtype):
    q, k, v = make_qkv((2, 33, 16), (2, 40, 16), seed=5)
    oracle = attnkit.attention(q, k, v, **R)
    out, lse = attnkit.attention(*(x.astype(dtype) for x in (q, k, v)), return_lse=True, **R)
    assert out.dtype == dtype and lse.dtype == np.float32
    assert max_error(out, oracle) < (2e-3 if dtype == "float16" else 1e-5)


def test_deterministic_bits():
    q, k, v, kw = random_case(7)
    a = attnkit.attention(q, k, v, return_lse=True, **kw, **R)
    b = attnkit.attention(q, k, v, return_lse=True, **kw, **R)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ---- the new terms, each against an independent formula ------------------------------------
def _softmax_with_column(scores, extra):
    """softmax over the keys and one extra column, the column dropped (sinks by hand)."""
    full = np.concatenate([scores, extra[..., None]], axis=-1)
    m = np.max(full, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(full - m)
    return (e / e.sum(-1, keepdims=True))[..., :-1], (np.log(e.sum(-1)) + m[..., 0])


@pytest.mark.parametrize("shape", ["per_head", "per_row"])
def test_sinks_are_one_extra_logit_with_zero_value(shape):
    q, k, v = make_qkv((2, 3, 5, 4), (2, 3, 7, 4), seed=1)
    rng = np.random.default_rng(2)
    sinks = rng.standard_normal(3) if shape == "per_head" else rng.standard_normal((2, 3, 5))
    keep = rng.random((5, 7)) < 0.7
    keep[2] = False                                          # a fully masked row: out 0, lse = sink
    out, lse, w = attnkit.attention(q, k, v, sinks=sinks, keep=keep, return_lse=True, return_weights=True, **R)
    scores = np.where(keep, q @ np.swapaxes(k, -1, -2) / 2.0, -np.inf)
    s = np.broadcast_to(sinks[:, None] if sinks.ndim == 1 else sinks, (2, 3, 5))
    ww, ll = _softmax_with_column(scores, s)
    assert max_error(w, ww) <= 1e-12 and max_error(lse, ll) <= 1e-12
    assert max_error(out, ww @ v) <= 1e-12
    assert np.all(out[..., 2, :] == 0) and max_error(lse[..., 2], s[..., 2]) <= 1e-12
    assert np.all(w.sum(-1) < 1)                             # the rest went to the sink


def test_sink_gradients_by_finite_differences():
    q, k, v = make_qkv((1, 2, 4, 3), (1, 2, 6, 3), seed=4)
    sinks = np.array([0.3, -1.2])
    out, lse = attnkit.attention(q, k, v, sinks=sinks, causal=True, return_lse=True, **R)
    dout = np.random.default_rng(5).standard_normal(out.shape)
    dq, dk, dv, dsinks = attnkit.attention_backward(dout, q, k, v, out, lse, sinks=sinks, causal=True, **R)
    assert dsinks.shape == (2,)
    eps = 1e-6
    for h in range(2):
        sp, sm = sinks.copy(), sinks.copy()
        sp[h] += eps
        sm[h] -= eps
        f = [(attnkit.attention(q, k, v, sinks=s, causal=True, **R) * dout).sum() for s in (sp, sm)]
        assert abs((f[0] - f[1]) / (2 * eps) - dsinks[h]) < 1e-7


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("L, S", [(5, 5), (3, 8), (8, 3)])
def test_alibi_is_minus_slope_times_distance_from_the_diagonal(align, L, S):
    q, k, v = make_qkv((2, 3, L, 4), (2, 3, S, 4), seed=L * S)
    slopes = np.array([0.5, 0.25, 0.125])
    off = S - L if align == "bottom_right" else 0
    dist = np.abs(np.arange(L)[:, None] + off - np.arange(S)[None, :])
    bias = -slopes[:, None, None] * dist
    for kw in (dict(), dict(causal=True)):
        got = attnkit.attention(q, k, v, alibi_slopes=slopes, align=align, return_lse=True, **kw, **R)
        want = attnkit.attention(q, k, v, bias=bias, align=align, return_lse=True, **kw, **R)
        assert all(max_error(a, b) <= 1e-12 for a, b in zip(got, want))
        dout = np.ones_like(got[0])
        ga = attnkit.attention_backward(dout, q, k, v, *got, alibi_slopes=slopes, align=align, **kw, **R)
        gb = attnkit.attention_backward(dout, q, k, v, *want, bias=bias, align=align, **kw, **R)[:3]
        assert all(max_error(a, b) <= 1e-12 for a, b in zip(ga, gb))


def _one_by_one(q, k, v, ql, kl, kw):
    """Each sequence attended alone (its own lengths, no lengths arguments)."""
    out = np.zeros(q.shape[:-1] + (v.shape[-1],))
    lse = np.full(q.shape[:-1], -np.inf)
    for b in range(q.shape[0]):
        if ql[b] == 0 or kl[b] == 0:
            continue
        o, l = attnkit.attention(q[b, :, :ql[b]], k[b, :, :kl[b]], v[b, :, :kl[b]], return_lse=True, **kw, **R)
        out[b, :, :ql[b]], lse[b, :, :ql[b]] = o, l
    return out, lse


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(2, 1)), dict(causal=True, align="top_left")])
def test_lengths_equal_each_sequence_alone(kw):
    q, k, v = make_qkv((4, 2, 6, 3), (4, 1, 9, 3), 2, seed=7)
    ql, kl = np.array([6, 3, 0, 1]), np.array([9, 4, 5, 0])
    got = attnkit.attention(q, k, v, q_lengths=ql, kv_lengths=kl, return_lse=True, **kw, **R)
    want = _one_by_one(q, k, v, ql, kl, kw)
    assert all(max_error(a, b) <= 1e-12 for a, b in zip(got, want))


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(1, 1)), dict(causal=True, align="top_left")])
def test_packed_equals_each_sequence_alone(kw):
    rng = np.random.default_rng(8)
    lq, lk = [3, 0, 5, 2], [4, 2, 5, 6]
    cq, ck = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q, k, v = make_qkv((2, cq[-1], 4), (1, ck[-1], 4), 3, seed=9)
    bias = rng.standard_normal((cq[-1], ck[-1]))
    out, lse = attnkit.attention(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, bias=bias, return_lse=True, **kw, **R)
    for b in range(4):
        if lq[b] == 0:
            continue
        rq, rk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        o, l = attnkit.attention(q[:, rq], k[:, rk], v[:, rk], bias=bias[rq, rk], return_lse=True, **kw, **R)
        assert max_error(out[:, rq], o) <= 1e-12 and max_error(lse[:, rq], l) <= 1e-12


def test_dropout_keeps_the_same_entries_and_averages_to_no_dropout():
    q, k, v = make_qkv((2, 8, 4), (2, 8, 4), seed=10)
    plain = attnkit.attention(q, k, v, **R)
    a = attnkit.attention(q, k, v, dropout=0.3, seed=5, **R)
    assert np.array_equal(a, attnkit.attention(q, k, v, dropout=0.3, seed=5, **R))
    assert not np.array_equal(a, attnkit.attention(q, k, v, dropout=0.3, seed=6, **R))
    assert np.array_equal(attnkit.attention(q, k, v, dropout=0.0, seed=5, **R), plain)
    mean = np.mean([attnkit.attention(q, k, v, dropout=0.3, seed=s, **R) for s in range(600)], axis=0)
    assert max_error(mean, plain) < 0.1                       # about 4 standard errors at 600 draws


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
def test_traced_alibi_step_penalises_pairs_inside_a_sequence_only():
    """The trace (what explain shows) has the ALiBi step before masking: −slope·|diag(i) − j|
    inside each packed sequence, no penalty on pairs across sequences (excluded anyway)."""
    from attnkit import reference
    from attnkit.spec import validate
    cq, ck = np.array([0, 2, 5]), np.array([0, 3, 5])
    q, k, v = make_qkv((1, 5, 4), (1, 5, 4), seed=21)
    spec = validate(q, k, v, alibi_slopes=np.array([0.5]), cu_seqlens_q=cq, cu_seqlens_k=ck)
    steps = {}
    reference.forward(spec, trace=lambda name, x: steps.setdefault(name, x))
    want = np.zeros((5, 5))
    for b in range(2):                                   # bottom-right: diag(i) = i + (k1 - q1)
        for i in range(cq[b], cq[b + 1]):
            for j in range(ck[b], ck[b + 1]):
                want[i, j] = -0.5 * abs(i + ck[b + 1] - cq[b + 1] - j)
    assert max_error((steps["alibi"] - steps["scaled"])[0], want) <= 1e-12


@pytest.mark.parametrize("which", ["q_lengths", "kv_lengths"])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True)])
def test_one_kind_of_lengths_alone_equals_each_sequence_alone(which, kw):
    """q_lengths alone or kv_lengths alone (the other side full length)."""
    q, k, v = make_qkv((3, 2, 6, 3), (3, 1, 9, 3), 2, seed=22)
    ql, kl = np.array([6, 2, 0]), np.array([9, 4, 1])
    full = dict(q_lengths=np.full(3, 6), kv_lengths=np.full(3, 9))
    full[which] = ql if which == "q_lengths" else kl
    got = attnkit.attention(q, k, v, **{which: full[which]}, return_lse=True, **kw, **R)
    want = _one_by_one(q, k, v, full["q_lengths"], full["kv_lengths"], kw)
    assert all(max_error(a, b) <= 1e-12 for a, b in zip(got, want))


@pytest.mark.parametrize("sink", [np.nan, np.inf])
def test_padding_rows_are_zero_whatever_the_sink(sink):
    """Rows past q_lengths are padding: out 0, lse -inf and weights 0 even with a
    non-finite sink (which makes every real row NaN)."""
    q, k, v = make_qkv((2, 1, 4, 3), (2, 1, 5, 3), 2, seed=23)
    out, lse, w = attnkit.attention(q, k, v, q_lengths=np.array([4, 1]), sinks=np.array([sink]),
                                    return_lse=True, return_weights=True, **R)
    assert np.all(out[1, :, 1:] == 0) and np.all(lse[1, :, 1:] == -np.inf) and np.all(w[1, :, 1:] == 0)
    assert np.isnan(out[0]).all() and np.isnan(out[1, :, 0]).all()
    w = attnkit.attention_weights(q, k, q_lengths=np.array([4, 1]), sinks=np.array([sink]), **R)
    assert np.all(w[1, :, 1:] == 0) and np.isnan(w[0]).all()


def test_a_0d_sink_is_one_logit_for_every_row():
    q, k, v = make_qkv((2, 3, 5, 4), (2, 3, 7, 4), seed=26)
    got = attnkit.attention(q, k, v, sinks=np.array(0.4), return_lse=True, **R)
    want = attnkit.attention(q, k, v, sinks=np.full(3, 0.4), return_lse=True, **R)
    assert all(max_error(a, b) <= 1e-15 for a, b in zip(got, want))
    out, lse = attnkit.attention(q, k, v, sinks=np.array(0.4), return_lse=True)      # the default rung
    assert max_error(out, want[0]) <= 1e-12 and max_error(lse, want[1]) <= 1e-12


def test_sink_gradient_of_torch_tensors_is_the_numpy_one():
    """sink_gradient serves every rung: the Triton rung and ring attention hand it
    torch tensors, the NumPy rungs arrays."""
    torch = torch_or_skip()
    from attnkit.reference import sink_gradient
    from attnkit.spec import validate
    q, k, v = make_qkv((2, 3, 4, 5), (2, 3, 6, 5), seed=27)
    sinks = np.random.default_rng(28).standard_normal((2, 3, 4))
    sinks[0, 1, 2] = -np.inf
    lse = np.random.default_rng(29).standard_normal((2, 3, 4))
    lse[1, 0] = -np.inf                                  # padding rows
    delta = np.random.default_rng(30).standard_normal((2, 3, 4))
    want = sink_gradient(validate(q, k, v, sinks=sinks), lse, delta)
    t = [torch.tensor(x) for x in (q, k, v, sinks, lse, delta)]
    got = sink_gradient(validate(*t[:3], sinks=t[3]), t[4], t[5])
    assert isinstance(got, torch.Tensor) and got.shape == want.shape
    assert max_error(got.numpy(), want) <= 1e-15


def test_padding_rows_give_their_sinks_no_gradient_even_an_infinite_one():
    q, k, v = make_qkv((2, 1, 4, 3), (2, 1, 5, 3), seed=31)
    sinks = np.full((2, 1, 4), 0.5)
    sinks[1, 0, 1:] = np.inf                             # on padding rows only
    kw = dict(q_lengths=np.array([4, 1]), sinks=sinks, **R)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    assert np.isfinite(out).all() and np.all(out[1, :, 1:] == 0)
    dq, dk, dv, dsinks = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, **kw)
    assert np.isfinite(dsinks).all() and np.all(dsinks[1, 0, 1:] == 0)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()


def test_half_precision_backward_is_the_float32_computation_rounded_once():
    q, k, v = (x.astype(np.float16) for x in make_qkv((2, 5, 8), (2, 7, 8), seed=32))
    dout = np.random.default_rng(33).standard_normal((2, 5, 8)).astype(np.float16)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, **R)
    assert lse.dtype == np.float32
    got = attnkit.attention_backward(dout, q, k, v, out, lse, causal=True, **R)
    wide = attnkit.attention_backward(*(x.astype(np.float32) for x in (dout, q, k, v, out)), lse, causal=True, **R)
    for g, w in zip(got, wide):
        assert g.dtype == np.float16 and np.array_equal(g, w.astype(np.float16))


def test_a_non_finite_dout_row_reaches_only_the_values_it_attended():
    """dv[j] = Σ_i w[i, j] dout[i]: an inf in dout[i] reaches the keys row i sees
    (NaN there) and no other (an excluded pair is exactly 0, not 0 · inf)."""
    q, k, v = make_qkv((1, 5, 4), (1, 5, 4), 3, seed=34)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, **R)
    dout = np.ones_like(out)
    dout[0, 2, 1] = np.inf                               # row 2 sees keys 0, 1, 2
    dq, dk, dv = attnkit.attention_backward(dout, q, k, v, out, lse, causal=True, **R)
    assert np.isnan(dv[0, :3, 1]).all() and np.isfinite(dv[0, 3:]).all() and np.isfinite(dv[0, :, [0, 2]]).all()
    assert np.isfinite(dk[0, 3:]).all() and np.isfinite(dq[0, [0, 1, 3, 4]]).all()
    q = q.copy()
    q[0, 2, 0] = np.inf                                  # a non-finite query row: its keys only
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, **R)
    dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, causal=True, **R)
    assert np.isnan(dk[0, :3]).any() and np.isfinite(dk[0, 3:]).all()


def test_bias_and_sink_gradients_keep_their_own_dtypes():
    q, k, v = make_qkv((2, 4, 3), (2, 6, 3), seed=37)
    bias = np.random.default_rng(38).standard_normal((4, 6)).astype(np.float32)
    sinks = np.array([0.5, -0.5], np.float32)
    out, lse = attnkit.attention(q, k, v, bias=bias, sinks=sinks, return_lse=True, **R)
    g = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, bias=bias, sinks=sinks, **R)
    assert [x.dtype for x in g] == [np.float64] * 3 + [np.float32] * 2
    assert g[3].shape == bias.shape and g[4].shape == sinks.shape


def test_a_gradient_for_lse_enters_the_backward_pass():
    """dlse (what the torch op receives when lse is used): the gradients are those of
    Σ out·dout + Σ lse·dlse, by central differences."""
    from attnkit import reference
    from attnkit.spec import validate
    q, k, v = make_qkv((2, 4, 3), (2, 6, 3), seed=35)
    spec = validate(q, k, v, causal=True)
    out, lse, _ = reference.rung_forward(spec)
    rng = np.random.default_rng(36)
    dout, dlse = rng.standard_normal(out.shape), rng.standard_normal(lse.shape)
    g = reference.rung_backward(spec, dout, out, lse, dlse)

    def loss(qq, kk):
        o, l, _ = reference.rung_forward(validate(qq, kk, v, causal=True))
        return (o * dout).sum() + (l * dlse).sum()
    eps = 1e-6
    for x, grad, i in ((q, g.dq, (1, 2, 0)), (k, g.dk, (0, 1, 2))):
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        args = [(xp, k), (xm, k)] if x is q else [(q, xp), (q, xm)]
        assert abs((loss(*args[0]) - loss(*args[1])) / (2 * eps) - grad[i]) < 1e-7
