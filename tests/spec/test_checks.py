"""The checks of arrays a caller hands back (attnkit.spec.checks): rows, merge's
blocks. Most are exercised through the public functions in test_validate.py; these
reach the cases a public call cannot, or that need an odd object."""

import numpy as np
import pytest

import attnkit
from attnkit.spec import check_rows, validate
from attnkit.testing import make_qkv


def test_check_rows_names_a_missing_rows_argument():
    """check_rows is exported for the rungs' callers: None is "no array", said as such,
    not an object array of odd dtype."""
    spec = validate(*make_qkv((3, 4), (5, 4), seed=0))
    with pytest.raises(TypeError, match=r"^rows: expected an array, got None"):
        check_rows(spec, None)
    assert check_rows(spec, np.array([-1, 0])).tolist() == [2, 0]


class _ShapeOnly:
    """Has a shape and nothing else an array has (no ndim, no dtype)."""

    shape = (2, 3)


def test_merge_names_a_block_that_only_looks_like_an_array():
    o, lse = attnkit.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 3)), return_lse=True)
    with pytest.raises(TypeError, match=r"^outs\[0\]: expected an array"):
        attnkit.merge([_ShapeOnly()], [lse])
