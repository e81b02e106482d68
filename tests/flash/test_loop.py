"""The forward's compiled tile loop (numba_kernels.tile_loop: one call per task, both
products by NumPy's own sgemm on a transposed copy of the keys, in row chunks that
OpenBLAS multiplies unpacked where it can) against the float64 reference and the same
loop in Python (np.matmul and the compiled tile kernels)."""

import numpy as np
import pytest

from attnkit import flash, reference
from attnkit.flash import blas, kernels, plan
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error

LOOP = kernels.compiled_kernels() is not None and kernels.compiled_kernels().tile_loop is not None
pytestmark = pytest.mark.skipif(kernels.compiled_kernels() is None, reason="numba is not installed")


def _packed():
    q, k, v = make_qkv((3, 300, 32), (3, 300, 32), dtype="float32", seed=5)
    return (q, k, v), dict(causal=True, cu_seqlens_q=np.array([0, 17, 160, 300]),
                           cu_seqlens_k=np.array([0, 17, 160, 300]))


def _layout():                                            # transformers' (B, S, H, D) as (B, H, S, D)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in make_qkv((2, 150, 4, 32), (2, 170, 4, 32), dtype="float32"))
    return (q, k, v), dict(causal=True)


def _one_key():                                           # S = 1: any row stride (BLAS's leading dim)
    q, k, v = make_qkv((2, 4, 90, 16), (2, 4, 1, 16), dtype="float32", seed=3)
    wide = np.zeros((2, 4, 1, 48), dtype=np.float32)
    wide[..., :16] = k
    return (q, wide[..., :16], v), {}


CASES = {
    "causal, row strips": lambda: (make_qkv((2, 3, 700, 32), (2, 3, 700, 32), dtype="float32"), dict(causal=True)),
    "GQA causal, each head in strips": lambda: (make_qkv((4, 8, 256, 32), (4, 2, 256, 32), dtype="float32"),
                                                dict(causal=True)),
    "small heads side by side": lambda: (make_qkv((3, 12, 100, 16), (3, 12, 80, 16), dtype="float32"), {}),
    "L != S, window, sinks": lambda: (make_qkv((2, 4, 300, 32), (2, 4, 900, 32), 24, dtype="float32", seed=1),
                                      dict(causal=True, window=(100, 0), sinks=np.linspace(-1, 1, 4))),
    "lengths, one empty": lambda: (make_qkv((3, 2, 200, 32), (3, 2, 260, 32), dtype="float32", seed=2),
                                   dict(causal=True, kv_lengths=np.array([0, 77, 260]),
                                        q_lengths=np.array([5, 60, 200]))),
    "packed": _packed,
    "(B, S, H, D) views": _layout,
    "one key": _one_key,
}


def _forward(monkeypatch, spec, loop, **blocks):
    monkeypatch.setattr(kernels, "USE_LOOP", loop)
    calls = []
    kern = kernels.compiled_kernels()
    real = kern.tile_loop
    if real is not None:
        monkeypatch.setattr(kern, "tile_loop", lambda *a: calls.append(1) or real(*a))
    out, lse, _ = flash.rung_forward(spec, **blocks)
    return out, lse, len(calls)


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found: the tile loop stays in Python")
@pytest.mark.parametrize("small", [0, 10**6, 3 * 10**5], ids=["whole tiles", "AVX-512 chunks", "odd chunks"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_loop_is_as_close_as_the_reference(monkeypatch, case, small):
    """Whole tiles (a BLAS without unpacked products), OpenBLAS's AVX-512 chunks and
    a limit that cuts tiles into uneven chunks: out and lse as close to the float64
    reference as the reference's own float32 is, and to the Python loop by the same
    budget (where a chunk lost or repeated rows, or a transposed key block was stale,
    whole rows would be off)."""
    monkeypatch.setattr(blas, "small_product_limit", lambda: small)
    (q, k, v), kw = CASES[case]()
    spec = validate(q, k, v, **kw)
    out, lse, n = _forward(monkeypatch, spec, True)
    want_out, want_lse, none = _forward(monkeypatch, spec, False)
    oracle = reference.rung_forward(validate(*(x.astype(np.float64) for x in (q, k, v)), **kw))
    same = reference.rung_forward(spec)
    assert n > 0 and none == 0
    for got in ((out, lse), (want_out, want_lse)):
        assert max_error(got[0], oracle[0]) <= error_budget(oracle[0], same[0])
        assert max_error(got[1], oracle[1]) <= error_budget(oracle[1], same[1])
    assert max_error(out, want_out) <= error_budget(oracle[0], same[0])


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
def test_compiled_loop_same_bits_on_one_and_two_threads(monkeypatch):
    q, k, v = make_qkv((2, 8, 300, 32), (2, 2, 300, 32), dtype="float32", seed=7)
    spec = validate(q, k, v, causal=True)
    outs = []
    for n in (1, 2):
        with flash.threads(n):
            outs.append(_forward(monkeypatch, spec, True)[:2])
    assert all(np.array_equal(a, b) for a, b in zip(*outs))


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_compiled_loop_hands_a_nonfinite_product_to_the_python_loop(monkeypatch, bad):
    """A NaN or inf value makes its column of p v non-finite: the compiled loop stops
    and the task (here head 1's rows) starts over on the Python loop, whose exempt
    product keeps rows that cannot see the key finite; head 0 stays on the loop."""
    q, k, v = make_qkv((1, 2, 400, 32), (1, 2, 400, 32), dtype="float32", seed=1)
    v[0, 1, 150, 3] = bad
    spec = validate(q, k, v, causal=True)
    out, lse, n = _forward(monkeypatch, spec, True)
    want_out, want_lse, _ = _forward(monkeypatch, spec, False)
    assert n == 2
    assert np.array_equal(out[0, 1], want_out[0, 1], equal_nan=True) and np.array_equal(lse[0, 1], want_lse[0, 1])
    assert np.isfinite(out[0, 1, :150]).all() and np.isnan(out[0, 1, 150:, 3]).all()
    assert np.allclose(out[0, 0], want_out[0, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(causal=True, softcap=5.0), dict(alibi_slopes=np.array([0.1, 0.2])),
                                dict(dropout=0.2, seed=3), dict(keep=np.tri(100, 50, 5, dtype=bool))])
def test_terms_inside_the_scores_keep_the_python_loop(monkeypatch, kw):
    """softcap, ALiBi, dropout and mask arrays change the scores between the two
    products: those calls take the Python loop."""
    q, k, v = make_qkv((2, 100, 16), (2, 50, 16), dtype="float32")
    assert _forward(monkeypatch, validate(q, k, v, **kw), True)[2] == 0
    assert (_forward(monkeypatch, validate(q, k, v), True)[2] > 0) == LOOP


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
@pytest.mark.parametrize("small", [0, 10**6])
def test_tile_loop_reads_each_tiles_own_keys(small):
    """Tiles in any order, starting at any key: rows 0–49 see keys [0, 64) in two
    tiles, rows 50–99 keys [16, 40) and then [40, 48), which lie inside the keys
    transposed for the tile before (and must not be read from their start). The
    running max, sum and unnormalised out are those of each row's keys."""
    q, k, v = make_qkv((1, 1, 100, 24), (1, 64, 24), dtype="float32", seed=4)
    tiles = np.array([[0, 50, 0, 40, 0], [0, 50, 40, 64, 0], [50, 100, 16, 40, 0], [50, 100, 40, 48, 0]])
    m, l_i = np.full(100, -np.inf, dtype=np.float32), np.zeros(100, dtype=np.float32)
    acc = np.zeros((1, 100, 24), dtype=np.float32)
    none = np.zeros(0, dtype=np.int64)
    from attnkit.flash import numba_kernels
    assert numba_kernels.tile_loop(blas.sgemm(), blas.somatcopy(), q, np.float32(0.2), k, v, tiles, none, none,
                                   np.empty(100 * 64, dtype=np.float32), m, l_i, acc, False, small)
    for rows, keys in ((slice(0, 50), slice(0, 64)), (slice(50, 100), slice(16, 48))):
        s = 0.2 * q[0, 0, rows].astype(np.float64) @ k[0, keys].T
        want_m = s.max(1)
        p = np.exp(s - want_m[:, None])
        assert np.allclose(m[rows], want_m, rtol=1e-5)
        assert np.allclose(l_i[rows], p.sum(1), rtol=1e-5)
        assert np.allclose(acc[0, rows], p @ v[0, keys], rtol=1e-4, atol=1e-5)


def test_flat_tiles_cover_each_visible_pair_once():
    """The compiled loop's tiles of a GQA unit: every (row, key) pair the band lets a
    row see lies in exactly one tile, and the strips keep what else is computed small
    (the causal triangle of each strip)."""
    q, k, v = make_qkv((1, 8, 256, 32), (1, 2, 256, 32), dtype="float32")
    call = plan.Call(validate(q, k, v, causal=True), None, None)
    u = call.units[0]
    assert u.g == 4
    tiles = call.flat_tiles(u, 0, 256)
    seen = np.zeros((4 * 256, 256), dtype=int)
    for f0, f1, c0, c1, _ in tiles:
        seen[f0:f1, c0:c1] += 1
    visible = np.tile(np.tri(256, 256, dtype=bool), (4, 1))
    assert (seen[visible] == 1).all() and seen.max() == 1
    assert (seen > 0).sum() - visible.sum() <= 4 * 256 * plan.LOOP_SUB_M // 2 + 4 * 256


def test_sgemm_is_numpys_product():
    """The BLAS function the loop calls computes what np.matmul does, bit for bit."""
    f = blas.sgemm()
    if f is None:
        pytest.skip("this NumPy's BLAS has no 64-bit-integer cblas_sgemm")
    a, b, _ = make_qkv((70, 33), (50, 33), dtype="float32")
    c = np.empty((70, 50), dtype=np.float32)
    f(blas.ROW_MAJOR, blas.NO_TRANS, blas.TRANS, 70, 50, 33, 1.0, a.ctypes.data, 33, b.ctypes.data, 33, 0.0,
      c.ctypes.data, 50)
    assert np.array_equal(c, a @ b.T)


def _numpys_blas() -> str:
    try:
        return str(np.show_config(mode="dicts")["Build Dependencies"]["blas"]["name"])
    except (TypeError, KeyError):                        # NumPy 1's show_config has no dicts
        return ""


@pytest.mark.skipif(_numpys_blas() != "scipy-openblas", reason="not NumPy's own OpenBLAS (a wheel's)")
def test_numpys_wheel_sgemm_is_found_and_runs_the_loop(monkeypatch):
    """NumPy's wheels (what pip installs, CI included) bundle OpenBLAS with 64-bit
    integers: its sgemm is found, passes the check product, and a plain float32 call
    takes the compiled loop by default — else every test above would skip and the
    tile loop silently stay in Python."""
    assert blas.sgemm() is not None and blas.somatcopy() is not None and LOOP
    kern, calls = kernels.compiled_kernels(), []
    real = kern.tile_loop
    monkeypatch.setattr(kern, "tile_loop", lambda *a: calls.append(1) or real(*a))
    q, k, v = make_qkv((2, 100, 16), (2, 100, 16), dtype="float32")
    flash.rung_forward(validate(q, k, v, causal=True))
    assert calls


def test_somatcopy_transposes_exactly():
    """The keys' transposed copy: every value as it was (NaN, inf, −0 too), into rows
    with a leading dim wider than the keys."""
    f = blas.somatcopy()
    if f is None:
        pytest.skip("this NumPy's BLAS has no 64-bit-integer cblas_somatcopy")
    k = make_qkv((37, 20), (1, 20), dtype="float32")[0]
    k[3, 4], k[5, 6], k[7, 8] = np.nan, -np.inf, -0.0
    out = np.full((20, 50), 7.0, dtype=np.float32)
    f(blas.ROW_MAJOR, blas.TRANS, 37, 20, 1.0, k.ctypes.data, 20, out.ctypes.data, 50)
    assert np.array_equal(out[:, :37], k.T, equal_nan=True) and np.signbit(out[8, 7])
    assert (out[:, 37:] == 7.0).all()


@pytest.mark.parametrize("core, limit", [(b"SkylakeX", 10**6), (b"Cooperlake", 10**6), (b"SapphireRapids", 10**6),
                                         (b"Haswell", 0), (b"Zen", 0), (None, 0)])
def test_small_products_only_on_openblas_avx512_kernels(monkeypatch, core, limit):
    """Row chunks only where NumPy's OpenBLAS runs a kernel that multiplies small
    untransposed products unpacked (elsewhere chunks only add packing: 16-row chunks
    ran at 80 against 99 GFLOP/s on OpenBLAS's Haswell kernel)."""
    monkeypatch.setattr(blas, "_found", {"corename": None if core is None else (lambda: core)})
    assert blas.small_product_limit() == limit


@pytest.mark.parametrize("missing", ["sgemm", "somatcopy"])
def test_without_numpys_sgemm_the_loop_stays_in_python(monkeypatch, missing):
    """A NumPy whose library exports no known sgemm (or somatcopy): no compiled loop,
    and calls still run (on the Python loop)."""
    found = {kind: blas._get(kind) for kind in ("sgemm", "somatcopy")}
    monkeypatch.setattr(blas, "_found", dict(found, **{missing: None}))
    from attnkit.flash import numba_kernels
    assert numba_kernels._tile_loop_kernel() is None
    monkeypatch.setattr(blas, "_found", {})
    monkeypatch.setattr(blas, "_numpy_library", lambda: object())
    assert blas.sgemm() is None and blas.somatcopy() is None and blas.small_product_limit() == 0


@pytest.mark.parametrize("layout", ["C order", "(B, L, H, D)", "float16"])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_q_rows_are_q_in_place_where_blas_can_read_them(layout, kv_heads):
    """q_rows: the unit's rows of q, unscaled, as the compiled loop reads them —
    q's own memory where BLAS can read it (a GQA group of a (B, L, H, D) layout as
    one block of rows per query head), a copy where they need converting."""
    q, k, v = make_qkv((2, 8, 50, 16), (2, kv_heads, 50, 16), dtype="float16" if layout == "float16" else "float32")
    if layout == "(B, L, H, D)":
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    call = plan.Call(validate(q, k, v), None, None)
    for u in call.units:
        got = call.q_rows(u, 0, 50)
        assert got.shape == ((u.nk, u.g, 50, 16) if layout == "(B, L, H, D)" else (u.nk, 1, u.g * 50, 16))
        assert np.shares_memory(got, q) == (layout != "float16")
        assert np.array_equal(got.reshape(u.nk, u.g * 50, 16), call.q_tile(u, 0, 50, scaled=False))


def test_a_loop_that_fails_its_check_is_not_used(monkeypatch):
    """Where numba cannot call BLAS through a pointer, or the loop computes something
    else, the probe says so and the kernels keep the Python loop."""
    def wrong(q, qscale, k, v, tiles, lo, hi, s, m_i, l_i, acc, one):
        m_i[:], l_i[:], acc[...] = 2.0, 1.0, 3.0         # a wrong value
        return True

    def refuses(*a):
        raise TypeError("no pointer calls here")

    assert kernels._loop_works(kernels.compiled_kernels().tile_loop if LOOP else wrong) == LOOP
    assert not kernels._loop_works(wrong) and not kernels._loop_works(refuses)
    assert not kernels._loop_works(lambda *a: False)     # stopped, as on a non-finite product
    from types import SimpleNamespace
    fake = SimpleNamespace(WIDE_ATTRIBUTES=(), rescale_add=lambda *a: None,
                           KERNELS=SimpleNamespace(tile_loop=refuses))
    assert kernels._probed(fake).tile_loop is None
