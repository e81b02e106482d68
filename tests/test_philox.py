"""Dropout's generator: Philox4x32-10 against Random123's known answers, the drop
fraction within 4σ of p, and the drop decision a pure function of its indices."""

import numpy as np
import pytest

from attnkit import philox

KAT = [((0, 0, 0, 0), (0, 0), ("6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8")),
       ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, ("408f276d", "41c83b0e", "a20bc7c6", "6d5451fd")),
       ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
        ("d16cfe09", "94fdcceb", "5001e420", "24126ea1"))]


@pytest.mark.parametrize("ctr, key, want", KAT)
def test_known_answers(ctr, key, want):
    words = philox.philox4x32_10(*(np.array([c], np.uint32) for c in ctr), *key)
    assert tuple(f"{int(w[0]):08x}" for w in words) == want


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropped_fraction_within_four_sigma(p):
    kept = philox.kept(123, p, np.arange(4)[:, None, None], np.arange(64)[None, :, None], np.arange(256)[None, None, :])
    n = kept.size
    assert abs((1 - kept.mean()) - p) < 4 * np.sqrt(p * (1 - p) / n)


def test_decision_depends_on_every_index_and_the_seed_only():
    grid = (np.arange(3)[:, None, None], np.arange(5)[None, :, None], np.arange(9)[None, None, :])
    a = philox.words(7, *grid)
    assert np.array_equal(a, philox.words(7, *grid))
    assert np.array_equal(a[1:, 2:, 3:], philox.words(7, np.arange(1, 3)[:, None, None], np.arange(2, 5)[None, :, None],
                                                    np.arange(3, 9)[None, None, :]))   # any sub-block: same words
    for other in (philox.words(8, *grid), philox.words(7, grid[0] + 3, grid[1], grid[2]),
                  philox.words(7, grid[0], grid[1] + 5, grid[2])):
        assert (other != a).mean() > 0.99
    big = philox.words(2 ** 63 + 1, np.array([2 ** 40]), np.array([0]), np.array([0]))   # 64-bit seeds and heads
    assert big.dtype == np.uint32


def test_int64_indices_and_keys_give_the_uint32_answers():
    """Counters, keys and indices given as the int64 arrays np.arange makes (or NumPy
    integer keys): the same words as uint32 inputs."""
    ctr, key, want = KAT[2]
    words = philox.philox4x32_10(*(np.array([c], np.int64) for c in ctr), *(np.int64(x) for x in key))
    assert tuple(f"{int(w[0]):08x}" for w in words) == want
    rows, cols = np.arange(5)[:, None], np.arange(9)[None, :]
    a = philox.words(11, np.int64(3), rows, cols)
    b = philox.words(11, np.uint64(3), rows.astype(np.uint64), cols.astype(np.uint64))
    assert a.dtype == np.uint32 and np.array_equal(a, b)


def test_head_counters_past_two_to_the_31_use_both_words():
    """The flat head index n·H + h fills counter words 2 (low 32 bits) and 3 (high)."""
    seed, rows, cols = 2 ** 40 + 9, np.arange(3)[:, None], np.arange(8)[None, :]
    k0, k1 = philox.key(seed)
    for head in (2 ** 31 + 5, 2 ** 32 + 7, 2 ** 33 - 1, 3 * 2 ** 40 + 2):
        out = philox.philox4x32_10(cols >> 2, rows, head & philox.MASK32, head >> 32, k0, k1)
        want = np.choose(cols & 3, out)
        assert np.array_equal(philox.words(seed, head, rows, cols), want)


def test_a_word_equal_to_the_threshold_is_kept():
    """dropped = word < threshold(p): a weight whose word is exactly the threshold is kept."""
    seed = 5
    w = int(philox.words(seed, 0, 0, 0))
    p = w / 2 ** 32
    assert philox.threshold(p) == w and 0 < p < 1
    assert bool(philox.kept(seed, p, 0, 0, 0))
    assert not bool(philox.kept(seed, (w + 1) / 2 ** 32, 0, 0, 0))
