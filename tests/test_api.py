"""Public API: the worked example, the seed's function, named errors, properties."""


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.testing import make_qkv, max_error

Q = np.array([[1.0, 0.0]])
K = np.array([[1.0, 0.0], [0.0, 1.0]])
V = np.array([[10.0, 0.0], [0.0, 10.0]])


@pytest.mark.parametrize("backend", ["auto", "reference", "flash"])
def test_worked_example_through_attention(backend):
    out, w = attnkit.attention(Q, K, V, return_weights=True, backend=backend)
    assert np.round(w, 3).tolist() == [[0.670, 0.330]]
    assert np.round(out, 2).tolist() == [[6.70, 3.30]]


def test_worked_example_through_the_seed_function():
    out, w = attnkit.scaled_dot_product_attention(Q, K, V)
    assert np.round(w, 3).tolist() == [[0.670, 0.330]]
    assert np.round(out, 2).tolist() == [[6.70, 3.30]]


def test_worked_example_through_the_cli(capsys):
    from attnkit.cli import main
    assert main(["explain"]) == 0
    text = capsys.readouterr().out
    for number in ("0.707", "0.670", "0.330", "(6.70, 3.30)"):
        assert number in text


def test_seed_function_keeps_its_minus_1e9_behaviour():
    """A fully masked row averages V in the seed; the contract's attention gives 0."""
    q, k, v = make_qkv((3, 4), (5, 4), 2, seed=0)
    mask = np.zeros((3, 5), bool)
    mask[0, 1] = True
    mask[2] = True
    out, w = attnkit.scaled_dot_product_attention(q, k, v, mask)
    assert np.allclose(out[2], v.mean(0)) and w[0, 1] == 0
    assert max_error(out[:2], attnkit.attention(q, k, v, drop=mask)[:2]) <= 1e-12
    assert np.all(attnkit.attention(q, k, v, drop=mask)[2] == 0)


def test_keep_and_drop_say_their_polarity():
    q, k, v = make_qkv((2, 4), (3, 4), seed=1)
    m = np.array([[True, False, True], [False, True, True]])
    assert max_error(attnkit.attention(q, k, v, keep=m), attnkit.attention(q, k, v, drop=~m)) == 0
    both = attnkit.attention(q, k, v, keep=m, drop=np.array([[True, False, False]] * 2))
    assert max_error(both, attnkit.attention(q, k, v, keep=m & ~np.array([[True, False, False]] * 2))) == 0


def test_two_d_and_batched_shapes():
    q, k, v = make_qkv((5, 8), (7, 8), 3, seed=2)
    out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True)
    assert out.shape == (5, 3) and lse.shape == (5,) and w.shape == (5, 7)
    qb, kb, vb = make_qkv((2, 1, 6, 5, 8), (1, 3, 2, 7, 8), 3, seed=3)
    out = attnkit.attention(qb, kb, vb)
    assert out.shape == (2, 3, 6, 5, 3)
    for b in range(2):
        for c in range(3):
            ref = attnkit.attention(qb[b, 0], kb[0, c], vb[0, c])
            assert max_error(out[b, c], ref) <= 1e-12


def test_attention_weights_rows_from_lse():
    q, k, v = make_qkv((2, 9, 4), (2, 11, 4), seed=4)
    out, lse, w = attnkit.attention(q, k, v, causal=True, return_lse=True, return_weights=True)
    rows = [0, 8]
    for kw in (dict(lse=lse), dict()):
        got = attnkit.attention_weights(q, k, rows=rows, causal=True, **kw)
        assert got.shape == (2, 2, 11) and max_error(got, w[:, rows]) <= 1e-12


def test_merge_of_key_blocks_equals_whole():
    q, k, v = make_qkv((3, 6, 4), (3, 10, 4), seed=5)
    drop = np.zeros((6, 10), bool)
    drop[2] = True                                   # a row masked in every block
    whole, lse = attnkit.attention(q, k, v, drop=drop, return_lse=True)
    parts = [attnkit.attention(q, k[:, a:b], v[:, a:b], drop=drop[:, a:b], return_lse=True)
             for a, b in ((0, 3), (3, 4), (4, 10))]
    out, mlse = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    assert max_error(out, whole) <= 1e-12 and max_error(mlse, lse) <= 1e-12


# ---- named errors ----------------------------------------------------------------
def test_backward_checks_dout_shape():
    out, lse = attnkit.attention(Q, K, V, return_lse=True)
    with pytest.raises(ValueError, match="dout"):
        attnkit.attention_backward(np.ones((2, 2)), Q, K, V, out, lse)
    with pytest.raises(ValueError, match="lse"):
        attnkit.attention_backward(np.ones_like(out), Q, K, V, out, lse[None])


def test_no_backend_fits_lists_every_rung():
    with pytest.raises(ValueError) as e:
        attnkit.attention(Q, K, V, backend="triton")
    for name in ("flash", "reference", "torch", "triton"):
        assert f"  {name}:" in str(e.value)


# ---- properties ------------------------------------------------------------------
cases = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 5), st.integers(0, 2**31 - 1))


def draw(L, S, D, seed):
    rng = np.random.default_rng(seed)
    q, k, v = make_qkv((2, L, D), (2, S, D), 3, seed=seed)
    keep = rng.random((L, S)) < 0.7
    return rng, q, k, v, keep


@pytest.mark.parametrize("backend", ["reference", "flash"])
@settings(max_examples=60, deadline=None)
@given(cases)
def test_weights_are_a_distribution_or_zero(backend, c):
    rng, q, k, v, keep = draw(*c)
    _, w = attnkit.attention(q, k, v, keep=keep, return_weights=True, backend=backend)
    assert np.all(w >= 0)
    sums = w.sum(-1)
    assert np.allclose(sums, np.where(keep.any(-1), 1.0, 0.0), atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "flash"])
@settings(max_examples=60, deadline=None)
@given(cases)
def test_permuting_keys_and_values_together_leaves_out_unchanged(backend, c):
    rng, q, k, v, keep = draw(*c)
    p = rng.permutation(k.shape[-2])
    a = attnkit.attention(q, k, v, keep=keep, backend=backend)
    b = attnkit.attention(q, k[:, p], v[:, p], keep=keep[:, p], backend=backend)
    assert max_error(a, b) <= 1e-12


@pytest.mark.parametrize("backend", ["reference", "flash"])
@settings(max_examples=60, deadline=None)
@given(cases, st.floats(-50, 50))
def test_adding_a_constant_to_a_row_leaves_out_unchanged(backend, c, const):
    rng, q, k, v, keep = draw(*c)
    L, S = keep.shape
    row_const = np.zeros((L, S))
    row_const[rng.integers(L)] = const
    a = attnkit.attention(q, k, v, keep=keep, backend=backend)
    b = attnkit.attention(q, k, v, keep=keep, bias=row_const, backend=backend)
    assert max_error(a, b) <= 1e-10


@pytest.mark.parametrize("backend", ["reference", "flash"])
@settings(max_examples=60, deadline=None)
@given(cases)
def test_a_key_with_minus_inf_bias_contributes_nothing(backend, c):
    rng, q, k, v, keep = draw(*c)
    L, S = keep.shape
    j = rng.integers(S)
    bias = np.zeros((L, S))
    bias[:, j] = -np.inf
    v2 = v.copy()
    v2[:, j] = 1e6                                    # would dominate if it leaked in
    a = attnkit.attention(q, k, v, keep=keep, bias=bias, backend=backend)
    b = attnkit.attention(q, k, v2, keep=keep, bias=bias, backend=backend)
    assert max_error(a, b) == 0


def test_rows_are_checked():
    for rows, err in (([9], ValueError), ([[0, 1]], TypeError), ([0.5], TypeError)):
        with pytest.raises(err, match="rows"):
            attnkit.attention_weights(np.ones((5, 4)), np.ones((3, 4)), rows=rows)
    w = attnkit.attention_weights(np.eye(3), np.eye(3), rows=[-1])
    assert max_error(w, attnkit.attention_weights(np.eye(3), np.eye(3))[[2]]) == 0


def test_saved_lse_and_out_are_checked():
    out, lse = attnkit.attention(Q, K, V, return_lse=True)
    with pytest.raises(TypeError, match="lse"):
        attnkit.attention_backward(np.ones_like(out), Q, K, V, out, lse.astype(int))
    with pytest.raises(TypeError, match="dout"):
        attnkit.attention_backward(np.ones_like(out, dtype=np.float32), Q, K, V, out, lse)
    with pytest.raises(TypeError, match="lse"):
        attnkit.attention_weights(Q, K, lse=lse.astype(int))


def test_torch_q_with_numpy_companions_gets_named_errors():
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.tensor(x) for x in (Q, K, V))
    out, lse = attnkit.attention(tq, tk, tv, return_lse=True)
    with pytest.raises(TypeError, match="dout"):
        attnkit.attention_backward(np.ones((1, 2)), tq, tk, tv, out, lse)
    with pytest.raises(TypeError, match="lse"):
        attnkit.attention_weights(tq, tk, lse=lse.numpy())
    with pytest.raises(TypeError, match="keep"):
        attnkit.attention(tq, tk, tv, keep=np.ones((1, 2), bool))
    with pytest.raises(ValueError, match="k: expected a tensor on q's device"):
        attnkit.attention(tq, tk.to("meta"), tv)
    with pytest.raises(TypeError, match="outs"):
        attnkit.merge([out, out.numpy()], [lse, lse.numpy()])


def test_zero_sizes_and_numpy_bools():
    with pytest.raises(ValueError, match="positive"):
        attnkit.attention(np.ones((2, 3, 4)), np.ones((0, 3, 4)), np.ones((0, 3, 2)))
    with pytest.raises(ValueError, match="positive"):
        attnkit.attention(np.ones((3, 4)), np.ones((3, 4)), np.ones((3, 0)))
    a = attnkit.attention(np.eye(3), np.eye(3), np.eye(3), causal=np.True_)
    assert max_error(a, attnkit.attention(np.eye(3), np.eye(3), np.eye(3), causal=True)) == 0


def test_merge_rejects_integer_blocks():
    with pytest.raises(TypeError, match="lses"):
        attnkit.merge([np.ones((2, 3))], [np.zeros(2, int)])


def test_seed_mask_names_itself_and_reads_truthy_values_like_the_seed():
    with pytest.raises(ValueError, match="mask"):
        attnkit.scaled_dot_product_attention(Q, K, V, mask=np.ones((3, 3), bool))
    a = attnkit.scaled_dot_product_attention(Q, K, V, mask=np.array([[0, 1]]))
    b = attnkit.scaled_dot_product_attention(Q, K, V, mask=np.array([[False, True]]))
    assert max_error(a[0], b[0]) == 0 and a[0][0].tolist() == [10.0, 0.0]


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
def test_two_d_q_against_batched_keys_round_trips_through_backward():
    """A 2-D q broadcast against batched k, v: out (B, L, Dv) and lse (B, L) — no head
    axis — and attention_weights / attention_backward take those shapes back."""
    q = make_qkv((3, 4), (5, 4), seed=24)[0]
    k, v = make_qkv((2, 1, 5, 4), (2, 1, 5, 4), 3, seed=25)[1:]
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 3, 3) and lse.shape == (2, 3)
    for b in range(2):
        assert max_error(out[b], attnkit.attention(q, k[b, 0], v[b, 0])) <= 1e-12
    w = attnkit.attention_weights(q, k, lse=lse)
    assert w.shape == (2, 3, 5) and max_error(w, attnkit.attention_weights(q, k)) <= 1e-12
    dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    with pytest.raises(ValueError, match=r"^dout\b"):
        attnkit.attention_backward(np.ones((3, 3)), q, k, v, out, lse)


@pytest.mark.parametrize("seed", [2 ** 63 - 1, 2 ** 63, 2 ** 64 - 1])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_seeds_past_int64_drop_the_same_on_every_rung(seed, dtype):
    """Seeds take all 64 bits: the flash rung's compiled kernel (int64 arguments) once
    overflowed on seeds >= 2**63 that validation accepts. Forward and backward agree
    with the reference."""
    q, k, v = (x.astype(dtype) for x in make_qkv((2, 6, 8), (2, 40, 8), 8, seed=26))
    kw = dict(dropout=0.4, seed=seed, causal=True)
    out, lse = attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)
    want, want_lse = attnkit.attention(q, k, v, return_lse=True, backend="reference", **kw)
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert max_error(out, want) <= tol and max_error(lse, want_lse) <= tol
    grads = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse, backend="flash", **kw)
    ref = attnkit.attention_backward(np.ones_like(out), q, k, v, want, want_lse, backend="reference", **kw)
    assert all(max_error(g, r) <= 10 * tol for g, r in zip(grads, ref))


@pytest.mark.parametrize("flag", ["return_lse", "return_weights"])
def test_return_flags_are_booleans(flag):
    """A string like "False" is truthy and would change what the call returns."""
    q = np.eye(2)
    with pytest.raises(TypeError, match=f"^{flag}"):
        attnkit.attention(q, q, q, **{flag: "False"})
    if flag == "return_lse":
        with pytest.raises(TypeError, match="^return_lse"):
            attnkit.attention_kvcache(np.ones((1, 1, 1, 2)), np.zeros((1, 1, 4, 2)), np.zeros((1, 1, 4, 2)),
                                      np.array([1]), return_lse=1)
    assert len(attnkit.attention(q, q, q, **{flag: np.True_})) == 2


def test_type_hints_resolve_at_run_time():
    """typing.get_type_hints (pydantic, beartype, typeguard) reads the public functions."""
    import sys
    import typing
    if sys.version_info < (3, 11):
        pytest.skip("typing.Unpack is Python 3.11's")
    for f in (attnkit.attention, attnkit.attention_weights, attnkit.attention_backward, attnkit.attention_kvcache):
        assert "masking" in typing.get_type_hints(f)


def test_two_d_backward_equals_the_one_head_call():
    """2-D inputs through attention_backward: dout and out (L, Dv) and lse (L,) get their
    head axis back as (1, L, Dv) and (1, L) — lse put on the other side, (L, 1), still
    broadcasts and gives every row another row's lse (wrong gradients, right shapes)."""
    q, k, v = make_qkv((3, 4), (5, 4), 3, seed=27)
    dout = np.random.default_rng(28).standard_normal((3, 3))
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True)
    grads = attnkit.attention_backward(dout, q, k, v, out, lse, causal=True)
    heads = attnkit.attention_backward(dout[None], q[None], k[None], v[None], out[None], lse[None], causal=True,
                                       backend="reference")
    assert all(g.shape == x.shape and max_error(g, h[0]) <= 1e-12 for g, h, x in zip(grads, heads, (q, k, v)))


def test_torch_backward_with_dropout_needs_the_forward_seed():
    """Torch tensors may leave the dropout seed to torch in the forward pass, but the
    backward must drop what the forward dropped: without the seed it is a named error,
    not a gradient from a freshly drawn seed."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x) for x in make_qkv((2, 3, 4), (2, 5, 4), 3, seed=29))
    out, lse = attnkit.attention(q, k, v, dropout=0.3, return_lse=True)
    with pytest.raises(ValueError, match="^seed: attention_backward with dropout needs the seed"):
        attnkit.attention_backward(torch.ones_like(out), q, k, v, out, lse, dropout=0.3)


def test_attention_weights_runs_in_autocasts_dtype():
    """Under torch.autocast, attention_weights takes q and k in autocast's dtype, as
    attention does: a float32 q next to a bfloat16 k (a model's rotary embedding) is
    one bfloat16 call — not a TypeError about mixed dtypes — and float64 is left alone."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(30)
    q, k = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 7, 8, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = attnkit.attention_weights(q, k, causal=True, rows=[0, 4])
        assert attnkit.attention_weights(q.double(), k.double(), causal=True).dtype == torch.float64
    assert w.dtype == torch.bfloat16 and torch.equal(w, attnkit.attention_weights(q.bfloat16(), k, causal=True,
                                                                                 rows=[0, 4]))


def test_api_imports_on_python_3_10(monkeypatch):
    """attnkit supports Python 3.10 (pyproject), whose typing has no Unpack, and does not
    depend on typing_extensions: api.py imports Unpack from 3.11 on only (a version test
    of (3, 10), or the typing_extensions import outside TYPE_CHECKING, breaks ``import
    attnkit`` there). Run here as api.py executed afresh with a 3.10 version and
    neither module offering Unpack."""
    import importlib.util
    import sys
    import typing
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    monkeypatch.delattr(typing, "Unpack", raising=False)
    monkeypatch.setitem(sys.modules, "typing_extensions", None)
    spec = importlib.util.spec_from_file_location("attnkit._api_on_3_10", attnkit.api.__file__)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert not hasattr(mod, "Unpack") and max_error(mod.attention(Q, K, V), attnkit.attention(Q, K, V)) == 0
