"""attnkit.explain.formatting: numbers as a person writes them; NaN and inf as such."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from attnkit.explain.formatting import cell, eq, jsonable, matrix, num, paren, vec, what_nonfinite, wrap


@pytest.mark.parametrize("x,text", [(1.0, "1"), (0.0, "0"), (-2.0, "-2"), (0.7071067811865476, "0.707"),
                                    (2e40, "2e+40"), (1.4142135623730951e20, "1.414e+20"),
                                    (1e-5, "1e-05"), (math.nan, "nan"), (math.inf, "inf"),
                                    (-math.inf, "-inf"), (999999.0, "999999")])
def test_num(x, text):
    assert num(x) == text


def test_eq_and_paren():
    assert (eq(0.5), eq(1 / 3), eq(math.nan), eq(2e40)) == ("=", "≈", "=", "=")
    assert paren(-1.5) == "(-1.500)" and paren(2.0) == "2"


def test_cell_keeps_matrices_narrow_and_names_non_finite():
    assert [cell(x) for x in (0.5, -1e20, math.nan, -math.inf, "x")] == ["0.500", "-1.00e+20", "nan", "-inf", "x"]
    lines = matrix("", [[1e300, math.nan]], ["q0"], ["k0", "k1"], 80)
    assert max(map(len, lines)) < 30 and lines[1].split() == ["q0", "1.00e+300", "nan"]


def test_vec_and_wrap():
    assert vec([1.0, math.nan], 2) == "(1.00, nan)" and vec(range(8)) == "(0, 1, 2, 3, …, 7)"
    assert vec([3e30], 2) == "(3e+30)"
    assert wrap(["aaaa", "bbbb", "cccc"], 10, sep=", ") == ["aaaa, bbbb", "cccc"]


def test_jsonable_is_strict_json():
    x = jsonable(np.array([[0.5, -np.inf], [np.nan, np.inf]]))
    assert json.loads(json.dumps(x, allow_nan=False)) == [[0.5, None], ["nan", "inf"]]
    assert jsonable(np.array([True, False])) == [True, False]


def test_what_nonfinite():
    assert what_nonfinite([np.nan, 1]) == "NaN" and what_nonfinite([np.inf, np.nan]) == "NaN and inf"


# ---- cases a mutation run found untested ------------------------------------------
@pytest.mark.parametrize("x,text", [(1e6, "1e+06"), (1e-4, "0.0001")])
def test_num_at_its_thresholds(x, text):
    from attnkit.explain.formatting import num
    assert num(x) == text


def test_cell_exponent_from_1e5():
    assert cell(1e5) == "1.00e+05" and cell(99999.0) == "99999.000"


def test_matrix_elision_keeps_the_first_and_last_rows():
    lines = matrix("", np.arange(20.0)[:, None], [f"q{i}" for i in range(20)], ["d0"], 80)
    labels = [line.split()[0] for line in lines[1:]]
    assert labels == [f"q{i}" for i in range(9)] + ["⋮", "q18", "q19"]
