"""attnkit.explain.sweep: the common mistakes, as numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from attnkit.explain import entropy, entropy_sweep, mistakes, mistakes_text


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


def test_mistakes_text_fits_80_columns():
    text = mistakes_text(mistakes())
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "1. Leaving out the √d_k scaling" in text and "4. Order blindness" in text


# ---- cases a mutation run found untested ------------------------------------------
def test_blend_weights_to_three_decimals_and_ln_s_in_the_text():
    m = mistakes()
    assert m["blend"]["weights"][2] == [0.982, 0.018]                  # scale 4: e^4 / (e^4 + 1)
    assert "uniform = ln 64 = 4.16 nats" in " ".join(mistakes_text(m).split())
