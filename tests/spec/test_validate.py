"""Bad input gets a TypeError/ValueError whose message starts with the argument's name
as the user wrote it, before any compute — for every argument of every public
function, the new masking keywords included."""

import importlib
import re

import numpy as np
import pytest

import attnkit
from attnkit.testing import make_qkv

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
    # per-sequence lengths (2,) where the batch is () once packed: "not combined", not a shape
    (ValueError, "q_lengths, kv_lengths: not combined", dict(cu_seqlens_q=np.array([0, 3, 7]),
                                                             cu_seqlens_k=np.array([0, 3, 9]),
                                                             q_lengths=np.array([3, 4]), kv_lengths=np.array([3, 6]))),
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
    with pytest.raises(TypeError, match=r"^q: expected a dense tensor, got a nested tensor"):
        attnkit.attention(torch.nested.as_nested_tensor([tq, tq]), tk[None].expand(2, 3, 4), tv[None].expand(2, 3, 2))
    with pytest.raises(ValueError, match=r"^q_lengths: its values are read to check them, and a tensor on the meta"):
        meta = [x[None, None].to("meta") for x in (tq, tk, tv)]
        attnkit.attention(*meta, q_lengths=torch.tensor([1], device="meta"))


def test_backward_needs_the_forward_seed_for_dropout():
    o, lse = attnkit.attention(Q, K, V, dropout=0.5, seed=3, return_lse=True)
    with pytest.raises(ValueError, match=r"^seed\b"):
        attnkit.attention_backward(np.ones_like(o), Q, K, V, o, lse, dropout=0.5)


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
# Each test below fails on a mutant of attnkit.spec.validate that the tests above let
# through: a check loosened or tightened by one token, or a message that says the wrong
# thing.
BAD_MORE = [
    (TypeError, "k", dict(k=None)),
    (ValueError, "q, k, v: leading batch dims",                        # k alone does not broadcast
     dict(q=np.ones((2, 1, 2, 4)), k=np.ones((3, 1, 3, 4)), v=np.ones((2, 1, 3, 2)))),
    (ValueError, "q, k, v: leading batch dims",                        # v alone does not broadcast
     dict(q=np.ones((2, 1, 2, 4)), k=np.ones((2, 1, 3, 4)), v=np.ones((3, 1, 3, 2)))),
    (ValueError, "dropout", dict(dropout=False)),
    (ValueError, "dropout", dict(dropout="0.1", seed=1)),
]


@_cases(BAD_MORE)
def test_more_bad_input_gets_a_named_error(error, name, kw):
    with pytest.raises(error, match=rf"^{re.escape(name)}(?!\w)"):
        _call(dict(q=Q, k=K, v=V), kw)


def test_a_2d_offsets_column_is_not_taken_for_offsets():
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D array"):
        _call(PACKED, dict(cu_seqlens_q=np.array([[0], [3], [7]]), cu_seqlens_k=np.array([0, 3, 9])))


def test_messages_say_the_polarity_and_what_was_expected():
    with pytest.raises(TypeError, match=r"^keep: .*\(True = attend\)"):
        attnkit.attention(Q, K, V, keep=np.ones((2, 3)))
    with pytest.raises(TypeError, match=r"^drop: .*\(True = masked out\)"):
        attnkit.attention(Q, K, V, drop=np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"^softcap: expected a positive finite number"):
        attnkit.attention(Q, K, V, softcap=-1.0)
    with pytest.raises(ValueError, match=r"^scale: expected a finite real number"):
        attnkit.attention(Q, K, V, scale=float("inf"))
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: expected a 1-D array of B \+ 1 >= 2 offsets"):
        _call(PACKED, dict(cu_seqlens_q=np.array([0]), cu_seqlens_k=np.array([0, 9])))


def test_valid_edge_values_are_accepted():
    """The checks' boundaries: a negative or zero scale, the largest seed, nested lists,
    one packed sequence."""
    q, k, v = make_qkv((2, 4), (3, 4), 2, seed=0)
    for s in (-0.5, 0.0):
        want = attnkit.attention(q * s, k, v, scale=1.0)
        assert np.allclose(attnkit.attention(q, k, v, scale=s), want, rtol=0, atol=1e-15)
    out = attnkit.attention(q, k, v, dropout=0.5, seed=2 ** 64 - 1)
    assert np.array_equal(out, attnkit.attention(q, k, v, dropout=0.5, seed=2 ** 64 - 1))
    lists = attnkit.attention(q.tolist(), k.tolist(), v.tolist())
    assert np.array_equal(lists, attnkit.attention(q, k, v))
    q, k, v = (x[0] for x in (Q4, K4, V4))                              # (H, L, D), (Hkv, S, D)
    packed = attnkit.attention(q, k, v, causal=True, cu_seqlens_q=np.array([0, 5]),
                               cu_seqlens_k=np.array([0, 6]), backend="reference")
    assert np.array_equal(packed, attnkit.attention(q, k, v, causal=True, backend="reference"))


def test_the_seed_function_reads_lists_and_names_a_missing_matrix():
    q, k, v = make_qkv((2, 4), (3, 4), 2, seed=1)
    mask = np.array([[False, True, False], [True, False, False]])
    want = attnkit.scaled_dot_product_attention(q, k, v, mask)
    got = attnkit.scaled_dot_product_attention(q.tolist(), k.tolist(), v.tolist(), mask.tolist())
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    with pytest.raises(TypeError, match=r"^Q\b"):
        attnkit.scaled_dot_product_attention(None, K, V)


def test_rows_bounds_are_checked_on_both_ends_of_a_list():
    q, k = make_qkv((3, 4), (5, 4), seed=2)[:2]
    full = attnkit.attention_weights(q, k)
    assert np.array_equal(attnkit.attention_weights(q, k, rows=[-3, 2]), full[[0, 2]])
    assert attnkit.attention_weights(q, k, rows=1).shape == (1, 5)       # an int is one row, axis kept
    for rows in ([-4, 0], [0, 3]):
        with pytest.raises(ValueError, match=r"^rows\b"):
            attnkit.attention_weights(q, k, rows=rows)


def test_merge_takes_any_iterable_and_one_dimensional_blocks():
    o, lse = attnkit.attention(Q, K, V, return_lse=True)
    want = attnkit.merge([o, o], [lse, lse])
    got = attnkit.merge(iter([o, o]), (x for x in [lse, lse]))
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    out, l = attnkit.merge([np.ones(3), np.zeros(3)], [np.array(0.0), np.array(0.0)])   # one row, no batch
    assert np.allclose(out, 0.5) and np.isclose(l, np.log(2))
    with pytest.raises(TypeError, match=r"^lses\[0\]"):
        attnkit.merge([o], [lse.tolist()])
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"^lses\[0\]: expected a NumPy array like outs\[0\]"):
        attnkit.merge([o], [torch.tensor(lse)])
    with pytest.raises(TypeError, match=r"^outs\[1\]: expected a torch.Tensor like outs\[0\]"):
        attnkit.merge([torch.tensor(o), o], [torch.tensor(lse), torch.tensor(lse)])


def test_the_spec_is_frozen_and_2d_calls_take_2d_saved_results():
    import dataclasses

    from attnkit.spec import validate
    q, k, v = make_qkv((3, 4), (5, 4), 2, seed=3)
    spec = validate(q, k, v)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.L = 4
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert out.shape == (3, 2) and lse.shape == (3,)
    dq, dk, dv = attnkit.attention_backward(np.ones_like(out), q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# ring attention's and MultiheadAttention's own checks (their tests need processes or
# modules; the checks themselves are plain functions)
def test_ring_shard_checks():
    from attnkit.spec import check_group, check_layout, check_ring_shard, check_world, validate
    q, k, v = make_qkv((1, 2, 4, 8), (1, 2, 6, 8), seed=4)
    spec = validate(q, k, v)
    keep = np.array([True, False, True, True, True, True]).reshape(1, 1, 6) | np.zeros((2, 1, 6), bool)
    drop = np.array([False, False, False, True, False, False])
    assert check_ring_shard(spec, None, None, "contiguous") is None
    assert np.array_equal(check_ring_shard(spec, keep, drop, "zigzag"), keep & ~drop)
    assert np.array_equal(check_ring_shard(spec, keep[None], None, "contiguous"), keep[None])
    assert np.array_equal(check_ring_shard(spec, None, drop, "contiguous"), ~drop)
    odd = validate(*make_qkv((1, 2, 3, 8), (1, 2, 5, 8), seed=5))
    assert check_ring_shard(odd, None, None, "contiguous") is None
    bad = [(spec, dict(layout="spiral"), "layout"),
           (validate(q, k, v, bias=np.zeros((4, 6))), {}, "bias"),
           (validate(q, k, v, q_lengths=np.array([3])), {}, "q_lengths"),
           (validate(q[0], k[0], v[0], cu_seqlens_q=np.array([0, 4]), cu_seqlens_k=np.array([0, 6])), {},
            "cu_seqlens_q"),
           (spec, dict(keep=np.ones((1, 1, 1, 5), bool)), "keep"),
           (spec, dict(keep=np.ones((4, 6), bool)), "keep"),
           (spec, dict(drop=np.ones(5, bool)), "drop"),
           (odd, dict(layout="zigzag"), "q"),
           (validate(*make_qkv((1, 2, 4, 8), (1, 2, 5, 8), seed=6)), dict(layout="zigzag"), "k")]
    for s, kw, name in bad:
        args = dict(keep=None, drop=None, layout="contiguous") | kw
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            check_ring_shard(s, args["keep"], args["drop"], args["layout"])
    assert check_layout("zigzag") == "zigzag"
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        check_world(rank, world)
    for rank, world in ((1, 1), (2, 2), (5, 2), (-1, 2), (0, 0), (0, 1.5), ("0", 2)):
        with pytest.raises(ValueError, match=r"^rank, world\b"):
            check_world(rank, world)
    check_group(None)
    with pytest.raises(TypeError, match=r"^group\b"):
        check_group(object())


def test_multihead_attention_config_checks():
    from attnkit.spec.checks import check_mha_config
    check_mha_config(8, 2, 1, 0.0)
    check_mha_config(8, 8, 8, 0.5)
    for args, name in (((8.0, 2, 1, 0.0), "embed_dim"), ((8, True, 1, 0.0), "num_heads"),
                       ((8, 2, 0, 0.0), "num_kv_heads"), ((9, 2, 1, 0.0), "embed_dim"),
                       ((8, 4, 3, 0.0), "num_kv_heads"), ((8, 2, 1, False), "dropout"),
                       ((8, 2, 1, "0.1"), "dropout"), ((8, 2, 1, 1.0), "dropout")):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            check_mha_config(*args)


def test_the_keyword_table_fills_every_docstring_and_stays_fixed():
    """The "Masking keywords" section replaces {masking}, indented like the docstring's
    other sections, with each keyword's sentence; the table and its TypedDict: every
    keyword optional, the entries frozen."""
    import dataclasses

    from attnkit.spec.options import OPTIONS, Masking
    for fn in (attnkit.attention, attnkit.attention_weights, attnkit.attention_backward,
               attnkit.attention_kvcache, attnkit.explain):
        doc = fn.__doc__
        assert "{masking}" not in doc
        assert "\n    Masking keywords\n    ----------------\n    scale : default None\n        score scale" in doc
        assert all(f"\n        {o.doc}.\n" in doc for o in OPTIONS if o.kvcache or fn is not attnkit.attention_kvcache)
    assert not Masking.__required_keys__
    with pytest.raises(dataclasses.FrozenInstanceError):
        OPTIONS[0].default = 1.0


def test_one_dimensional_masks_broadcast_over_the_rows_of_a_2d_call():
    """keep / drop / bias of shape (S,) (one value per key) on 2-D q, k, v: the same as
    the (L, S) mask they broadcast to, and out keeps the 2-D shape."""
    q, k, v = make_qkv((3, 4), (5, 4), 2, seed=7)
    rng = np.random.default_rng(8)
    for name, m in (("keep", rng.random(5) < 0.6), ("drop", rng.random(5) < 0.4), ("bias", rng.standard_normal(5))):
        got = attnkit.attention(q, k, v, **{name: m})
        assert got.shape == (3, 2)
        assert np.array_equal(got, attnkit.attention(q, k, v, **{name: np.broadcast_to(m, (3, 5))}))


def test_explain_keeps_the_shapes_the_user_gave_the_lengths():
    """The Spec records each array argument's own shape (explain's JSON reports the
    lengths as given: a 0-d length stays one number)."""
    q, k, v = make_qkv((2, 1, 3, 4), (2, 1, 5, 4), seed=9)
    d = attnkit.explain(q, k, v, q_lengths=np.array([3, 1]), kv_lengths=np.array(4)).to_dict()
    assert d["q_lengths"] == [3, 1] and d["kv_lengths"] == 4
    assert d["shapes"]["q_lengths"] == (2,) and d["shapes"]["kv_lengths"] == ()


def test_only_torch_tensors_count_as_torch():
    """Both marks are needed: torch's own module (torch.Size has no detach) and a
    tensor's detach (io objects have a detach too)."""
    import io

    from attnkit.spec import is_torch
    assert not is_torch(np.ones(2)) and not is_torch(io.BytesIO())
    torch = pytest.importorskip("torch")
    assert is_torch(torch.ones(2)) and is_torch(torch.nn.Parameter(torch.ones(2)))
    assert not is_torch(torch.Size([2, 3]))


# ---- the check reused per signature ----------------------------------------------
def _fields(spec):
    return {n: getattr(spec, n) for n in spec.__dataclass_fields__ if n not in ("q", "k", "v", "chosen")}


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_repeated_signature_gives_the_same_spec_on_the_new_arrays(lib):
    """The second call of a signature (shapes, dtypes, keywords) reuses the first one's
    check: every field is what the full check gives, the arrays are the new ones (2-D
    inputs in normal form), and the results follow the new arrays."""
    v_mod = importlib.import_module("attnkit.spec.validate")
    conv = (lambda x: x) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    for shapes in (((2, 3, 4), (1, 3, 4), (1, 3, 2)), ((5, 4), (3, 1, 6, 4), (3, 1, 6, 3))):
        first = [conv(x) for x in make_qkv(shapes[0], shapes[1], shapes[2][-1], seed=1)]
        second = [conv(x) for x in make_qkv(shapes[0], shapes[1], shapes[2][-1], seed=2)]
        kw = dict(causal=True, scale=0.3, window=(2, None))
        validate = v_mod.validate
        a = validate(*first, **kw)
        b = validate(*second, **kw)
        full = v_mod._validate(*second, "auto", True, dict(kw))
        assert _fields(b) == _fields(full) == _fields(a)
        for x, y in zip((b.q, b.k, b.v), (full.q, full.k, full.v)):
            assert x.shape == y.shape and (x == y).all()
        assert not (attnkit.attention(*first, **kw) == attnkit.attention(*second, **kw)).all()


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_decoding_step_with_one_more_key_reuses_the_check(lib):
    """Without array keywords the key length is no part of the signature (each
    decoding step has one more key): a call with another S reuses the check, and every
    field, S and the shapes included, is what the full check gives; a repeat of the
    same shapes with array keywords keeps S in the signature."""
    v_mod = importlib.import_module("attnkit.spec.validate")
    conv = (lambda x: x) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    v_mod._SEEN.clear()
    kw = dict(scale=0.3)
    for S in (5, 6, 9, 1):
        q, k, v = (conv(x) for x in make_qkv((2, 4, 1, 8), (2, 2, S, 8), 3, seed=S))
        got = v_mod.validate(q, k, v, **kw)
        full = v_mod._validate(q, k, v, "auto", True, dict(kw))
        assert _fields(got) == _fields(full) and got.S == S and got.shapes["k"] == (2, 2, S, 8)
        assert got.k is k and got.v is v
    assert len(v_mod._SEEN) == 1
    for S in (4, 5):                                     # 2-D keys too
        q, k, v = (conv(x) for x in make_qkv((2, 4, 1, 8), (S, 8), 3, seed=S))
        got = v_mod.validate(q, k, v, **kw)
        assert _fields(got) == _fields(v_mod._validate(q, k, v, "auto", True, dict(kw)))
    assert len(v_mod._SEEN) == 2
    lengths = conv(np.array([1, 1]))
    for S in (5, 6):
        q, k, v = (conv(x) for x in make_qkv((2, 4, 1, 8), (2, 2, S, 8), 3, seed=S))
        v_mod.validate(q, k, v, kv_lengths=lengths)
    assert len(v_mod._SEEN) == 4


def test_a_kept_check_serves_one_key_and_weights_calls_without_v():
    """S = 1 reuses the check (its rung choices too); a weights call (need_v=False)
    reusing its check leaves v out of the Spec as the full check does; 0-D keys or
    values get the named error, not one from inside the signature."""
    v_mod = importlib.import_module("attnkit.spec.validate")
    q, k, v = make_qkv((2, 4, 1, 8), (2, 2, 5, 8), 3, seed=0)
    a = v_mod.validate(q, k, v)
    assert v_mod.validate(q, k[..., :1, :], v[..., :1, :]).chosen is a.chosen
    for _ in range(2):
        assert v_mod.validate(q, k, v, need_v=False).v is None
    for bad_k, bad_v, name in ((np.zeros(()), v, "k"), (k, np.zeros(()), "v")):
        with pytest.raises(ValueError, match=f"^{name}:"):
            v_mod.validate(q, bad_k, bad_v)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_seen_signature_with_another_key_length_still_checks_k_against_v(lib):
    """The reused check still refuses a v whose key length is not k's, and no keys."""
    conv = (lambda x: x) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    q, k, v = (conv(x) for x in make_qkv((2, 4, 1, 8), (2, 2, 6, 8), 3, seed=0))
    attnkit.attention(q, k, v)
    with pytest.raises(ValueError, match="v: expected shape"):
        attnkit.attention(q, k[..., :5, :], v)
    with pytest.raises(ValueError, match="k: expected last dim D=8"):
        attnkit.attention(q, k[..., :7], v)                   # the head dim stays in the signature
    with pytest.raises(ValueError, match="must be positive"):
        attnkit.attention(q, k[..., :0, :], v[..., :0, :])
    with pytest.raises(ValueError, match="must be positive"):
        attnkit.attention_weights(q, k[..., :0, :])


def test_a_seen_signature_still_refuses_bad_keywords_and_checks_array_values():
    q, k, v = make_qkv((2, 1, 3, 4), (2, 1, 5, 4), seed=0)
    attnkit.attention(q, k, v, causal=True)
    with pytest.raises(TypeError, match="causal"):
        attnkit.attention(q, k, v, causal=1)                      # equal to True, and refused
    attnkit.attention(q, k, v, kv_lengths=np.array([5, 2]))
    with pytest.raises(ValueError, match="kv_lengths"):
        attnkit.attention(q, k, v, kv_lengths=np.array([5, 6]))   # array values are checked every call
    attnkit.attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    with pytest.raises(TypeError, match="k: dtype float64"):
        attnkit.attention(q.astype(np.float32), k, v.astype(np.float32))
    with pytest.raises(ValueError, match="window"):
        attnkit.attention(q, k, v, window=[1, 2, 3])
    attnkit.attention(q, k, v, window=(1, 2))
    for bad in ((1.0, 2), (True, 2), (1, 2.0)):                   # equal to (1, 2), and refused
        with pytest.raises(ValueError, match="window"):
            attnkit.attention(q, k, v, window=bad)


def test_array_keywords_are_checked_and_read_every_call_with_torch_tensors_too():
    """Tensors hash by identity: a tensor keyword must still be read and checked anew."""
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in make_qkv((2, 1, 3, 4), (2, 1, 5, 4), seed=0))
    lengths = torch.tensor([5, 2])
    a = attnkit.attention(q, k, v, kv_lengths=lengths)
    lengths[1] = 4
    b = attnkit.attention(q, k, v, kv_lengths=lengths)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[1], b[1])
    lengths[1] = 6
    with pytest.raises(ValueError, match="kv_lengths"):
        attnkit.attention(q, k, v, kv_lengths=lengths)


def _same(a, b):
    if a is None or b is None or isinstance(a, (int, float, str, bool, tuple, dict)):
        return a == b
    return tuple(a.shape) == tuple(b.shape) and bool((np.asarray(a) == np.asarray(b)).all())


ARRAY_KEYWORDS = [
    dict(keep=lambda r: r.random((1, 5, 6)) < 0.7),
    dict(drop=lambda r: r.random((5, 1)) < 0.3),
    dict(bias=lambda r: r.standard_normal((2, 1, 5, 6))),
    dict(alibi_slopes=lambda r: r.random(2)),
    dict(sinks=lambda r: r.standard_normal(2)),
    dict(kv_lengths=lambda r: r.integers(0, 7, 2), q_lengths=lambda r: r.integers(0, 6, 1)),
    dict(cu_seqlens_q=lambda r: np.array([0, r.integers(0, 6), 5]), cu_seqlens_k=lambda r: np.array([0, 2, 6])),
]


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("kw", ARRAY_KEYWORDS, ids=lambda kw: "+".join(kw))
def test_a_seen_signature_with_array_keywords_checks_and_takes_the_new_arrays(lib, kw):
    """The second call of a signature with array keywords reuses the first one's check
    of everything else: each field is what the full check gives on the new arrays (the
    arrays in normal form), the cached Spec holds none of the caller's arrays, and bad
    values are still refused."""
    v_mod = importlib.import_module("attnkit.spec.validate")
    conv = (lambda x: x) if lib == "numpy" else pytest.importorskip("torch").from_numpy
    packed = "cu_seqlens_q" in kw
    shapes = ((2, 5, 4), (1, 6, 4), 3) if packed else ((2, 2, 5, 4), (2, 1, 6, 4), 3)
    for seed in (1, 2, 3):
        r = np.random.default_rng(seed)
        q, k, v = (conv(x) for x in make_qkv(*shapes, seed=seed))
        opts = {n: conv(f(r)) for n, f in kw.items()}
        got = v_mod.validate(q, k, v, causal=True, **opts)
        full = v_mod._validate(q, k, v, "auto", True, dict(causal=True, **opts))
        for name in got.__dataclass_fields__:
            assert name == "chosen" or _same(getattr(got, name), getattr(full, name)), name
    assert all(getattr(s, n) is None for s in v_mod._SEEN.values() for n in v_mod._TENSOR_OPTIONS)
    name = next(iter(kw))
    if packed or "lengths" in name:                      # values checked every call (a seen signature)
        bad = dict(opts, **{name: conv(np.array([0, 6, 5]) if packed else np.array([7, 1]))})
        with pytest.raises(ValueError, match=name):
            v_mod.validate(q, k, v, causal=True, **bad)


def test_offsets_are_quoted_as_given():
    """uint64 offsets past 2**63 (which wrap in int64) appear in the message as given."""
    q, k = np.zeros((1, 6, 4)), np.zeros((1, 9, 4))
    with pytest.raises(ValueError, match=r"got \[0, 9223372036854775808, 6\]"):
        attnkit.attention(q, k, k, cu_seqlens_q=np.array([0, 2**63, 6], np.uint64), cu_seqlens_k=np.array([0, 3, 9]))


@pytest.mark.parametrize("backend", ["reference", "flash", "small"])
def test_a_window_side_too_long_for_any_sequence_is_unbounded(backend):
    """diag + 2**63 − 1 wrapped around in int64 (every key excluded, no error) and 2**70
    did not fit: a side of 2**30 keys or more means None on every rung."""
    import sys
    q, k, v = make_qkv((2, 5, 4), (2, 7, 4), seed=3)
    for left, right in ((0, sys.maxsize), (sys.maxsize, sys.maxsize), (2**70, 0), (1 << 30, 2)):
        normal = tuple(None if side >= 1 << 30 else side for side in (left, right))
        want = attnkit.attention(q, k, v, window=normal, backend=backend)
        assert np.array_equal(attnkit.attention(q, k, v, window=(left, right), backend=backend), want)


def test_the_unbounded_window_side_starts_at_two_to_the_thirty():
    from attnkit.spec import validate
    q, k, v = make_qkv((2, 5, 4), (2, 7, 4), seed=3)
    assert validate(q, k, v, window=(2**30 - 1, 0)).window == (2**30 - 1, 0)
    assert validate(q, k, v, window=(2**30, 0)).window == (None, 0)


def test_one_offsets_array_with_lengths_is_named_for_the_lengths():
    q, k = np.ones((2, 7, 4)), np.ones((1, 9, 4))
    with pytest.raises(ValueError, match="^kv_lengths: not combined with cu_seqlens"):
        attnkit.attention(q, k, k, cu_seqlens_q=np.array([0, 7]), kv_lengths=np.array([3]))


def test_merge_names_the_block_of_the_other_library():
    torch = pytest.importorskip("torch")
    o, lse = attnkit.attention(np.eye(2), np.eye(2), np.eye(2), return_lse=True)
    with pytest.raises(TypeError, match=r"^outs\[1\]: expected a NumPy array like outs\[0\]"):
        attnkit.merge([o, torch.tensor(o)], [lse, lse])
    with pytest.raises(TypeError, match=r"^lses\[1\]"):
        attnkit.merge([o, o], [lse, torch.tensor(lse)])


def test_flash_attentions_minus_one_window_is_named():
    """FlashAttention writes an unbounded window side as -1; attnkit's is None: a port
    passing (-1, 0) gets an error that says so (not a silent reading either way)."""
    q = np.zeros((1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"^window: left size .* got -1 \(None: unbounded, where FlashAttention"):
        attnkit.attention(q, q, q, window=(-1, 0))
    with pytest.raises(ValueError, match=r"^window: right size .* got -2$"):
        attnkit.attention(q, q, q, window=(0, -2))


def test_packed_q_in_flash_attentions_layout_is_named():
    """FlashAttention's packed q is (T, H, D); attnkit's (H, T, D): passed as is, the
    offsets' total meets q's dim -3, and the error says which layout to use."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((10, 4, 8)), rng.standard_normal((10, 2, 8))
    cu = np.array([0, 3, 10])
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: .* got 10 \(q's dim -3 is 10: q in FlashAttention's"):
        attnkit.attention(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: .* Tq=10, got 9$"):      # no hint where none applies
        attnkit.attention(q.transpose(1, 0, 2), k.transpose(1, 0, 2), k.transpose(1, 0, 2),
                          cu_seqlens_q=np.array([0, 9]), cu_seqlens_k=np.array([0, 10]))
