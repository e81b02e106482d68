"""NaN and inf are never turned into numbers (DESIGN.md §2): a NaN or inf that reaches
a row's softmax or weighted sum makes that row NaN, as PyTorch SDPA does; excluded
keys are exempt (their scores and values are never read); every rung agrees —
reference, flash (both kernel sets, small tiles so that excluded tiles are skipped
or cut), and the torch op on CPU tensors — forward and backward."""

import numpy as np
import pytest

import attnkit
from attnkit import flash, nonfinite, reference
from attnkit.nonfinite import all_finite, exempt_matmul
from attnkit.spec import validate
from attnkit.testing import make_qkv

torch = pytest.importorskip("torch")


def same(a, b, tol=1e-12, oracle=None):
    """Equal NaN and inf patterns; finite entries within tol (relative to the size of
    the value when it is larger than 1) — or, given the float64 oracle, no farther
    from it than twice b (DESIGN.md §6's rule, entry by entry: where b is float32
    rounding noise, as a gradient through a key 10²⁰ long, the oracle decides)."""
    if a is None or b is None:
        assert a is None and b is None
        return
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    assert np.array_equal(np.isnan(a), np.isnan(b)), (np.isnan(a).sum(), np.isnan(b).sum())
    assert np.array_equal(np.isposinf(a), np.isposinf(b)) and np.array_equal(np.isneginf(a), np.isneginf(b))
    fin = np.isfinite(a)
    close = np.abs(a - b) <= tol * np.maximum(1, np.abs(b))
    if oracle is not None:
        o = np.asarray(oracle, np.float64)
        with np.errstate(invalid="ignore"):
            close |= np.abs(a - o) <= 2 * np.abs(b - o) + tol * np.maximum(1, np.abs(o))
    assert close[fin].all()


def case(kind):
    """(q, k, v, kw, rows that must be NaN or None): one non-finite input per case."""
    q, k, v = make_qkv((2, 6, 4), (1, 6, 4), 3, seed=3)
    kw = {}
    if kind == "nan_key":                        # every row sees key 2
        k[0, 2, 1] = np.nan
    elif kind == "nan_query_row":
        q[1, 4, 0] = np.nan
    elif kind == "nan_query_row_causal":         # row 2's NaN out must not reach keys 3..5
        q[1, 2, 0] = np.nan
        kw["causal"] = True
    elif kind == "inf_key":
        k[0, 3, 2] = np.inf
    elif kind == "overflow":                     # scores beyond float32
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
        q[0, 1] *= 1e20
        k[0, 5] *= 1e20
    elif kind == "inf_bias":
        kw["bias"] = np.zeros((6, 6))
        kw["bias"][2, 4] = np.inf
    elif kind == "nan_bias_excluded":            # a NaN bias on an excluded key: exempt
        kw["bias"] = np.zeros((6, 6))
        kw["bias"][1, 4] = np.nan
        kw["causal"] = True
    elif kind == "nan_key_excluded":             # key 4 unseen by rows 0..3 under causal
        k[0, 4, 0] = np.nan
        kw["causal"] = True
    elif kind == "nan_value_excluded":
        v[0, 4, 1] = np.nan
        kw["causal"] = True
    elif kind == "inf_value_excluded_by_keep":
        v[0, 1, 0] = np.inf
        kw["keep"] = np.ones((6, 6), bool)
        kw["keep"][:3, 1] = False
    elif kind == "nan_sink":
        kw["sinks"] = np.array([0.0, np.nan])
    elif kind == "inf_sink":
        kw["sinks"] = np.array([np.inf, 0.0])
    return q, k, v, kw


KINDS = ["nan_key", "nan_query_row", "nan_query_row_causal", "inf_key", "overflow", "inf_bias", "nan_bias_excluded",
         "nan_key_excluded", "nan_value_excluded", "inf_value_excluded_by_keep", "nan_sink", "inf_sink"]


def sdpa(q, k, v, kw):
    """PyTorch's F.scaled_dot_product_attention on the same inputs: the boolean masks as
    a boolean attn_mask, a bias as an additive float mask (excluded keys -inf); with
    sinks, the eager formula (softmax over the scores and a sink column, which is
    dropped), since SDPA has no sinks."""
    import torch.nn.functional as F
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    keep = torch.ones(6, 6, dtype=torch.bool)
    if kw.get("causal"):
        keep &= torch.ones(6, 6, dtype=torch.bool).tril()
    if "keep" in kw:
        keep &= torch.tensor(kw["keep"])
    if "sinks" in kw:
        scores = (tq @ tk.transpose(-1, -2) / 2.0).masked_fill(~keep, float("-inf"))
        sink = torch.tensor(kw["sinks"]).to(scores.dtype)[:, None, None].expand(2, 6, 1)
        return torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1] @ tv
    mask = keep
    if "bias" in kw:
        mask = torch.tensor(kw["bias"]).to(tq.dtype).masked_fill(~keep, float("-inf"))
    return F.scaled_dot_product_attention(tq, tk.expand(2, 6, 4), tv.expand(2, 6, 3), attn_mask=mask)


@pytest.mark.parametrize("kind", KINDS)
def test_every_rung_agrees_forward(kind, monkeypatch):
    q, k, v, kw = case(kind)
    ref_out, ref_lse = attnkit.attention(q, k, v, return_lse=True, backend="reference", **kw)
    assert not np.isfinite(ref_out).all() or kind.endswith("excluded") or kind.endswith("keep")
    for use in (False, True):
        monkeypatch.setattr(flash.kernels, "USE_COMPILED", use)
        for blocks in (dict(block_m=2, block_n=2), dict(block_m=1, block_n=3), {}):
            out, lse, _ = flash.rung_forward(validate(q, k, v, **kw), **blocks)
            same(out, ref_out, 1e-5)
            same(lse, ref_lse, 1e-5)
    tq, tk, tv = (torch.tensor(x) for x in (q, k, v))
    tkw = {n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    for rung in ("flash", "reference"):                  # the torch op over each CPU rung
        out, lse = attnkit.attention(tq, tk, tv, return_lse=True, backend=rung, **tkw)
        same(out.numpy(), ref_out, 1e-5)
        same(lse.numpy(), ref_lse, 1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_matches_pytorch_where_it_reads_the_same_values(kind):
    """PyTorch's softmax on masked_fill'ed scores, visible values only: the same NaN
    rows and the same numbers elsewhere."""
    q, k, v, kw = case(kind)
    if kind in ("nan_bias_excluded", "nan_key_excluded"):
        pytest.skip("PyTorch scores an excluded key before masking it (NaN + -inf is NaN); "
                    "attnkit exempts excluded keys from their scores (DESIGN.md §2)")
    ours = attnkit.attention(q, k, v, backend="reference", **kw)
    peer = sdpa(q, k, v, kw).numpy()
    if kind in ("nan_value_excluded", "inf_value_excluded_by_keep"):
        # 0 · NaN in PyTorch's matmul poisons rows that never see the key; attnkit's exempt
        # keys do not: compare on the rows PyTorch computes from visible values alone
        rows = np.isfinite(peer).all(-1)
        same(ours[rows], peer[rows], 1e-6)
        return
    same(ours, peer, 1e-6)


def test_rows_that_do_not_see_a_nan_are_exact():
    q, k, v, kw = case("nan_key_excluded")
    clean_k = k.copy()
    clean_k[0, 4, 0] = 0.0
    out = attnkit.attention(q, k, v, backend="flash", **kw)
    want = attnkit.attention(q, clean_k, v, backend="flash", **kw)
    assert np.isnan(out[:, 4:]).all() and np.array_equal(out[:, :4], want[:, :4])


@pytest.mark.parametrize("kind", KINDS)
def test_every_rung_agrees_backward(kind, monkeypatch):
    q, k, v, kw = case(kind)
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="reference", **kw)
    dout = np.random.default_rng(0).standard_normal(out.shape).astype(out.dtype)
    want = reference.rung_backward(validate(q, k, v, **kw), dout, out, lse)
    wide = [x.astype(np.float64) for x in (q, k, v)]
    oracle = reference.rung_backward(validate(*wide, **kw), dout.astype(np.float64),
                                     *attnkit.attention(*wide, return_lse=True, backend="reference", **kw))
    for use in (False, True):
        monkeypatch.setattr(flash.kernels, "USE_COMPILED", use)
        for blocks in (dict(block_m=2, block_n=2), {}):
            got = flash.rung_backward(validate(q, k, v, **kw), dout, out, lse, **blocks)
            for a, b, o in zip(got, want, oracle):
                same(a, b, 1e-5, o)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tkw = {n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}
    for rung in ("flash", "reference"):                  # the torch op over each CPU rung
        tout = attnkit.attention(tq, tk, tv, backend=rung, **tkw)
        grads = torch.autograd.grad(tout, (tq, tk, tv), torch.tensor(dout))
        for a, b, o in zip(grads, want, oracle):
            same(a.numpy(), b, 1e-5, o)


@pytest.mark.parametrize("where", ["q", "lse"])
def test_the_backward_checks_each_operand_it_reads(where):
    """attention_backward with a NaN in q (or lse) that the saved out does not carry:
    each tile checks what it multiplies, so an excluded key still gets no NaN."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 1, 6, 4))
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True, backend="reference")
    dout = rng.standard_normal(out.shape)
    if where == "q":
        q = q.copy()
        q[0, 2, 0] = np.nan
    else:
        lse = lse.copy()
        lse[0, 2] = np.nan
    want = reference.rung_backward(validate(q, k, v, causal=True), dout, out, lse)
    for blocks in (dict(block_m=2, block_n=2), {}):
        got = flash.rung_backward(validate(q, k, v, causal=True), dout, out, lse, **blocks)
        for a, b in zip(got, want):
            same(a, b, 1e-10)


def test_excluded_keys_get_exactly_zero_gradient_even_when_non_finite():
    q, k, v, kw = case("nan_value_excluded")
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)
    dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="flash", **kw)
    assert np.isfinite(dq[:, :4]).all()                   # rows 0..3 never see key 4
    assert np.isnan(dq[:, 4:]).any()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("exclusion", ["causal", "keep", "bias"])
def test_an_overflowing_dout_v_on_an_excluded_pair_gives_no_nan(dtype, exclusion):
    """Finite inputs whose dout · vᵀ overflows on an excluded pair (rows 0..4 against
    key 5, whose value is near the dtype's limit; excluded by causal, a keep mask or a
    −inf bias): the pair gets exactly 0, as on the reference, not 0 · inf = NaN. Row
    5, which sees key 5, has dout 0."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((3, 2, 6, 4)).astype(dtype)
    v[:, 5] = np.finfo(dtype).max / 2
    lower = np.tril(np.ones((6, 6), bool))
    kw = {"causal": dict(causal=True), "keep": dict(keep=lower),
          "bias": dict(bias=np.where(lower, 0.0, -np.inf).astype(dtype))}[exclusion]
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="reference", **kw)
    dout = np.ones_like(out)
    dout[:, 5] = 0
    want = reference.rung_backward(validate(q, k, v, **kw), dout, out, lse)
    assert all(np.isfinite(x).all() for x in want if x is not None)
    for use in (False, True):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(flash.kernels, "USE_COMPILED", use)
            for blocks in (dict(block_m=2, block_n=2), {}):
                got = flash.rung_backward(validate(q, k, v, **kw), dout, out, lse, **blocks)
                for a, b in zip(got, want):
                    same(a, b, 1e-5)


def test_an_overflow_from_delta_on_an_excluded_pair_gives_no_nan():
    """dp − delta overflows where dp alone does not: delta = 2.9e38 (from keys in other
    tiles) against dp = −6.8e37 on a pair a keep mask excludes, in tiles of one key
    whose ‖dout‖ ‖v‖ is small. The pair gets 0, as on the reference."""
    q, k = np.ones((1, 3, 1), np.float32), np.ones((1, 3, 1), np.float32)
    v = np.array([[[1.7e19], [1.7e19], [-0.4e19]]], np.float32)
    keep = np.tril(np.ones((3, 3), bool))
    out, lse = attnkit.attention(q, k, v, keep=keep, return_lse=True, backend="reference")
    dout = np.array([[[1.7e19], [1.7e19], [0.0]]], np.float32)
    want = reference.rung_backward(validate(q, k, v, keep=keep), dout, out, lse)
    assert all(np.isfinite(x).all() for x in want if x is not None)
    got = flash.rung_backward(validate(q, k, v, keep=keep), dout, out, lse, block_m=1, block_n=1)
    for a, b in zip(got, want):
        same(a, b, 1e-5)


@pytest.mark.parametrize("small", [1 << 15, 0])     # both of all_finite's branches (by size)
def test_helpers(small, monkeypatch):
    monkeypatch.setattr(nonfinite, "_SMALL", small)
    assert all_finite(np.ones(3), None) and not all_finite(np.array([1.0, np.inf]))
    assert all_finite(np.full(4, np.finfo(np.float16).max, np.float16))   # a sum that overflows is not a NaN
    x = np.zeros((2, 5, 3, 4), np.float32)
    x[1, 4, 2, 3] = np.nan
    for view in (np.swapaxes(x, 1, 2), x[:, ::-1], x[..., 3:], np.broadcast_to(x[1:], x.shape)):
        assert not all_finite(view)                      # permuted, reversed, sliced, broadcast views
    assert all_finite(np.swapaxes(x, 1, 2)[:1]) and all_finite(x[..., :3])
    a = np.array([[0.5, 0.0], [0.25, 0.75]])
    b = np.array([[1.0, 2.0], [np.inf, 3.0]])
    vis = np.array([[True, False], [True, True]])
    r = exempt_matmul(a, b, vis)
    assert np.array_equal(r[0], [0.5, 1.0]) and np.isnan(r[1, 0]) and r[1, 1] == 0.25 * 2 + 0.75 * 3


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("rows", [1, 3])
def test_an_inf_value_a_row_sees_gives_nan_on_the_fast_paths(dtype, rows):
    """Few float32 rows take the compiled streaming kernel and a KV cache's fully
    visible tiles take the plain product: an inf value seen there must still give NaN
    (not inf), as on the reference."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, rows, 8)).astype(dtype)
    k = rng.standard_normal((1, 1, 3000, 8)).astype(dtype)
    v = rng.standard_normal((1, 1, 3000, 8)).astype(dtype)
    v[0, 0, 10, 3] = np.inf
    v[0, 0, 2000, 5] = -np.inf                          # past the cache length below: never read
    want = attnkit.attention(q, k[:, :, :1500], v[:, :, :1500], backend="reference")
    assert np.isnan(want[..., 3]).all() and np.isfinite(np.delete(want, 3, -1)).all()
    same(attnkit.attention(q, k[:, :, :1500], v[:, :, :1500], backend="flash"), want, 1e-4)
    kc, vc = k.copy(), v.copy()
    same(attnkit.attention_kvcache(q, kc, vc, np.array([1500]), backend="flash"), want, 1e-4)


@pytest.mark.parametrize("dtype, rows", [("float64", 1), ("float32", 80)])
def test_a_key_whose_score_is_minus_inf_exempts_its_nan_value_in_a_kv_cache(dtype, rows):
    """A +inf key that a row's q turns into a score of exactly -inf is excluded like a
    masked key: its NaN value must not reach the row, also in a KV cache's tile that
    every row sees (tiles, not the streaming kernel: float64, or more than 64 rows);
    those tiles were once taken as free of exclusions and gave NaN."""
    rng = np.random.default_rng(2)
    q = -np.ones((1, 2, rows, 8), dtype)
    k, v = (rng.standard_normal((1, 2, 50, 8)).astype(dtype) for _ in range(2))
    k[0, :, 7], v[0, :, 7] = np.inf, np.nan
    want = attnkit.attention_kvcache(q, k, v, np.array([50]), backend="reference")
    assert np.isfinite(want).all()
    same(attnkit.attention_kvcache(q, k, v, np.array([50]), backend="flash"), want, 1e-6)
    same(attnkit.attention(q, k, v, backend="flash"), want, 1e-6)


def test_exempt_matmul_takes_a_visibility_that_broadcasts():
    """visible may be any shape that broadcasts to a's (a row of keys, one column)."""
    rng = np.random.default_rng(1)
    a = rng.random((2, 3, 4))
    b = rng.standard_normal((2, 4, 5))
    b[1, 2, 3] = np.inf
    for vis in (np.array([True, True, False, True]), np.ones((3, 1), bool), np.ones((1, 3, 4), bool)):
        full = np.broadcast_to(vis, a.shape)
        aa = np.where(full, a, 0.0)
        got = exempt_matmul(aa, b, vis)
        bad = ~np.isfinite(b)
        want = np.where(np.matmul(full, bad) > 0, np.nan, aa @ np.where(bad, 0.0, b))
        assert np.array_equal(got, want, equal_nan=True)
        assert np.isnan(got[1, :, 3]).all() == bool(full[1, :, 2].all())


@pytest.mark.parametrize("backend", ["reference", "small", "flash"])
def test_a_float16_result_past_its_range_is_inf_without_a_warning(backend):
    """Rungs compute under one floating-point state (nonfinite.quiet), their casts to
    the caller's dtype included: a float16 output (dropout's 1/(1 − p) on values near
    float16's largest) or gradient (dq ~ 10⁶) past its range is inf, never a warning or,
    under np.errstate(all="raise"), an error."""
    import warnings
    q = np.array([[0.01], [0.02]], np.float16)
    k = np.array([[0.0], [100.0]], np.float16)
    v = np.array([[0.0], [60000.0]], np.float16)
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        out, lse = attnkit.attention(q, k, v, scale=1.0, dropout=0.5, seed=1, return_lse=True, backend=backend)
        assert out.dtype == np.float16 and np.isinf(out).any()
        out, lse = attnkit.attention(q, k, v, scale=1.0, return_lse=True, backend=backend)
        dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, scale=1.0, backend=backend)
        assert dq.dtype == np.float16 and np.isinf(dq).all()


@pytest.mark.parametrize("backend", ["reference", "flash"])
def test_softcap_gradient_of_an_excluded_pair_whose_score_is_nan(backend):
    """softcap: row 0 does not see key 1 (causal), whose k holds inf where q's row 0
    holds 0, so that pair's raw score is inf · 0 = NaN. Excluded pairs are exempt
    (DESIGN.md §2): the softcap factor 1 − tanh² is applied on the pairs a row sees
    only, and no gradient is NaN."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    q[0, 0, 0], q[0, 1, 0], k[0, 1, 0] = 0.0, 1.0, float("inf")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attnkit.attention(*leaves, softcap=2.0, causal=True, backend=backend)
    dq, dk, dv = torch.autograd.grad(out.sum(), leaves)
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(dq[0, 0]).all()     # row 0: only key 0
    assert torch.equal(dk[0, 1], torch.zeros(16, dtype=torch.float64))        # key 1: saturated, or unseen
    assert torch.isnan(dq[0, 1, 0])                 # row 1 sees key 1: (1 − tanh²) · inf, as autograd's
