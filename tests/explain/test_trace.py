"""attnkit.explain.trace: the trace is what attention computes, step by step — NaN
included — and bad input is named before any compute."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import attnkit
from attnkit.explain import MAX_SCORES, Trace, check_size, explain
from attnkit.testing import make_qkv, max_error


def _check_against_attention(t: Trace, q, k, v, **kw):
    """out, lse, weights of the trace equal attention's, on the reference rung (same
    code: identical) and on the flash rung (independent tiled code: 1e-12)."""
    for backend, tol in (("reference", 0.0), ("flash", 1e-12)):
        out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True,
                                        backend=backend, **kw)
        assert t.out.shape == out.shape and t.lse.shape == lse.shape and t.weights.shape == w.shape
        assert max_error(t.out, out) <= tol
        assert max_error(t.lse, lse) <= tol
        assert max_error(t.weights, w) <= tol


def _scores_by_hand(q, k, group):
    """q kᵀ with kv head h // group for query head h, by einsum."""
    k = np.repeat(k, group, axis=-3)
    return np.einsum("...ld,...sd->...ls", q, k)


CASES = {
    "plain 2-D": (((3, 4), (5, 4), 6), {}),
    "drop": (((2, 3, 4), (2, 5, 4), 3), {"drop": np.array([[0, 1, 0, 0, 1]] * 3, bool)}),
    "keep + bias + softcap": (((2, 3, 4), (2, 5, 4), None), {
        "keep": np.array([[1, 1, 0, 1, 1], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0]], bool),
        "bias": np.linspace(-1, 1, 15).reshape(3, 5), "softcap": 2.0}),
    "causal L<S bottom_right": (((2, 3, 4), (2, 7, 4), None), {"causal": True}),
    "causal L>S top_left": (((2, 6, 4), (2, 3, 4), None), {"causal": True, "align": "top_left"}),
    "causal L>S bottom_right (masked rows)": (((2, 6, 4), (2, 3, 4), None), {"causal": True}),
    "window": (((1, 5, 3), (1, 8, 3), None), {"window": (2, 1)}),
    "GQA 4 heads on 2, batch 2": (((2, 4, 5, 8), (2, 2, 6, 8), 5), {"causal": True}),
    "MQA with -inf bias": (((3, 4, 8), (1, 4, 8), None), {"bias": np.array([0.0, -np.inf, 0.5, 0.0])}),
    "sinks per head": (((2, 3, 4), (2, 5, 4), None), {"sinks": np.array([0.5, -1.0])}),
    "sinks per row": (((3, 4), (5, 4), None), {"sinks": np.array([[0.0, 2.0, -1.0]])}),
    "ALiBi + causal": (((2, 4, 3), (2, 6, 3), None), {"alibi_slopes": np.array([0.5, 0.25]),
                                                      "causal": True}),
    "lengths": (((2, 1, 3, 4), (2, 1, 5, 4), None), {"q_lengths": np.array([2, 3]),
                                                     "kv_lengths": np.array([4, 5])}),
    "packed + causal": (((5, 2), (6, 2), None), {"cu_seqlens_q": np.array([0, 2, 5]),
                                                 "cu_seqlens_k": np.array([0, 3, 6]), "causal": True}),
    "dropout": (((2, 4, 3), (2, 5, 3), None), {"dropout": 0.4, "seed": 7}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_trace_steps_equal_attention(case):
    (sq, sk, dv), kw = CASES[case]
    q, k, v = make_qkv(sq, sk, dv, seed=len(case))
    t = explain(q, k, v, **kw)
    _check_against_attention(t, q, k, v, **kw)
    # step 1 and 2 by hand, independently of the library
    q4, k4 = (x[None] if x.ndim == 2 else x for x in (q, k))
    H, Hkv = q4.shape[-3], k4.shape[-3]
    scores = _scores_by_hand(q4, k4, H // Hkv)
    scores = scores[..., 0, :, :] if q.ndim == 2 else scores
    np.testing.assert_allclose(t["scores"], scores, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(t["scaled"], scores / math.sqrt(q.shape[-1]), rtol=1e-13, atol=1e-13)
    # the softmax saw `final_scores`; excluded keys are exactly the -inf ones and get weight 0
    if "excluded" in t:
        assert t["excluded"].dtype == bool and t["excluded"].shape == t.weights.shape
        assert np.all(np.isneginf(t["masked"][t["excluded"]]))
        assert np.all(t.weights[t["excluded"]] == 0)
    rows = t.weights.sum(axis=-1)
    if t.sink_weights is not None:                  # the sink takes the rest of each row
        rows = rows + t.sink_weights
    assert np.all((np.abs(rows - 1) < 1e-12) | ((rows == 0) & np.isneginf(t.lse)))


def test_step_order_and_mask_names():
    q, k, v = make_qkv((2, 3), (4, 3))
    t = explain(q, k, v, softcap=5.0, bias=np.zeros((2, 4)), causal=True, drop=np.zeros((2, 4), bool))
    assert list(t) == ["scores", "scaled", "softcapped", "biased", "excluded", "masked",
                       "weights", "lse", "out"]
    assert t.masks == ["softcap 5", "bias", "causal (bottom_right)", "drop"]
    assert list(explain(q, k, v)) == ["scores", "scaled", "weights", "lse", "out"]
    assert explain(q, k, v).masks == [] and explain(q, k, v).excluded is None


def test_new_steps_and_mask_names():
    q, k, v = make_qkv((5, 3), (5, 3))
    t = explain(q, k, v, alibi_slopes=np.array([0.5]), sinks=np.array([0.2]), dropout=0.3, seed=1,
                cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]))
    assert list(t) == ["scores", "scaled", "alibi", "excluded", "masked", "weights", "lse",
                       "dropped", "out"]
    assert t.masks == ["ALiBi (slope 0.5)", "packed (2 sequences)", "sinks", "dropout 0.3 (seed 1)"]
    assert explain(q, k, v, q_lengths=np.array(3), kv_lengths=np.array(4)).masks == ["q_lengths", "kv_lengths"]


def test_causal_picture_matches_the_docstring():
    """spec.py draws L=2, S=4 bottom-right as 'x x x .' / 'x x x x' (x = attended)."""
    q, k, v = make_qkv((2, 3), (4, 3))
    ex = explain(q, k, v, causal=True)["excluded"]
    assert ex.tolist() == [[False, False, False, True], [False, False, False, False]]
    ex = explain(q, k, v, causal=True, align="top_left")["excluded"]
    assert ex.tolist() == [[False, True, True, True], [False, False, True, True]]


def test_fully_masked_row_gives_zero_and_minus_inf():
    q, k, v = make_qkv((4, 3), (2, 3))
    t = explain(q, k, v, causal=True)      # bottom-right, L > S: rows 0 and 1 see nothing
    assert np.all(t.out[:2] == 0) and np.all(t.weights[:2] == 0) and np.all(np.isneginf(t.lse[:2]))
    assert np.all(np.isfinite(t.out))
    assert "every key is excluded for q0" in t.render()
    assert "every key is excluded" not in "\n".join(t.reading((), 3))


# ---- sinks, ALiBi, dropout, packing ------------------------------------------------------
def test_sink_weights_are_the_rest_of_each_row():
    q, k, v = make_qkv((3, 2), (4, 2))
    t = explain(q, k, v, sinks=np.array([[0.0, 1.0, -2.0]]), causal=True, align="top_left")
    assert t.sink_weights.shape == t.lse.shape == (3,)
    np.testing.assert_allclose(t.sink_weights, 1 - t.weights.sum(axis=-1), rtol=0, atol=1e-14)
    np.testing.assert_allclose(t.sink_weights, np.exp(np.array([0.0, 1.0, -2.0]) - t.lse), rtol=1e-14)
    assert np.all(t.sink_weights > 0) and t.sink_logits.tolist() == [0.0, 1.0, -2.0]
    assert explain(q, k, v).sink_weights is None


def test_sink_weight_is_zero_on_padding_rows():
    q, k, v = make_qkv((2, 1, 3, 2), (2, 1, 4, 2))
    t = explain(q, k, v, sinks=np.array([0.5]), q_lengths=np.array([2, 3]))
    assert t.sink_weights[0, 0, 2] == 0 and np.all(t.sink_weights[1] > 0)
    assert t.padding((0, 0)).tolist() == [False, False, True] and not t.padding((1, 0)).any()


def test_alibi_penalty_is_the_step_it_adds():
    q, k, v = make_qkv((2, 3, 2), (2, 5, 2))
    slopes = np.array([0.5, 0.25])
    t = explain(q, k, v, alibi_slopes=slopes)
    i, j = np.arange(3)[:, None], np.arange(5)[None, :]
    by_hand = -slopes[:, None, None] * np.abs(i + 2 - j)         # bottom-right: diag(i) = i + S − L
    np.testing.assert_array_equal(t.alibi_penalty, by_hand)
    np.testing.assert_allclose(t["alibi"], t["scaled"] + by_hand, rtol=1e-15, atol=0)
    assert not np.signbit(t.alibi_penalty[0, 0, 2])                # 0 on the diagonal, not -0
    assert explain(q, k, v).alibi_penalty is None


def test_dropout_drops_and_rescales_the_weights():
    q, k, v = make_qkv((6, 2), (7, 2))
    t = explain(q, k, v, dropout=0.5, seed=3)
    kept = t["dropped"] != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(t["dropped"][kept], t.weights[kept] / 0.5, rtol=1e-15)
    np.testing.assert_allclose(t.out, t["dropped"] @ v, rtol=1e-13)
    plain = explain(q, k, v)
    assert t.used_weights is t["dropped"] and plain.used_weights is plain.weights
    other = explain(q, k, v, dropout=0.5, seed=4)
    assert not np.array_equal(other["dropped"] != 0, kept)          # the seed decides


def test_packed_sequences_see_only_their_own_keys():
    q, k, v = make_qkv((5, 2), (5, 2))
    t = explain(q, k, v, cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]))
    block = np.zeros((5, 5), bool)
    block[:2, :2] = block[2:, 2:] = True
    assert t.excluded.tolist() == (~block).tolist()                 # block-diagonal
    assert t.sequences() == [(0, 2, 0, 2), (2, 5, 2, 5)]
    for q0, q1, k0, k1 in t.sequences():                            # each sequence alone
        alone = explain(q[q0:q1], k[k0:k1], v[k0:k1])
        np.testing.assert_allclose(t.out[q0:q1], alone.out, rtol=1e-14)
    assert explain(q, k, v).sequences() is None


# ---- NaN and inf are carried, never hidden ------------------------------------------------
@pytest.mark.parametrize("dtype,big", [("float32", 1e20), ("float64", 1e200)])
def test_overflowing_scores_give_nan_rows_like_attention(dtype, big):
    q = np.array([[big, big], [1.0, 0.0]], dtype=dtype)
    k = np.array([[big, big], [1.0, 1.0]], dtype=dtype)
    v = np.eye(2, dtype=dtype)
    t = explain(q, k, v)
    assert np.isposinf(t["scores"][0, 0])
    assert np.isnan(t.weights[0]).all() and np.isnan(t.out[0]).all() and np.isnan(t.lse[0])
    assert np.isfinite(t.out[1]).all()
    out = attnkit.attention(q, k, v, backend="reference")
    np.testing.assert_array_equal(t.out.astype(dtype), out)        # NaN where attention has NaN


def test_nan_input_gives_nan_row_and_nan_at_an_excluded_key_does_not():
    q, k, v = make_qkv((3, 2), (3, 2))
    q[1, 0] = np.nan
    t = explain(q, k, v)
    assert np.isnan(t.out[1]).all() and np.isfinite(t.out[[0, 2]]).all()
    k[2, 1] = np.inf
    t = explain(q, k, v, drop=np.array([[0, 0, 1]] * 3, bool))    # k2 excluded everywhere
    assert np.isfinite(t.out[[0, 2]]).all() and np.isnan(t.out[1]).all()


def test_to_dict_is_strict_json_with_null_for_minus_inf():
    q, k, v = make_qkv((4, 3), (2, 3))
    t = explain(q, k, v, causal=True)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["steps"]["lse"][0] is None and d["steps"]["masked"][0] == [None, None]
    assert d["steps"]["excluded"][0] == [True, True]
    np.testing.assert_array_equal(np.array(d["steps"]["out"]), t.out)


def test_to_dict_writes_nan_and_inf_as_strings_and_the_new_options():
    q = np.array([[1e200, 1e200]])
    t = explain(q, np.array([[1e200, 1e200], [1.0, 1.0]]), np.eye(2), sinks=np.array([0.5]),
                alibi_slopes=np.array([0.1]))
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["steps"]["scores"][0][0] == "inf" and d["steps"]["weights"][0] == ["nan", "nan"]
    assert d["sinks"] == [0.5] and d["alibi_slopes"] == [0.1] and d["sink_weights"] == ["nan"]
    q, k, v = make_qkv((3, 2), (3, 2))
    d = explain(q, k, v, cu_seqlens_q=np.array([0, 1, 3]), cu_seqlens_k=np.array([0, 1, 3])).to_dict()
    assert d["cu_seqlens_q"] == [0, 1, 3] and "sink_weights" not in d


# ---- input kinds ------------------------------------------------------------------------------
def test_integer_and_list_inputs_are_read_as_float64():
    t = explain([[1, 0]], [[1, 0], [0, 1]], [[10, 0], [0, 10]])
    assert t.out.dtype == np.float64
    np.testing.assert_allclose(t.out, [[6.7, 3.3]], atol=0.01)


def test_float32_inputs_trace_in_float32():
    q, k, v = make_qkv((3, 4), (5, 4), dtype="float32")
    t = explain(q, k, v)
    assert t.out.dtype == np.float32
    ref = attnkit.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    assert max_error(t.out, ref) < 1e-5


def test_torch_tensors_with_grad_and_bfloat16():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.tensor(x).to(torch.bfloat16) for x in make_qkv((3, 4), (5, 4)))
    q.requires_grad_()
    keep = torch.ones(3, 5, dtype=torch.bool)
    keep[0, :2] = False
    t = explain(q, k, v, keep=keep, causal=True)
    assert t.out.dtype == np.float32                             # bfloat16 is read as float32
    q64, k64, v64 = (x.detach().double().numpy() for x in (q, k, v))
    ref = attnkit.attention(q64, k64, v64, keep=keep.numpy(), causal=True)
    assert max_error(t.out, ref) < 1e-5
    assert t["excluded"][0, :2].all() and not t["excluded"][0, 2]


def test_torch_sinks_alibi_and_packing():
    torch = pytest.importorskip("torch")
    q, k, v = make_qkv((5, 2), (5, 2))
    kw = dict(sinks=np.array([0.3]), alibi_slopes=np.array([0.5]),
              cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]))
    t = explain(*(torch.tensor(x) for x in (q, k, v)), **{n: torch.tensor(x) for n, x in kw.items()})
    np.testing.assert_array_equal(t.out, explain(q, k, v, **kw).out)


# ---- errors named before any compute ---------------------------------------------------------
def test_bad_inputs_raise_named_errors():
    q, k, v = make_qkv((2, 3), (4, 3))
    with pytest.raises(ValueError, match="labels: expected 4 labels, got 2"):
        explain(q, k, v, labels=["a", "b"])
    with pytest.raises(ValueError, match="v: expected shape"):
        explain(q, k, v[:3])
    with pytest.raises(TypeError, match="drop: expected a boolean mask"):
        explain(q, k, v, drop=np.zeros((2, 4)))
    with pytest.raises(TypeError, match="^foo: unexpected keyword"):
        explain(q, k, v, foo=1)
    with pytest.raises(ValueError, match="^q: cannot be read as an array"):
        explain([[1.0, 2.0], [3.0]], k, v)
    with pytest.raises(TypeError, match="^q: expected a float dtype"):
        explain(q.astype(complex), k, v)
    with pytest.raises(ValueError, match="^seed: dropout > 0 needs a seed"):
        explain(q, k, v, dropout=0.5)


@pytest.mark.parametrize("which", ["q", "k", "v", "bias", "sinks"])
def test_meta_tensors_are_named(which):
    torch = pytest.importorskip("torch")
    args = {n: torch.randn(2, 2) for n in ("q", "k", "v")}
    extra = {}
    if which in args:
        args[which] = torch.randn(2, 2, device="meta")
    else:
        extra[which] = torch.randn(*((2, 2) if which == "bias" else (1,)), device="meta")
    with pytest.raises(ValueError, match=f"^{which}: a meta tensor has a shape but no values"):
        explain(args["q"], args["k"], args["v"], **extra)


def test_sparse_tensors_are_named():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="^k: expected a dense"):
        explain(torch.randn(2, 2), torch.randn(2, 2).to_sparse(), torch.randn(2, 2))


def test_size_cap_names_the_arguments_before_anything_is_allocated(monkeypatch):
    from attnkit import reference
    monkeypatch.setattr(reference, "forward", lambda *a, **k: pytest.fail("computed"))
    big = np.broadcast_to(np.zeros(1), (2000, 4))                  # a view: no memory
    with pytest.raises(ValueError, match=r"^q, k: explain keeps every step of the 2000 × 2000 "
                                         r"score matrix; 4,000,000 scores is over its limit of 1,000,000"):
        explain(big, big, big)
    q = np.broadcast_to(np.zeros(1), (4, 300, 2))
    k = np.broadcast_to(np.zeros(1), (4, 1000, 2))
    with pytest.raises(ValueError, match="for each of 4 heads; 1,200,000 scores"):
        explain(q, k, k)
    with pytest.raises(ValueError, match=r"^v: explain shows every value; 2,000,000 values in v"):
        explain(np.zeros((2, 2)), np.zeros((2, 2)), np.broadcast_to(np.zeros(1), (2, 1_000_000)))
    torch = pytest.importorskip("torch")
    meta = torch.empty(20000, 4, device="meta")                    # the shape is checked first
    with pytest.raises(ValueError, match="400,000,000 scores"):
        explain(meta, meta, meta)


def test_size_cap_allows_the_limit_itself():
    check_size((1000, 4), (1000, 4), (1000, 4))                    # exactly MAX_SCORES
    assert MAX_SCORES == 1_000_000
    with pytest.raises(ValueError, match="^--random: "):
        check_size((1001, 4), (1000, 4), (1000, 4), arg="--random")
    check_size((2, 2), (3, 5, 2))                                  # shapes that do not fit: validate's job


def test_labels_as_one_string_or_not_a_list():
    q, k = [[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]
    assert explain(q, k, k, labels="apple,cheese").labels == ["apple", "cheese"]   # the command line's form
    with pytest.raises(TypeError, match="^labels: expected a list of 2 names, got 5"):
        explain(q, k, k, labels=5)


def test_a_huge_alibi_slope_gives_no_warning():
    """The penalty overflows to -inf, as the scores do, without a RuntimeWarning."""
    import warnings
    q = np.random.default_rng(0).standard_normal((2, 3, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = explain(q, q, q, alibi_slopes=1e308)
        assert np.isneginf(t.alibi_penalty).any()


# ---- cases a mutation run found untested ------------------------------------------
def _one_line(lines):
    return " ".join(" ".join(lines).split())


def test_final_scores_include_alibi():
    t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], np.eye(2), alibi_slopes=np.array([1.0]))
    assert t.final_scores is t["alibi"]
    assert "then ALiBi (slope 1): scores -0.293, 0" in _one_line(t.arithmetic())


def test_value_cap_allows_the_limit_itself():
    check_size((1000, 1000), (1, 1000), (1, 1000))                # q holds exactly MAX_SCORES values


def test_alibi_with_several_slopes_names_none():
    q, k, v = make_qkv((2, 3, 2), (2, 5, 2))
    assert explain(q, k, v, alibi_slopes=np.array([0.5, 0.25])).masks == ["ALiBi"]
    assert explain(q, k, v, alibi_slopes=np.array([0.5, 0.5])).masks == ["ALiBi (slope 0.5)"]


def test_to_dict_keeps_the_dropout_seed():
    q, k, v = make_qkv((3, 2), (4, 2))
    d = explain(q, k, v, dropout=0.4, seed=7).to_dict()
    assert d["dropout"] == 0.4 and d["seed"] == 7


def test_padding_of_a_batched_trace_defaults_to_the_first_block():
    q, k, v = make_qkv((2, 1, 3, 2), (2, 1, 4, 2))
    t = explain(q, k, v, q_lengths=np.array([2, 3]))
    assert t.padding().tolist() == [False, False, True]
