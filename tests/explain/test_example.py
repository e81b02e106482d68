"""attnkit.explain.example: the worked example, every number by hand."""

from __future__ import annotations

import math

import numpy as np

from attnkit.explain import EXAMPLE, example_trace, explain, worked_example


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


def test_worked_example_is_called_the_worked_example_without_jargon():
    text = worked_example()
    assert text.splitlines()[0].endswith("— the worked example")
    assert "seed" not in text and "rung" not in text


def test_example_trace_is_the_example():
    t = example_trace()
    assert t.labels == ["apple", "cheese"] and t.query_labels == ["q"]
    np.testing.assert_allclose(t.out, [[6.7, 3.3]], atol=0.005)


# ---- cases a mutation run found untested ------------------------------------------
def _one_line(lines):
    return " ".join(" ".join(lines).split())


def test_worked_example_header_names_each_key_with_its_vector():
    text = _one_line(worked_example().splitlines()[:6])
    assert "keys apple = (1, 0) cheese = (0, 1)" in text
    assert "values apple = (10, 0) cheese = (0, 10)" in text
