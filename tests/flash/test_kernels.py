"""The flash rung's tile kernels: the NumPy set and the compiled float32 set compute
the same thing, including the edge rows (nothing seen yet, bounds outside the tile,
huge negative scores), and the per-tile ALiBi and dropout terms."""

import numpy as np
import pytest

import attnkit
from attnkit import philox
from attnkit.flash import kernels as K
from attnkit.nonfinite import quiet
from attnkit.testing import make_qkv, max_error


def kernel_set(name):
    return K.NUMPY if name == "numpy" else K.compiled_kernels()


def test_bounded_softmax_tile_is_the_masked_tile(kernels):
    """The fused causal/window softmax (row bounds, no mask) against the plain tile
    with −inf outside the bounds, including empty rows and bounds outside the tile."""
    kern = kernel_set(kernels)
    rng = np.random.default_rng(0)
    rows, w, c0 = 9, 37, 20
    s = (rng.standard_normal((rows, w)) * 3).astype(np.float32)
    lo = np.array([0, 20, 25, 30, 57, 60, 40, 22, 10])
    hi = np.array([25, 57, 26, 30, 70, 80, 45, 56, 15])
    m0 = np.array([-np.inf, 1.0, -np.inf, 2.0, -np.inf, 0.5, 9.0, -np.inf, -np.inf], np.float32)
    l0 = np.where(np.isfinite(m0), 1.5, 0.0).astype(np.float32)
    cols = np.arange(c0, c0 + w)
    inside = (cols >= lo[:, None]) & (cols < hi[:, None])
    masked = np.where(inside, s, -np.inf).astype(np.float32)
    poison = np.resize(np.float32([np.nan, np.inf, 1e30, -np.inf]), s.shape)
    s = np.where(inside, s, poison)                      # outside the bounds: never read into a row
    m1, l1, m2, l2 = m0.copy(), l0.copy(), m0.copy(), l0.copy()
    s1, s2 = s.copy(), masked.copy()
    a1 = kern.softmax_tile_bounded(s1, m1, l1, lo, hi, c0)
    a2 = kern.softmax_tile(s2, m2, l2)
    assert np.array_equal(m1, m2)
    for x, y in ((s1, s2), (l1, l2), (a1, a2)):
        assert np.all(np.isfinite(x)) and np.allclose(x, y, rtol=1e-6, atol=0)
    assert np.all(s1[(cols < lo[:, None]) | (cols >= hi[:, None])] == 0)


def test_nan_scores_make_the_row_nan_and_other_rows_exact(kernels):
    kern = kernel_set(kernels)
    s = np.array([[1.0, np.nan, 0.5], [0.2, 0.1, 0.0], [np.inf, 0.0, 1.0]], np.float32)
    m, l = np.full(3, -np.inf, np.float32), np.zeros(3, np.float32)
    with quiet():                                         # how every rung runs its tiles
        kern.softmax_tile(s, m, l)
    assert np.isnan(l[0]) and np.isnan(l[2]) and np.isfinite(l[1])
    assert abs(l[1] - np.exp(np.float32([0.0, -0.1, -0.2])).sum()) < 1e-6


def test_finish_into_writes_each_row_over_its_sum_into_a_strided_view(kernels):
    """out ← acc / l into an (F, R, Dv) view of another layout: exact division (the
    bits of NumPy's), rows with l = 0 get 0 whatever acc holds, an inf result is NaN,
    a NaN sum leaves NaN; nothing outside the view is written. ``normalize`` gives the
    same in place. lse ← m + log l into a strided (F, R) view: −inf where l = 0, NaN
    for a NaN sum."""
    kern = kernel_set(kernels)
    rng = np.random.default_rng(0)
    F, R, Dv = 3, 4, 5
    acc = rng.standard_normal((F * R, Dv)).astype(np.float32)
    l_i = (rng.random(F * R) * 3 + 0.5).astype(np.float32)
    l_i[[1, 6]] = 0.0
    acc[1, 2] = acc[6, 0] = np.nan                      # a row without keys: 0, even so
    acc[4, 3], l_i[9] = np.inf, np.nan
    with quiet():
        want = acc / l_i[:, None]
    want[[1, 6]] = 0.0
    want[4, 3] = np.nan
    big = np.full((R, F + 2, Dv), 7.0, np.float32)      # out: (F, R, Dv) seen in an (R, F, Dv) buffer
    out = big[:, 1:F + 1].transpose(1, 0, 2)
    m_i = rng.standard_normal(F * R).astype(np.float32)
    m_i[6] = -np.inf
    lse_big = np.full((R, F + 2), 7.0, np.float32)
    lse = lse_big[:, 1:F + 1].T
    with quiet():
        kern.finish_into(acc.copy(), m_i, l_i, out, lse)
        want_lse = np.where(l_i == 0, -np.inf, np.log(np.where(l_i == 0, 1, l_i)) + m_i)
    got, fin = lse.reshape(-1), np.isfinite(want_lse)
    assert np.allclose(got[fin], want_lse[fin], rtol=1e-6, atol=0) and np.all(lse_big[:, [0, F + 1]] == 7.0)
    assert np.array_equal(got[~fin], want_lse[~fin], equal_nan=True) and np.isnan(got[9]) and got[6] == -np.inf
    assert np.array_equal(out.transpose(1, 0, 2).reshape(-1), want.reshape(F, R, Dv).transpose(1, 0, 2).reshape(-1),
                          equal_nan=True)
    assert np.all(big[:, 0] == 7.0) and np.all(big[:, F + 1] == 7.0)
    inplace = acc.copy()                                 # normalize: the same, in place
    with quiet():
        kern.normalize(inplace, l_i)
    assert np.array_equal(inplace, want, equal_nan=True)


def test_exp_from_lse_exempts_excluded_keys_from_a_nan_lse(kernels):
    kern = kernel_set(kernels)
    s = np.array([[0.5, -np.inf], [0.5, -np.inf], [0.5, 0.25]], np.float32)
    kern.exp_from_lse(s, np.array([np.nan, -np.inf, 1.0], np.float32))
    assert np.isnan(s[0, 0]) and s[0, 1] == 0                 # NaN lse: NaN where visible, 0 where excluded
    assert np.all(s[1] == 0)                                  # lse −inf (fully masked): 0
    assert np.allclose(s[2], np.exp(np.float32([-0.5, -0.75])), rtol=1e-6)


def test_alibi_and_dropout_tiles_agree_between_kernel_sets():
    if K.compiled_kernels() is None:
        pytest.skip("numba is not installed")
    rng = np.random.default_rng(1)
    s = rng.standard_normal((3, 5, 11)).astype(np.float32)
    slopes = rng.uniform(0.1, 1, 3).astype(np.float32)
    outs = []
    for kern in (K.NUMPY, K.compiled_kernels()):
        t = s.copy()
        kern.alibi_tile(t, slopes, 7, 2, 4)
        kern.dropout_tile(t, np.array([0, 9, 2 ** 33]), 7, 2, 2 ** 40 + 5, philox.threshold(0.3), 1 / 0.7)
        outs.append(t)
    assert np.allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)
    dist = np.abs((7 + np.arange(5) + 4)[:, None] - (2 + np.arange(11))[None, :])
    kept = philox.kept(2 ** 40 + 5, 0.3, np.array([0, 9, 2 ** 33])[:, None, None],
                       (7 + np.arange(5))[None, :, None], (2 + np.arange(11))[None, None, :])
    want = np.where(kept, (s - slopes[:, None, None] * dist) / np.float32(0.7), 0)
    assert np.allclose(outs[0], want, rtol=1e-5, atol=1e-6)


def test_huge_negative_bias_row_on_every_kernel(kernels):
    """A row whose scores are all near float32's most negative value (an additive
    finfo.min padding mask) is a uniform row, as in the reference, on both kernel sets."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((1, 3, 8), (1, 5, 8), seed=22))
    bias = np.zeros((3, 5), np.float32)
    bias[1] = np.finfo(np.float32).min
    out = attnkit.attention(q, k, v, bias=bias, backend="flash")
    ref = attnkit.attention(q, k, v, bias=bias, backend="reference")
    assert np.all(np.isfinite(out)) and max_error(out, ref) <= 1e-5
    assert max_error(out[0, 1], v[0].mean(0)) <= 1e-5


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(window=(9, 0), softcap=3.0),
                                dict(alibi_slopes=np.array([0.5, 0.1]), sinks=np.array([1.0, -0.5])),
                                dict(kv_lengths=np.array([300, 0, 129]), causal=True)],
                         ids=["plain", "causal", "window_softcap", "alibi_sinks", "lengths"])
def test_streaming_decode_kernel_is_the_tiled_forward(kw, monkeypatch):
    """Few query rows (decoding) take the compiled streaming kernel: the same result as
    the tiled path within float32 rounding, and NaN values only reach rows that see them."""
    if K.compiled_kernels() is None:
        pytest.skip("numba is not installed")
    from attnkit import flash
    from attnkit.flash import plan
    from attnkit.spec import validate
    q, k, v = (x.astype(np.float32) for x in make_qkv((3, 2, 2, 32), (3, 1, 300, 32), seed=3))
    v[1, 0, 250] = np.nan                                 # seen by every row of batch 1 unless excluded
    spec = validate(q, k, v, **kw)
    streamed = flash.rung_forward(spec)
    assert plan.Call(spec, None, None).streams(plan.Call(spec, None, None).units[0], 0, 2)
    monkeypatch.setattr(plan, "DECODE_ROWS", 0)
    tiled = flash.rung_forward(spec)
    for a, b in zip(streamed[:2], tiled[:2]):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        fin = np.isfinite(b)
        assert np.allclose(a[fin], b[fin], rtol=2e-6, atol=2e-6)


def test_dropout_keeps_a_weight_whose_word_is_the_threshold(kernels):
    """dropped = word < threshold: with p chosen so that a weight's word is exactly the
    threshold, both kernel sets keep that weight (as the reference does) and drop the
    one whose word is below it."""
    kern = kernel_set(kernels)
    seed, heads = 3, np.array([0, 1])
    w = philox.words(seed, heads[:, None, None], np.arange(2)[None, :, None], np.arange(5)[None, None, :])
    thr = int(w[1, 1, 2])
    p = np.ones((2, 2, 5), np.float32)
    kern.dropout_tile(p, heads, 0, 0, seed, thr, 2.0)
    assert np.array_equal(p, np.where(w >= thr, 2.0, 0.0).astype(np.float32)) and p[1, 1, 2] == 2.0
    p64 = np.ones((2, 2, 5))
    K.NUMPY.dropout_tile(p64, heads, 0, 0, seed, thr, 2.0)
    assert np.array_equal(p64, p)


def test_without_numba_float32_takes_the_numpy_kernels(monkeypatch):
    """numba missing: compiled_kernels() is None (asked once) and float32 tiles take the
    NumPy set; the call still computes."""
    import sys
    monkeypatch.setattr(K, "_compiled", [])
    import attnkit.flash
    monkeypatch.setitem(sys.modules, "attnkit.flash.numba_kernels", None)     # import fails
    monkeypatch.delattr(attnkit.flash, "numba_kernels", raising=False)
    assert K.compiled_kernels() is None and K._compiled == [None]
    assert K.compiled_kernels() is None and K.for_dtype(np.float32) is K.NUMPY
    q, k, v = make_qkv((1, 2, 5, 8), (1, 2, 7, 8), dtype="float32", seed=1)
    want = attnkit.attention(*(x.astype(np.float64) for x in (q, k, v)), backend="reference")
    assert max_error(attnkit.attention(q, k, v, backend="flash"), want) <= 1e-5


def test_without_working_vectors_decoding_takes_the_tiles(monkeypatch):
    """A numba whose vector intrinsics fail their probe: no decode_part, no small_rows,
    small_rows_at or kvcache_rows_at (asked once), and decoding on the flash and small rungs still
    computes, by the tiles and the products."""
    pytest.importorskip("numba")
    from attnkit.flash import numba_kernels as nk
    from attnkit.flash import numba_simd
    for name in ("decode_part", "small_rows", "small_rows_at", "kvcache_rows_at", "small_units"):
        monkeypatch.setattr(nk.KERNELS, name, getattr(nk.KERNELS, name))   # restored after
    monkeypatch.setattr(K, "_compiled", [])
    monkeypatch.setattr(numba_simd, "works", lambda: False)
    kern = K.compiled_kernels()
    assert kern.decode_part is None and kern.small_rows is None and kern.small_rows_at is None and kern.small_units is None
    assert kern.kvcache_rows_at is None
    assert kern.tile_tasks is not None
    q, k, v = make_qkv((2, 8, 1, 16), (2, 2, 40, 16), dtype="float32", seed=2)
    want = attnkit.attention(*(x.astype(np.float64) for x in (q, k, v)), backend="reference")
    lengths = np.array([40, 40])
    assert max_error(attnkit.attention_kvcache(q, k, v, lengths, backend="flash"), want) <= 1e-5
    assert max_error(attnkit.attention(q, k, v, backend="small"), want) <= 1e-5


def test_compiled_kernels_ask_llvm_for_wide_vectors():
    """The kernels' LLVM functions carry the 512-bit vector attributes (a silent loss —
    a numba or llvmlite that drops them — would cost AVX-512 machines 5–20%)."""
    numba = pytest.importorskip("numba")
    from llvmlite import ir

    from attnkit.flash import numba_kernels as nk
    if not isinstance(ir.FunctionAttributes(), set):
        pytest.skip("this llvmlite keeps function attributes otherwise (the kernels run without them)")

    @numba.njit
    def f(x):
        nk._wide()
        for i in range(x.shape[0]):
            x[i] *= 2.0

    x = np.ones(64, dtype=np.float32)
    f(x)
    ir = "".join(f.inspect_llvm().values())
    assert x[0] == 2.0 and all(a in ir for a in nk.WIDE_ATTRIBUTES)
