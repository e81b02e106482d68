"""attnkit.explain.text: every step readable at 80 columns, numbered once each, and
honest — a NaN row is said to be NaN, with its reason, never shown as a number."""

from __future__ import annotations

import re

import numpy as np
import pytest

from attnkit.explain import explain
from attnkit.explain.text import nan_reasons, row_status, steps_text
from attnkit.testing import make_qkv

EVERYTHING = dict(softcap=5.0, bias=np.zeros((5, 5)), alibi_slopes=np.array([0.5]), causal=True,
                  cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]),
                  sinks=np.array([0.3]), dropout=0.3, seed=1)


@pytest.mark.parametrize("shape_q,shape_k", [((1, 2), (2, 2)), ((3, 4), (5, 4)), ((7, 64), (300, 64)),
                                             ((2, 4, 3, 2), (2, 2, 5, 2)), ((40, 9), (40, 9))])
def test_render_fits_80_columns(shape_q, shape_k):
    q, k, v = make_qkv(shape_q, shape_k)
    labels = [f"key{j}" for j in range(shape_k[-2])]
    text = explain(q, k, v, causal=True, labels=labels).render()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.startswith("Attention(Q, K, V)") and "Step 3" in text and "Reading:" in text


@pytest.mark.parametrize("kw", [EVERYTHING, {"sinks": np.array([[0.0, 1.0, 2.0, 3.0, 4.0]])},
                                {"alibi_slopes": np.array([0.5]), "q_lengths": np.array(3)},
                                {"dropout": 0.9, "seed": 2}], ids=["all", "sinks", "alibi", "dropout"])
def test_render_with_the_new_terms_fits_80_columns(kw):
    q, k, v = make_qkv((5, 2), (5, 2))
    text = explain(q, k, v, **kw).render()
    assert max(len(line) for line in text.splitlines()) <= 80, text


def test_render_elides_many_heads():
    q, k, v = make_qkv((5, 2, 3), (5, 4, 3))
    text = explain(q, k, v).render()
    assert "== head 0 ==" in text and "== head 1 ==" in text and "3 more heads not shown" in text


def test_every_step_is_numbered_once():
    q, k, v = make_qkv((5, 2), (5, 2))
    t = explain(q, k, v, **EVERYTHING)
    numbers = re.findall(r"^Step (\d[a-z]?) ", "\n".join(steps_text(t, (), 80)), flags=re.M)
    assert numbers == ["1", "2", "2a", "2b", "2c", "2d", "2e", "3", "3a", "4"]
    hand = re.findall(r"^Step (\d[a-z]?) ", "\n".join(t.arithmetic()), flags=re.M)
    assert len(hand) == len(set(hand)) and hand == ["1", "2", "3", "3a", "4"]


def test_no_internal_words_in_the_text():
    q, k, v = make_qkv((5, 2), (5, 2))
    text = explain(q, k, v, **EVERYTHING).render()
    assert "rung" not in text and "worked example" not in text
    assert "dropout seed 1 (a random seed: the same seed drops the same weights)" in " ".join(text.split())


# ---- NaN: said, with its reason ------------------------------------------------------------
def _one_line(lines):
    return " ".join(" ".join(lines).split())


@pytest.mark.parametrize("dtype,big,limit", [("float32", "1e20", "3.4e+38"), ("float64", "1e200", "1.8e+308")])
def test_overflow_is_said_to_be_nan(dtype, big, limit):
    b = float(big)
    t = explain(np.array([[b, b]], dtype), np.array([[b, b], [1, 1]], dtype), np.eye(2, dtype=dtype))
    text = " ".join(t.render().split())
    assert (f"q0's row is NaN because a non-finite value reached its softmax: q0·k0 overflowed to "
            f"inf, past {dtype}'s largest number {limit}") in text
    assert "weights: k0 nan, k1 nan" in text and "= (nan, nan): NaN, like the weights" in text
    assert "Reading: q0's output is NaN because a non-finite value reached its softmax" in text
    assert "attnkit never turns NaN into numbers" in text and "NaN: 1 query row is NaN" in text
    for lie in ("(not NaN)", "nan%", "every key is excluded", "no overflow", "almost alone"):
        assert lie not in text, lie


def test_overflow_to_minus_inf_is_said():
    t = explain([[1e200, -1e200]], [[1e200, 1e200], [1.0, 1.0]], np.eye(2))
    if not np.isneginf(t["scores"][0, 0]):
        pytest.skip("this BLAS gives NaN for inf − inf here")
    assert "e^(-inf) = 0 (q0·k0 overflowed to -inf, read as an excluded key)" in _one_line(t.arithmetic())


@pytest.mark.parametrize("where,reason", [
    ("q", "q0 holds NaN"), ("k", "key k1 holds inf"), ("bias", "the bias makes the score of k0 inf"),
    ("sinks", "its sink logit is nan"),
    ("v", "the value of k1 holds NaN or inf and is not excluded: a non-finite value is never "
          "multiplied away, not even by a weight of 0"),
])
def test_each_cause_of_a_nan_row_is_named(where, reason):
    q, k, v = make_qkv((2, 2), (3, 2))
    kw = {}
    if where == "q":
        q[0, 1] = np.nan
    elif where == "k":
        k[1, 0] = np.inf
    elif where == "v":
        v[1, 0] = np.nan
    elif where == "bias":
        kw["bias"] = np.array([[np.inf, 0, 0], [0, 0, 0]])
    else:
        kw["sinks"] = np.array([[np.nan, 0.0]])
    t = explain(q, k, v, **kw)
    assert row_status(t, (), 0) == ("nan_out" if where == "v" else "nan")
    assert reason in nan_reasons(t, (), 0)
    assert reason in _one_line(t.reading()) and reason in _one_line(t.arithmetic())
    assert np.isnan(t.out[0]).any()


def test_nan_value_at_an_excluded_key_is_exempt():
    q, k, v = make_qkv((2, 2), (3, 2))
    v[1, 0] = np.nan
    t = explain(q, k, v, drop=np.array([[0, 1, 0]] * 2, bool))
    assert row_status(t) == "ok" and "NaN" not in t.render()


# ---- sinks, ALiBi, dropout, packing, padding ---------------------------------------------
def test_sinks_show_the_mass_that_went_to_the_sink():
    t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]],
                labels=["apple", "cheese"], sinks=np.array([0.5]))
    hand = _one_line(t.arithmetic())
    # e^0.707 + e^0 + e^0.5 = 2.028 + 1 + 1.649 = 4.677; the sink gets 1.649 / 4.677 = 0.353
    for s in ("sink e^0.500 ≈ 1.649", "total 4.677", "weights: apple 0.434, cheese 0.214, sink 0.353",
              "the keys' weights sum to 1 − the sink's", "= (4.34, 2.14)"):
        assert s in hand, s
    assert "The sink takes 35% of the weight" in _one_line(t.reading())
    q, k, v = make_qkv((3, 2), (4, 2))
    t = explain(q, k, v, sinks=np.array([[0.0, 1.0, 2.0]]))
    lines = steps_text(t, (), 80)
    head = lines.index(next(x for x in lines if x.startswith("Step 3 "))) + 1
    assert lines[head].split() == ["k0", "k1", "k2", "k3", "sink"]
    for i in range(3):
        row = lines[head + 1 + i].split()
        assert row[0] == f"q{i}" and float(row[-1]) == pytest.approx(t.sink_weights[i], abs=5e-4)
        assert sum(map(float, row[1:])) == pytest.approx(1.0, abs=3e-3)


def test_alibi_is_its_own_step_with_the_penalty():
    q, k, v = make_qkv((3, 2), (3, 2))
    t = explain(q, k, v, alibi_slopes=np.array([0.5]))
    lines = steps_text(t, (), 80)
    at = next(i for i, x in enumerate(lines) if x.startswith("Step 2c alibi"))
    assert lines[at + 1].strip().startswith("the penalty −slope · |diag(i) − j|")
    penalty = [line.split()[1:] for line in lines[at + 3: at + 6]]
    assert penalty == [["0.000", "-0.500", "-1.000"], ["-0.500", "0.000", "-0.500"],
                       ["-1.000", "-0.500", "0.000"]]
    assert "then ALiBi (slope 0.5):" in "\n".join(t.arithmetic())


def test_dropout_step_and_the_output_it_makes():
    t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]],
                labels=["apple", "cheese"], dropout=0.5, seed=3)
    assert t["dropped"].tolist() == [[pytest.approx(2 * 0.66976, abs=1e-4), 0.0]]   # seed 3 drops cheese
    hand = _one_line(t.arithmetic())
    assert "Step 3a dropout p = 0.5 (dropout seed 3): kept weights ÷ 0.5, the others 0" in hand
    assert "weights: apple 1.340, cheese 0 (dropped)" in hand
    assert "1.340·(10, 0) = (13.40, 0.00)" in hand
    steps = "\n".join(steps_text(t, (), 80))
    assert "Step 3a dropped = dropout(weights)" in steps and "Step 4  out = dropped v" in steps


def test_dropout_of_every_weight_is_said():
    q, k, v = make_qkv((1, 2), (2, 2))
    for seed in range(200):
        t = explain(q, k, v, dropout=0.9, seed=seed)
        if not t["dropped"].any():
            break
    assert "dropout dropped every weight, so the output is (0.00, 0.00)" in _one_line(t.arithmetic())


def test_packed_block_diagonal_in_the_excluded_matrix():
    q, k, v = make_qkv((5, 2), (5, 2))
    t = explain(q, k, v, cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 2, 5]))
    lines = t.render().splitlines()
    at = next(i for i, x in enumerate(lines) if x.startswith("Step 2d"))
    grid = [line.split()[1:] for line in lines[at + 2: at + 7]]
    assert grid == [list("··xxx"), list("··xxx"), list("xx···"), list("xx···"), list("xx···")]
    assert ("packed: 2 sequences side by side (q0–q1 see k0–k1; q2–q4 see k2–k4)"
            in " ".join(t.render().split()))


def test_padding_rows_are_said_to_be_padding():
    q, k, v = make_qkv((1, 3, 2), (1, 4, 2))
    t = explain(q, k, v, q_lengths=np.array(2))
    assert row_status(t, (0,), 2) == "padding"
    assert "q2 is a padding row (beyond q_lengths), so its output is 0" in _one_line(t.reading((0,), 2))


# ---- cases a mutation run found untested ------------------------------------------
def test_a_given_scale_is_multiplied_not_divided_by_root_d():
    t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [[10.0, 0.0], [0.0, 10.0]], scale=0.3)
    hand = _one_line(t.arithmetic())
    assert "Step 2 multiply by scale = 0.300 1 · 0.300 = 0.300 0 · 0.300 = 0" in hand
    assert "√" not in hand


def test_six_keys_are_still_worked_by_hand():
    q, k, v = make_qkv((2, 2), (6, 2))
    assert "Query q0, worked by hand:" in explain(q, k, v).render()


def test_one_query_too_big_for_by_hand_shows_the_step_matrices():
    q, k, v = make_qkv((1, 2), (300, 2))
    text = explain(q, k, v).render()
    assert "Step 1  scores" in text and "Step 4  out" in text


def test_dropout_note_gives_the_keep_probability():
    q, k, v = make_qkv((5, 2), (5, 2))
    text = " ".join(explain(q, k, v, dropout=0.3, seed=1).render().split())
    assert "kept with probability 0.7 and divided by 0.7" in text


def test_nan_reasons_name_three_keys_then_count_the_rest():
    q, k, v = make_qkv((2, 2), (4, 2))
    t = explain(q, k, v, bias=np.array([[np.inf] * 4, [0.0] * 4]))
    assert nan_reasons(t, (), 0) == [f"the bias makes the score of k{j} inf" for j in range(3)] + \
        ["and 1 more keys"]


def test_a_nan_query_is_the_only_reason_given():
    q, k, v = make_qkv((2, 2), (3, 2))
    q[0, 1] = np.nan
    t = explain(q, k, v)
    assert nan_reasons(t, (), 0) == ["q0 holds NaN"]
    assert "q0·k0 overflowed" not in " ".join(t.render().split())


def test_nan_value_reason_names_only_the_visible_keys():
    q, k, v = make_qkv((2, 2), (3, 2))
    v[1, 0] = v[2, 0] = np.nan
    t = explain(q, k, v, drop=np.array([[0, 1, 0]] * 2, bool))    # k1 excluded, k2 not
    assert row_status(t) == "nan_out"
    assert nan_reasons(t, (), 0)[0].startswith("the value of k2 holds NaN or inf and is not excluded")


def test_an_excluded_key_is_not_called_dropped():
    t = explain([[1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], np.eye(2), causal=True, align="top_left",
                dropout=0.5, seed=1)                              # k1 excluded, k0 kept by seed 1
    hand = _one_line(t.arithmetic())
    assert "weights: k0 2.000, k1 0.000" in hand and "(dropped)" not in hand


def test_the_sink_is_shifted_with_the_scores():
    t = explain([[30.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], np.eye(2), scale=1.0, sinks=np.array([25.0]))
    hand = _one_line(t.arithmetic())
    assert "sink e^(25 − m) ≈ 0.007 total 1.007" in hand


def test_fully_excluded_row_with_a_sink_says_lse_is_the_sink_logit():
    q, k, v = make_qkv((3, 2), (2, 2))
    t = explain(q, k, v, causal=True, sinks=np.array([0.5]))         # row 0 sees no key
    assert row_status(t) == "excluded"
    assert "(weights 0, lse = the sink logit), never NaN" in _one_line(t.reading())
