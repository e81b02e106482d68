"""Bad input gets a TypeError/ValueError whose message starts with the argument's name
as the user wrote it, before any compute — for every argument of every public
function, the new masking keywords included."""

import re

import numpy as np
import pytest

import attnkit

Q, K, V = np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 2))
Q4, K4, V4 = np.ones((2, 2, 5, 4)), np.ones((2, 1, 6, 4)), np.ones((2, 1, 6, 3))

BAD = [
    (TypeError, "q", dict(q=np.ones((2, 4), int))),
    (TypeError, "q", dict(q=None)),
    (TypeError, "v", dict(v=None)),
    (ValueError, "q", dict(q=[[1.0, 2.0], [3.0]])),                   # ragged lists
    (TypeError, "q", dict(q=[["a", 1.0]])),
    (TypeError, "k", dict(k=np.ones((3, 4), np.float32))),
    (TypeError, "keep", dict(keep=np.ones((2, 3)))),
    (TypeError, "drop", dict(drop=np.ones((2, 3), int))),
    (TypeError, "bias", dict(bias=np.ones((2, 3), int))),
    (ValueError, "k", dict(k=np.ones((3, 5)))),
    (ValueError, "v", dict(v=np.ones((4, 2)))),
    (ValueError, "k: query heads H=3", dict(q=np.ones((3, 2, 4)), k=np.ones((2, 3, 4)), v=np.ones((2, 3, 2)))),
    (ValueError, "keep", dict(keep=np.ones((2, 4), bool))),
    (ValueError, "bias", dict(bias=np.ones((5, 2, 3)))),
    (ValueError, "window", dict(window=(-1, 0))),
    (ValueError, "window", dict(window=(1, 2, 3))),
    (ValueError, "window", dict(window=(True, 2))),
    (ValueError, "align", dict(align="center", causal=True)),
    (ValueError, "align", dict(align=np.array(["top_left"]))),
    (TypeError, "causal", dict(causal=1)),
    (ValueError, "backend", dict(backend="cuda")),
    (ValueError, "backend", dict(backend=["flash"])),
    (ValueError, "scale", dict(scale=float("nan"))),
    (ValueError, "scale", dict(scale="1")),
    (ValueError, "softcap", dict(softcap=0.0)),
    (ValueError, "q", dict(q=np.ones(4))),
    (ValueError, "q, k, v: leading batch dims",
     dict(q=np.ones((2, 1, 2, 4)), k=np.ones((3, 1, 3, 4)), v=np.ones((3, 1, 3, 2)))),
    (ValueError, "q, k, v: batch dims must be non-empty",
     dict(q=np.ones((0, 1, 2, 4)), k=np.ones((0, 1, 3, 4)), v=np.ones((0, 1, 3, 2)))),
    (TypeError, "winodw", dict(winodw=(1, 1))),                       # a typo is not silently ignored
    # the new keywords
    (TypeError, "alibi_slopes", dict(alibi_slopes=np.ones(1, int))),
    (ValueError, "alibi_slopes", dict(alibi_slopes=np.ones(3))),
    (TypeError, "sinks", dict(sinks=np.ones(1, bool))),
    (ValueError, "sinks", dict(sinks=np.ones(2))),                    # 1-D means one per head: H = 1
    (ValueError, "sinks", dict(sinks=np.ones((1, 3)))),
    (ValueError, "dropout", dict(dropout=1.0)),
    (ValueError, "dropout", dict(dropout=-0.1)),
    (ValueError, "dropout", dict(dropout=True)),
    (ValueError, "seed", dict(dropout=0.1)),                          # NumPy arrays need a seed
    (ValueError, "seed", dict(dropout=0.1, seed=-5)),
    (ValueError, "seed", dict(dropout=0.1, seed=2 ** 64)),
    (ValueError, "seed", dict(seed=1.5)),
]

BAD_4D = [
    (TypeError, "q_lengths", dict(q_lengths=np.array([1.0, 2.0]))),
    (TypeError, "kv_lengths", dict(kv_lengths=np.array([True, False]))),
    (ValueError, "kv_lengths", dict(kv_lengths=np.array([7, 2]))),    # S = 6
    (ValueError, "q_lengths", dict(q_lengths=np.array([-1, 2]))),
    (ValueError, "q_lengths", dict(q_lengths=np.array([1, 2, 3]))),   # batch is (2,)
    (ValueError, "q", dict(cu_seqlens_q=np.array([0, 5]), cu_seqlens_k=np.array([0, 6]))),   # batch 2
]

PACKED = dict(q=np.ones((2, 7, 4)), k=np.ones((1, 9, 4)), v=np.ones((1, 9, 3)))
BAD_PACKED = [
    (ValueError, "cu_seqlens_k", dict(cu_seqlens_q=np.array([0, 3, 7]))),
    (ValueError, "cu_seqlens_q", dict(cu_seqlens_k=np.array([0, 3, 9]))),
    (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=np.array([1, 3, 7]), cu_seqlens_k=np.array([0, 3, 9]))),
    (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=np.array([0, 4, 3, 7]), cu_seqlens_k=np.array([0, 3, 4, 9]))),
    (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=np.array([0, 3, 6]), cu_seqlens_k=np.array([0, 3, 9]))),
    (ValueError, "cu_seqlens_k", dict(cu_seqlens_q=np.array([0, 3, 7]), cu_seqlens_k=np.array([0, 9]))),
    (TypeError, "cu_seqlens_q", dict(cu_seqlens_q=np.array([0.0, 7.0]), cu_seqlens_k=np.array([0, 9]))),
    (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=np.array([[0, 7]]), cu_seqlens_k=np.array([0, 9]))),
    (ValueError, "q_lengths", dict(cu_seqlens_q=np.array([0, 7]), cu_seqlens_k=np.array([0, 9]),
                                   q_lengths=np.array(3))),
]


def _call(base, kw):
    args = dict(base)
    args.update(kw)
    return attnkit.attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def _cases(table):
    return pytest.mark.parametrize("error,name,kw", table, ids=[f"{e.__name__}-{n}-{i}" for i, (e, n, _) in enumerate(table)])


@_cases(BAD)
def test_bad_input_gets_a_named_error(error, name, kw):
    with pytest.raises(error, match=rf"^{re.escape(name)}(?!\w)"):   # the message starts with the name
        _call(dict(q=Q, k=K, v=V), kw)


@_cases(BAD_4D)
def test_bad_lengths_get_a_named_error(error, name, kw):
    with pytest.raises(error, match=rf"^{re.escape(name)}(?!\w)"):
        _call(dict(q=Q4, k=K4, v=V4), kw)


@_cases(BAD_PACKED)
def test_bad_packed_offsets_get_a_named_error(error, name, kw):
    with pytest.raises(error, match=rf"^{re.escape(name)}(?!\w)"):
        _call(PACKED, kw)


def test_scalar_masks_broadcast():
    """A 0-d keep / drop / bias is a scalar that broadcasts, as in NumPy and PyTorch."""
    plain = attnkit.attention(Q, K, V)
    assert np.array_equal(attnkit.attention(Q, K, V, keep=np.array(True)), plain)
    out, lse = attnkit.attention(Q, K, V, keep=np.array(False), return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    assert np.allclose(attnkit.attention(Q, K, V, bias=np.array(3.0)), plain)


def test_rows_are_checked_without_wrap_around():
    for rows, err in ((np.array([2 ** 64 - 1], np.uint64), ValueError), ([2], ValueError), ([-3], ValueError),
                      ([[0]], TypeError), ([0.5], TypeError), (None, None)):
        if err is None:
            attnkit.attention_weights(Q, K, rows=rows)
            continue
        with pytest.raises(err, match=r"^rows\b"):
            attnkit.attention_weights(Q, K, rows=rows)


def test_merge_blocks_are_checked():
    o, lse = attnkit.attention(Q, K, V, return_lse=True)
    for outs, lses, err, name in ((None, None, TypeError, "outs"), ([o], None, TypeError, "lses"),
                                  ([np.float64(1.0)], [np.float64(0.0)], TypeError, "outs[0]"),
                                  ([o, o], [lse], ValueError, "merge"), ([o], [lse[:1]], ValueError, "lses[0]"),
                                  ("ab", "ab", TypeError, "outs"), ([o], [lse.astype(int)], TypeError, "lses[0]")):
        with pytest.raises(err, match=rf"^{re.escape(name)}(?!\w)"):
            attnkit.merge(outs, lses)


def test_the_seed_function_takes_numpy_only():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^Q\b"):
        attnkit.scaled_dot_product_attention(torch.ones(2, 4, requires_grad=True), K, V)
    with pytest.raises(ValueError, match=r"^K\b"):
        attnkit.scaled_dot_product_attention(Q, np.ones((1, 3, 4)), V)


def test_torch_specific_inputs_get_named_errors():
    torch = pytest.importorskip("torch")
    tq, tk, tv = (torch.tensor(x) for x in (Q, K, V))
    with pytest.raises(TypeError, match=r"^q\b.*strided"):
        attnkit.attention(tq.to_sparse(), tk, tv)
    with pytest.raises(TypeError, match=r"^bias\b.*strided"):
        attnkit.attention(tq, tk, tv, bias=torch.zeros(2, 3).to_sparse())
    with pytest.raises(TypeError, match=r"^sinks\b"):
        attnkit.attention(tq, tk, tv, sinks=np.zeros(1))
    with pytest.raises(ValueError, match=r"^kv_lengths\b"):
        attnkit.attention(tq[None], tk[None], tv[None], kv_lengths=torch.tensor([4]))


def test_backward_needs_the_forward_seed_for_dropout():
    o, lse = attnkit.attention(Q, K, V, dropout=0.5, seed=3, return_lse=True)
    with pytest.raises(ValueError, match=r"^seed\b"):
        attnkit.attention_backward(np.ones_like(o), Q, K, V, o, lse, dropout=0.5)
