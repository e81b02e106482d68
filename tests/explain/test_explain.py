"""attnkit.explain: the trace is what attention computes, step by step."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

import attnkit
from attnkit.explain import EXAMPLE, Trace, entropy, entropy_sweep, explain, mistakes, worked_example
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
    assert np.all((np.abs(rows - 1) < 1e-12) | ((rows == 0) & np.isneginf(t.lse)))


def test_step_order_and_mask_names():
    q, k, v = make_qkv((2, 3), (4, 3))
    t = explain(q, k, v, softcap=5.0, bias=np.zeros((2, 4)), causal=True, drop=np.zeros((2, 4), bool))
    assert list(t) == ["scores", "scaled", "softcapped", "biased", "excluded", "masked",
                       "weights", "lse", "out"]
    assert t.masks == ["softcap 5", "bias", "causal (bottom_right)", "drop"]
    assert list(explain(q, k, v)) == ["scores", "scaled", "weights", "lse", "out"]
    assert explain(q, k, v).masks == [] and explain(q, k, v).excluded is None


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


def test_worked_example_numbers():
    t = explain(EXAMPLE["q"], EXAMPLE["k"], EXAMPLE["v"])
    assert t["scores"].tolist() == [[1.0, 0.0]]
    np.testing.assert_allclose(t["scaled"], [[1 / math.sqrt(2), 0.0]], rtol=1e-15)
    np.testing.assert_allclose(t.weights, [[math.e ** 0.5 ** 0.5 / (math.e ** 0.5 ** 0.5 + 1),
                                            1 / (math.e ** 0.5 ** 0.5 + 1)]], rtol=1e-14)
    text = worked_example()
    for s in ("1·1 + 0·0 = 1", "1·0 + 0·1 = 0", "√2 ≈ 1.414", "≈ 0.707", "0 / 1.414 = 0",
              "e^0.707 ≈ 2.028", "e^0 = 1", "total 3.028", "apple 0.670, cheese 0.330",
              "= (6.70, 3.30)", "Reading:"):
        assert s in text, s


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


def test_bad_inputs_raise_named_errors():
    q, k, v = make_qkv((2, 3), (4, 3))
    with pytest.raises(ValueError, match="labels: expected 4 labels, got 2"):
        explain(q, k, v, labels=["a", "b"])
    with pytest.raises(ValueError, match="v: expected shape"):
        explain(q, k, v[:3])
    with pytest.raises(TypeError, match="drop: expected a boolean mask"):
        explain(q, k, v, drop=np.zeros((2, 4)))


@pytest.mark.parametrize("shape_q,shape_k", [((1, 2), (2, 2)), ((3, 4), (5, 4)), ((7, 64), (300, 64)),
                                             ((2, 4, 3, 2), (2, 2, 5, 2)), ((40, 9), (40, 9))])
def test_render_fits_80_columns(shape_q, shape_k):
    q, k, v = make_qkv(shape_q, shape_k)
    labels = [f"key{j}" for j in range(shape_k[-2])]
    text = explain(q, k, v, causal=True, labels=labels).render()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert text.startswith("Attention(Q, K, V)") and "Step 3" in text and "Reading:" in text


def test_render_elides_many_heads():
    q, k, v = make_qkv((5, 2, 3), (5, 4, 3))
    text = explain(q, k, v).render()
    assert "== head 0 ==" in text and "== head 1 ==" in text and "3 more heads not shown" in text


def test_to_dict_is_strict_json_with_null_for_minus_inf():
    q, k, v = make_qkv((4, 3), (2, 3))
    t = explain(q, k, v, causal=True)
    d = json.loads(json.dumps(t.to_dict(), allow_nan=False))
    assert d["steps"]["lse"][0] is None and d["steps"]["masked"][0] == [None, None]
    assert d["steps"]["excluded"][0] == [True, True]
    np.testing.assert_array_equal(np.array(d["steps"]["out"]), t.out)


def test_entropy():
    assert entropy(np.full((3, 8), 1 / 8)) == pytest.approx(math.log(8), rel=1e-14)
    assert entropy(np.eye(4)) == 0.0
    assert entropy([[0.5, 0.5, 0.0]]) == pytest.approx(math.log(2), rel=1e-14)


def test_entropy_collapses_without_scaling_and_stays_flat_with_it():
    calls = []
    r = entropy_sweep(dims=(2, 16, 128, 1024), S=32, L=32, trials=2,
                      progress=lambda i, n, d: calls.append((i, n, d)))
    assert calls == [(1, 4, 2), (2, 4, 16), (3, 4, 128), (4, 4, 1024)]
    un, sc = np.array(r["unscaled"]), np.array(r["scaled"])
    assert np.all(np.diff(un) < 0) and un[-1] < 0.1 * un[0] and un[-1] < 0.3
    assert np.ptp(sc) < 0.15 * sc.mean() and np.all(sc > 0.8 * r["uniform"])
    assert np.all(np.diff(r["max_weight_unscaled"]) > 0)


def test_mistakes_numbers():
    m = mistakes()
    assert m["roles"]["right"] == [6.7, 3.3] and m["roles"]["keys_values_swapped"] != [6.7, 3.3]
    b = m["blend"]
    assert b["output"] == [6.7, 3.3] and b["best_value"] == [10.0, 0.0]
    top = [w[0] for w in b["weights"]]
    assert top[0] == 0.67 and all(x < y or y == 1.0 for x, y in zip(top, top[1:])) and top[-1] == 1.0
    assert m["order"]["outputs_permuted"] and m["order"]["max_diff"] < 1e-12
    assert m["order"]["row0"] == m["order"]["row0_after"]


def test_importing_and_explaining_never_imports_matplotlib_or_torch():
    code = ("import sys, attnkit, attnkit.explain, attnkit.plot, attnkit.cli\n"
            "assert attnkit.cli.main(['explain']) == 0\n"
            "assert attnkit.cli.main(['explain', '--random', '3', '4', '2', '--json']) == 0\n"
            "print('matplotlib' in sys.modules, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "False False"
