"""The explicit vectors of numba_simd: each primitive on its own (partial loads and
stores touch only their lanes, sums put each vector's sum where it is said to); and
the decoding products of numba_products against NumPy for every remainder of rows,
keys and head dims."""

import os
import subprocess
import sys

import numba
import numpy as np
import pytest

from attnkit.flash import numba_products as P
from attnkit.flash import numba_simd as V


W = V.LANES


@numba.njit
def _round_trip(src, dst, n):
    # dst[0:W] ← src[0:W]; dst[W:2W] ← the first n lanes of src[W:2W] (the rest 0);
    # dst[2W:3W] ← src[2W:3W], only n lanes stored
    V.store(V.address(dst, (0,)), V.load(V.address(src, (0,))))
    V.store(V.address(dst, (W,)), V.load_part(V.address(src, (W,)), n))
    V.store_part(V.address(dst, (2 * W,)), V.load(V.address(src, (2 * W,))), n)


@pytest.mark.parametrize("n", [0, 1, W // 2 - 1, W - 1, W])
def test_partial_loads_read_and_partial_stores_write_only_their_lanes(n):
    src = np.arange(3 * W, dtype=np.float32) + 1
    dst = np.full(3 * W, -5.0, dtype=np.float32)
    _round_trip(src, dst, n)
    lanes = np.arange(W)
    assert np.array_equal(dst[:W], src[:W])
    assert np.array_equal(dst[W:2 * W], np.where(lanes < n, src[W:2 * W], 0))          # the rest zero
    assert np.array_equal(dst[2 * W:], np.where(lanes < n, src[2 * W:], -5))           # the rest untouched


def test_the_lanes_are_the_machines_widest():
    """16 lanes where numba compiles for AVX-512F, else 8 (AVX2's registers: the
    products' tiles sized for 32 registers of 16 spilled there); ATTNKIT_SIMD_LANES's
    where set (the run at the other width checks that it runs at it)."""
    forced = os.environ.get("ATTNKIT_SIMD_LANES")
    if forced:                                            # (the run at the other width: that one)
        assert V.LANES == int(forced)
    elif numba.config.CPU_FEATURES is None:
        import llvmlite.binding as ll
        assert V.LANES == (16 if ll.get_host_cpu_features().get("avx512f") else 8)
    assert P.KEYS * 4 == V.LANES and P.VALUE_LANES == (64 if V.LANES == 16 else 16)


@numba.njit
def _row(x, i):
    return V.load(V.address(x, (i, 0)))


@numba.njit
def _sums(x, out):
    V._probe_sums(V.address(out, (0, 0)), out.strides[0], x, _row(x, 0), _row(x, 1), _row(x, 2))
    return V.sum4(_row(x, 0), _row(x, 1), _row(x, 2), _row(x, 3)), V.hsum(V.fma(_row(x, 5), V.splat(2.0), _row(x, 6)))


def test_lane_sums_land_where_they_are_said_to():
    """sum4 gives each vector's sum in argument order, hsum one vector's (of a·b + c),
    and put_sums4 row i's c = LANES / 4 sums (vectors ci … ci + c − 1; here x's rows 0,
    1, 2, 0, 4, …) at row i — exact here (integers)."""
    x = np.random.default_rng(0).integers(-50, 50, (16, W)).astype(np.float32)
    out = np.full((4, W // 4 + 2), 7.0, dtype=np.float32)
    s, h = _sums(x, out)
    assert s == tuple(x[:4].sum(axis=1))
    assert h == (2 * x[5] + x[6]).sum()
    rows = np.concatenate([x[[0, 1, 2, 0]], x[4:W]])
    assert np.array_equal(out[:, :W // 4], rows.sum(axis=1).reshape(4, W // 4))
    assert np.all(out[:, W // 4:] == 7)                  # nothing past each row's sums


@numba.njit
def _scores(q, k, v, s, j0, j1):
    P.scores(V.address(q, (0, 0)), q.strides[0], q.shape[0], q.shape[1], V.address(k, (0, 0)), k.strides[0], j0, j1,
             V.address(s, (0, 0)), s.strides[0], V.address(v, (0, 0)), v.strides[0], 4 * v.shape[1])


@numba.njit
def _values(s, v, acc, j0, j1):
    P.weighted_values(V.address(s, (0, 0)), s.strides[0], acc.shape[0], j0, j1, V.address(v, (0, 0)), v.strides[0],
                      V.address(acc, (0, 0)), acc.strides[0], acc.shape[1])


@pytest.mark.parametrize("R", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("D", [1, 16, 17, 21, 29, 64, 72, 93, 130])
def test_scores_and_weighted_values_match_numpy(R, D):
    """Every row block (4 and the rest) and key block (4 and the rest; a tile of two
    keys takes both halves of a block), head dims with and without a partial vector,
    value widths around the value blocks (64 lanes, or 16 at 8 lanes; a last block of
    one whole vector and none in the second: Dv = 24, 8 lanes); keys j0 … j1
    only (the others' scores and the output past Dv untouched), rows padded in memory."""
    rng = np.random.default_rng(R * 1000 + D)
    S, j0, j1, Dv = 11, 2, 9, D + 3
    q = rng.standard_normal((R, D + 5)).astype(np.float32)[:, :D]        # rows a row apart, padded
    k = rng.standard_normal((S, D + 2)).astype(np.float32)[:, :D]
    v = rng.standard_normal((S, Dv + 1)).astype(np.float32)[:, :Dv]
    s = np.full((R, S + 3), 99.0, dtype=np.float32)
    _scores(q, k, v, s, j0, j1)
    want = q.astype(np.float64) @ k.T.astype(np.float64)
    np.testing.assert_allclose(s[:, j0:j1], want[:, j0:j1], rtol=1e-5, atol=1e-5 * np.sqrt(D))
    assert np.all(s[:, :j0] == 99) and np.all(s[:, j1:] == 99)
    acc0 = rng.standard_normal((R, Dv + 4)).astype(np.float32)
    acc = acc0.copy()
    _values(s, v, acc[:, :Dv], j0, j1)
    want = acc0[:, :Dv] + s[:, j0:j1].astype(np.float64) @ v[j0:j1].astype(np.float64)
    np.testing.assert_allclose(acc[:, :Dv], want, rtol=1e-5, atol=1e-4)
    assert np.array_equal(acc[:, Dv:], acc0[:, Dv:])


@numba.njit
def _bounded(s, v, acc, lo, hi, skip):
    P.weighted_values_bounded(V.address(s, (0, 0)), s.strides[0], acc.shape[0], lo, hi, skip, V.address(v, (0, 0)),
                              v.strides[0], V.address(acc, (0, 0)), acc.strides[0], acc.shape[1])


@pytest.mark.parametrize("R", [1, 4, 6, 9])
@pytest.mark.parametrize("Dv", [16, 32, 40, 64, 96, 100])
def test_weighted_values_over_each_rows_own_keys(R, Dv):
    """Each row over its own keys only (the four rows' shared keys at once, the rest
    alone; empty and disjoint ranges too): a NaN value row outside every row's range
    is never read; skipped rows are left as they were."""
    rng = np.random.default_rng(R * 100 + Dv)
    S = 30
    lo = rng.integers(0, 12, R)
    hi = lo + rng.integers(0, 17, R)
    lo[R // 2], hi[R // 2] = 20, 20                       # an empty row
    skip = rng.random(R) < 0.25
    s = rng.standard_normal((R, S)).astype(np.float32)
    v = rng.standard_normal((S + 1, Dv)).astype(np.float32)
    v[29] = np.nan                                        # past every range
    acc0 = rng.standard_normal((R, Dv)).astype(np.float32)
    acc = acc0.copy()
    _bounded(s, v, acc, lo, hi, skip)
    for r in range(R):
        want = acc0[r] if skip[r] else acc0[r] + s[r, lo[r]:hi[r]].astype(np.float64) @ v[lo[r]:hi[r]]
        np.testing.assert_allclose(acc[r], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("wrong", [None, "raises", "past_n", "sums", "get", "sum4", "hsum", "exp2", "fill",
                                   "hmax", "neginf"])
def test_the_probe_accepts_these_intrinsics_and_refuses_wrong_ones(monkeypatch, wrong):
    """works() is True here, and False when the probe's compile fails or any one of its
    results is off (a store past its lanes, a lane sum, a scalar move, sum4, hsum, the
    vector exp or arithmetic, a lane fill, the lane max, the −inf lanes)."""
    real = V._probe

    def probe(x, out):
        if wrong == "raises":
            raise numba.core.errors.TypingError("no such intrinsic")
        s4, h, top, neginf = real(x, out)
        if wrong == "past_n":
            out[0, 7] = out[1, 7]
        elif wrong == "sums":
            out[3, 2] += 1
        elif wrong == "get":
            out[6, 0] += 1
        elif wrong == "sum4":
            s4 = s4[:3] + (s4[3] + 1,)
        elif wrong == "hsum":
            h += 1
        elif wrong == "exp2":
            out[7, 1] *= 1.0000001
        elif wrong == "fill":
            out[7, W - 2] += 1
        elif wrong == "hmax":
            top = 3.0
        elif wrong == "neginf":
            neginf -= 1
        return s4, h, top, neginf

    monkeypatch.setattr(V, "_probe", probe)
    assert V.works() is (wrong is None)


@numba.njit
def _exp2v(t, out):
    for i in range(0, t.shape[0], W):
        V.store(V.address(out, (i,)), V.exp2v(V.load(V.address(t, (i,)))))


def test_the_vector_exp_is_the_scalar_one_bit_for_bit():
    """exp2v and numba_kernels.exp2_f32 are one rule (EXP2_POLY): the same bits for
    every t the softmax gives (t ≤ 0), around the underflow cut (0 below −125), for
    −inf (0) and NaN (NaN)."""
    from attnkit.flash.numba_kernels import exp2_f32
    rng = np.random.default_rng(5)
    t = np.concatenate([-rng.exponential(8.0, 4000), np.linspace(-126, -124, 200), np.arange(-130, 1),
                        [0.0, -0.5, -1.5, -np.inf, np.nan, -1e-8, -125.0, -124.99999]]).astype(np.float32)
    t = np.concatenate([t, np.zeros(-len(t) % W, np.float32)])
    out = np.empty_like(t)
    _exp2v(t, out)
    want = np.array([exp2_f32(x) for x in t], dtype=np.float32)
    assert np.array_equal(out.view(np.int32)[~np.isnan(t)], want.view(np.int32)[~np.isnan(t)])
    assert np.isnan(out[np.isnan(t)]).all()
    ok = t > -125
    np.testing.assert_allclose(out[ok], np.exp2(t[ok].astype(np.float64)), rtol=3e-7, atol=0)
    assert (out[t < -125] == 0).all()


@numba.njit
def _row_passes(x, n, scale, shift):
    p = V.address(x, (0,))
    P.scale_row(p, n, scale)
    top, holes = P.row_max(p, n)
    return top, holes, P.exp_row(p, n, shift)


@pytest.mark.parametrize("n", [0, 1, 5, 16, 17, 31, 32, 45, 64])
@pytest.mark.parametrize("case", ["plain", "neginf", "nan"])
def test_row_passes_scale_find_the_max_and_exponentiate_only_their_lanes(n, case):
    """scale_row, row_max and exp_row on a row of n of a longer buffer: the max and a −inf
    among the n (never past them), exp(x − shift) in place and its sum; the floats
    past n untouched."""
    rng = np.random.default_rng(n)
    buf = rng.standard_normal(n + 20).astype(np.float32)
    buf[n:] = 50.0                                        # past the row: larger than any
    if n and case == "neginf":
        buf[n // 2] = -np.inf
    if n and case == "nan":
        buf[n - 1] = np.nan
    if case != "neginf":
        buf[n + 1] = -np.inf                              # past the row: no hole
    x = buf.copy()
    top, holes, total = _row_passes(x, n, np.float32(0.5), np.float32(0.25))
    row = buf[:n].astype(np.float64) * 0.5
    finite = row[~np.isnan(row)]
    if not (case == "nan" and n):                         # with a NaN the max is any value: the
        assert top == (finite.max() if len(finite) else -np.inf)   # row is NaN through its exp
    assert holes is bool(n and case == "neginf")
    e = np.exp(row - 0.25)
    np.testing.assert_allclose(x[:n], e, rtol=3e-7)
    assert np.isnan(total) if case == "nan" and n else np.isclose(total, e.sum(), rtol=1e-6)
    assert np.array_equal(x[n:], buf[n:])


@pytest.mark.skipif(bool(os.environ.get("ATTNKIT_SIMD_LANES")), reason="this is the run at the other width")
def test_the_other_lane_count_passes_these_tests_too(tmp_path):
    """This file at the lane count this machine does not use (16 lanes run, split by
    LLVM, where AVX-512 is missing; 8 lanes on any x86-64): both tiles' code is tested
    on every host. Its own numba cache: the disk cache does not know LANES."""
    env = dict(os.environ, ATTNKIT_SIMD_LANES=str(24 - W), NUMBA_CACHE_DIR=str(tmp_path))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                          __file__], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and " failed" not in run.stdout
