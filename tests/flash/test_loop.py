"""The forward's compiled tile loop (numba_loop.tile_tasks: a call's tasks in one
compiled call per thread, both products by NumPy's own sgemm on a transposed copy of
the keys, in row chunks that OpenBLAS multiplies unpacked where it can) against the
float64 reference and the same loop in Python (np.matmul and the compiled tile
kernels)."""

import ctypes

import numpy as np
import pytest

from attnkit import flash, reference
from attnkit.flash import blas, forward, kernels, numba_loop, plan, runtime
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error

LOOP = kernels.compiled_kernels() is not None and kernels.compiled_kernels().tile_tasks is not None
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


def _shared_keys():                                      # k, v broadcast over the batch (not expanded)
    q, k, v = make_qkv((3, 4, 120, 16), (1, 2, 90, 16), dtype="float32", seed=6)
    return (q, k, v), dict(causal=True)


def _fewer_batch_dims():                                  # k, v (3, …) against q (2, 3, …): padded with a 1
    q, k, v = make_qkv((2, 3, 2, 100, 16), (3, 2, 120, 16), dtype="float32", seed=11)
    return (q, k, v), dict(causal=True)


def _odd_batch():                                         # batch dims that do not merge: copied once
    q, k, v = make_qkv((2, 3, 4, 70, 16), (2, 3, 4, 90, 16), dtype="float32", seed=8)
    return (q, k, v[:, ::-1]), dict(causal=True)


def _split():                                             # few tasks, many keys: split-KV parts
    q, k, v = make_qkv((1, 2, 100, 32), (1, 2, 5000, 32), dtype="float32", seed=9)
    return (q, k, v), dict(sinks=np.array([0.5, -1.0]))


def _small_heads_sinks():                                # twelve heads per task, two without a sink
    q, k, v = make_qkv((2, 6, 100, 16), (2, 6, 80, 16), dtype="float32", seed=12)
    return (q, k, v), dict(sinks=np.array([0.5, -np.inf, 1.0, -np.inf, 0.0, -2.0]))


def _decoding_next_to_prefill():                          # one sequence streams, the other loops
    q, k, v = make_qkv((2, 4, 200, 32), (2, 4, 300, 32), dtype="float32", seed=10)
    return (q, k, v), dict(causal=True, q_lengths=np.array([3, 200]))


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
    "keys shared by the batch": _shared_keys,
    "keys with fewer batch dims": _fewer_batch_dims,
    "batch dims that do not merge": _odd_batch,
    "split keys, sinks": _split,
    "small heads side by side, sinks": _small_heads_sinks,
    "decoding rows next to a prefill": _decoding_next_to_prefill,
}


def _forward(monkeypatch, spec, loop, **blocks):
    """(out, lse, calls of the compiled loop)."""
    out, lse, counts = _claims(monkeypatch, spec, loop, **blocks)
    return out, lse, len(counts)


def _slot(address, i):
    """Slot i of a packed block of the compiled loop's arguments at address."""
    return ctypes.c_int64.from_address(address + 8 * i).value


def _claims(monkeypatch, spec, loop, **blocks):
    """(out, lse, where the task counter stood after each pass of the compiled loop):
    passes of BUDGET scores (not one pass on torch's team)."""
    monkeypatch.setattr(kernels, "USE_LOOP", loop)
    monkeypatch.setattr(runtime, "run_native", lambda *a, **kw: False)
    counts = []
    tasks = kernels.compiled_kernels().tile_tasks
    if tasks is not None:
        real = tasks.run

        def run(address):
            real(address)
            counts.append(ctypes.c_int64.from_address(_slot(address, numba_loop.AT_COUNTER)).value)
        monkeypatch.setattr(tasks, "run", run)
    out, lse, _ = flash.rung_forward(spec, **blocks)
    return out, lse, counts


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
@pytest.mark.parametrize("case", ["causal, row strips", "split keys, sinks", "(B, S, H, D) views"])
def test_the_same_bits_with_any_budget_and_from_copies(monkeypatch, case):
    """Each tile_tasks call returns after BUDGET scores (so that an interrupt is seen)
    and the next one goes on: with a budget of a thousand scores (about a call per
    task) the same bits; and the same from C-ordered copies of q, k and v as from views
    of them."""
    (q, k, v), kw = CASES[case]()
    spec = validate(q, k, v, **kw)
    out, lse, n = _forward(monkeypatch, spec, True)
    monkeypatch.setattr(forward, "BUDGET", 1000)
    with flash.threads(1):                               # calls one after another
        few_out, few_lse, claimed = _claims(monkeypatch, spec, True)
    n_tasks = len(_table(spec)[0])
    assert len({c for c in claimed if c <= n_tasks}) > 1  # calls that stopped part way through the table
    monkeypatch.setattr(plan, "_flat", lambda x: None)
    copy_out, copy_lse, _ = _forward(monkeypatch, spec, True)
    for o, s_ in ((few_out, few_lse), (copy_out, copy_lse)):
        assert np.array_equal(out, o) and np.array_equal(lse, s_)


def _table(spec):
    call = plan.Call(spec, None, None)
    blocks = [(u, r0, r1) for u in call.units for r0, r1 in call.row_blocks(u)]
    tasks = []
    for i, (u, r0, r1) in enumerate(blocks):
        lo, hi = plan.geo.key_range(u.seg, call.band, r0, r1)
        parts = call.splits(len(blocks), hi - lo)
        tasks += [(i, j, parts, lo + (hi - lo) * j // parts, lo + (hi - lo) * (j + 1) // parts) for j in range(parts)]
    return call.task_table(blocks, tasks)


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
    product keeps rows that cannot see the key finite; head 0 keeps the loop's."""
    q, k, v = make_qkv((1, 2, 400, 32), (1, 2, 400, 32), dtype="float32", seed=1)
    v[0, 1, 150, 3] = bad
    spec = validate(q, k, v, causal=True)
    out, lse, n = _forward(monkeypatch, spec, True)
    want_out, want_lse, _ = _forward(monkeypatch, spec, False)
    assert n > 0
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
    q, k, v = make_qkv((1, 1, 100, 24), (1, 1, 64, 24), dtype="float32", seed=4)
    tiles = np.array([[0, 50, 0, 40, 0], [0, 50, 40, 64, 0], [50, 100, 16, 40, 0], [50, 100, 40, 48, 0]])
    none, empty = np.zeros(0, dtype=np.int64), np.zeros((0, 0, 0), dtype=np.float32)
    m, l_i, acc = np.zeros(100, dtype=np.float32), np.zeros(100, dtype=np.float32), np.zeros((100, 24), np.float32)
    table = np.array([[0] * 6 + [1, 1, 0, 100, 0, 4, -1, 0, 0]])      # one task, its state kept at row 0
    status = np.zeros(1, dtype=np.int8)
    from attnkit.flash import numba_loop
    for x in (q, k, v):
        x.flags.writeable = False
    assert not numba_loop.tile_tasks(blas.sgemm(), blas.somatcopy(), q, np.float32(0.2), k, v, table, tiles, none,
                                     none, small, np.zeros(1, dtype=np.int64), status, empty, empty,
                                     np.zeros((1, 1, 100, 24), np.float32), False, np.zeros((1, 1, 100), np.float32),
                                     m, l_i, acc, 1 << 20)
    assert status[0] == 1
    out, lse = np.zeros((1, 1, 100, 24), np.float32), np.zeros((1, 1, 100), np.float32)
    table[0, 13] = -1                                    # the same task, finished into out and lse
    numba_loop.tile_tasks(blas.sgemm(), blas.somatcopy(), q, np.float32(0.2), k, v, table, tiles, none, none, small,
                          np.zeros(1, dtype=np.int64), status, empty, empty, out, False, lse, m, l_i, acc, 1 << 20)
    assert np.array_equal(out[0, 0], acc / l_i[:, None])   # exact division (no reciprocal)
    assert np.allclose(lse[0, 0], m + np.log(l_i), rtol=1e-6)
    for rows, keys in ((slice(0, 50), slice(0, 64)), (slice(50, 100), slice(16, 48))):
        s = 0.2 * q[0, 0, rows].astype(np.float64) @ k[0, 0, keys].T
        want_m = s.max(1)
        p = np.exp(s - want_m[:, None])
        assert np.allclose(m[rows], want_m, rtol=1e-5)
        assert np.allclose(l_i[rows], p.sum(1), rtol=1e-5)
        assert np.allclose(acc[rows], p @ v[0, 0, keys], rtol=1e-4, atol=1e-5)


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
    q, k, v = make_qkv((2, 100, 16), (2, 100, 16), dtype="float32")
    assert _forward(monkeypatch, validate(q, k, v, causal=True), True)[2] > 0


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


def test_a_somatcopy_that_transposes_wrongly_is_not_used():
    """The transposed copy is checked on one small array before use: a function that
    copies without transposing, or writes past the rows it was given, is refused."""
    def plain(order, trans, rows, cols, alpha, a, lda, b, ldb):        # copies, does not transpose
        src = np.ctypeslib.as_array((ctypes.c_float * (rows * lda)).from_address(a))
        dst = np.ctypeslib.as_array((ctypes.c_float * (cols * ldb)).from_address(b))
        dst[:rows * cols] = src[:rows * cols]

    def spills(order, trans, rows, cols, alpha, a, lda, b, ldb):       # right, and fills the padding too
        src = np.ctypeslib.as_array((ctypes.c_float * (rows * lda)).from_address(a)).reshape(rows, lda)
        dst = np.ctypeslib.as_array((ctypes.c_float * (cols * ldb)).from_address(b)).reshape(cols, ldb)
        dst[...] = 0.0
        dst[:, :rows] = src[:, :cols].T

    assert not blas._check_somatcopy(plain) and not blas._check_somatcopy(spills)
    if blas.somatcopy() is not None:
        assert blas._check_somatcopy(blas.somatcopy())


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
    from attnkit.flash import numba_loop
    assert numba_loop.kernels() is None
    monkeypatch.setattr(blas, "_found", {})
    monkeypatch.setattr(blas, "_numpy_library", lambda: object())
    assert blas.sgemm() is None and blas.somatcopy() is None and blas.small_product_limit() == 0


@pytest.mark.parametrize("layout", ["C order", "(B, L, H, D)", "float16", "shared keys"])
def test_the_loops_operands_are_views_where_they_can_be(layout):
    """q, k, v as the compiled loop reads them: read-only (N, heads, rows, D) views of
    the caller's arrays over their own batch dims (keys shared by the batch stay one
    sequence), float32 copies made once per call where they need converting."""
    q, k, v = make_qkv((2, 8, 50, 16), (1 if layout == "shared keys" else 2, 2, 50, 16),
                       dtype="float16" if layout == "float16" else "float32")
    if layout == "(B, L, H, D)":
        q = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    call = plan.Call(validate(q, k, v), None, None)
    assert call.flat is not None
    for (x4, own), x in zip(call.flat, (q, k, v)):
        assert x4.shape == (x.shape[0],) + x.shape[1:] and own == x.shape[:1] and not x4.flags.writeable
        assert np.shares_memory(x4, x) == (layout != "float16") and np.array_equal(x4, x.astype(np.float32))
    rows = call.task_table([(u, 0, 50) for u in call.units], [(i, 0, 1, 0, 50) for i in range(len(call.units))])[0]
    assert rows[:, 0].tolist() == [u.n for u in call.units] == rows[:, 1].tolist()
    assert rows[:, 2].tolist() == ([0] * len(call.units) if layout == "shared keys" else rows[:, 0].tolist())


def test_a_loop_that_fails_its_check_is_not_used(monkeypatch):
    """Where numba cannot call BLAS through a pointer, or the loop computes something
    else, the probe says so and the kernels keep the Python loop."""
    def wrong(q4, qscale, k4, v4, table, tiles, lo, hi, counter, status, m0, l0, out4, lse3, sm, sl, sacc, budget):
        status[:], out4[...], lse3[...], sm[:], sl[:], sacc[...] = 1, 2.0, 3.0, 2.0, 1.0, 2.0   # a wrong lse

    def skips(q4, qscale, k4, v4, table, tiles, lo, hi, counter, status, m0, l0, out4, lse3, sm, sl, sacc, budget):
        status[:1], out4[...], lse3[...] = 1, 2.0, 2.0   # the first task only

    def refuses(*a):
        raise TypeError("no pointer calls here")

    if LOOP:
        assert kernels._loop_works(kernels.compiled_kernels().tile_tasks)
    assert not kernels._loop_works(wrong) and not kernels._loop_works(refuses) and not kernels._loop_works(skips)
    from types import SimpleNamespace

    from attnkit.flash import numba_loop
    for broken in (lambda: refuses, refuses):            # a loop that fails its check; one that fails to build
        monkeypatch.setattr(numba_loop, "kernels", broken)
        fake = SimpleNamespace(WIDE_ATTRIBUTES=(), rescale_add=lambda *a: None,
                               KERNELS=SimpleNamespace(tile_tasks=None))
        assert kernels._probed(fake).tile_tasks is None


def test_task_tables_are_kept_by_geometry():
    """A model's layers repeat their geometry: the second call's task table is the
    first's (no planning); other lengths (other tasks) and sinks get their own."""
    q, k, v = make_qkv((2, 4, 90, 16), (2, 4, 90, 16), dtype="float32")

    def table(lengths, **kw):
        call = plan.Call(validate(q, k, v, causal=True, kv_lengths=np.array(lengths), **kw), None, None)
        blocks = [(u, r0, r1) for u in call.units for r0, r1 in call.row_blocks(u)]
        tasks = [(i, 0, 1, *plan.geo.key_range(u.seg, call.band, r0, r1)) for i, (u, r0, r1) in enumerate(blocks)]
        return call.task_table(blocks, tasks)

    first = table([90, 60])
    assert table([90, 60])[0] is first[0]
    other = table([90, 30])
    assert other[0] is not first[0] and not np.array_equal(other[1], first[1])
    sinks = table([90, 60], sinks=np.zeros(4))               # the same tasks, started by their sinks
    assert (sinks[0][:, 14] == 1).all() and (first[0][:, 14] == 0).all()


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
@pytest.mark.parametrize("case", ["causal, row strips", "split keys, sinks", "(B, S, H, D) views", "packed",
                                  "GQA causal, each head in strips", "keys with fewer batch dims"])
def test_one_native_pass_on_torchs_team_gives_the_passes_bits(monkeypatch, case):
    """With torch's libgomp team, a call runs in one pass of the loop's C entry on every
    thread (runtime.run_native): the bits of passes of BUDGET scores entered through
    ctypes, on two threads and on one; a call over NATIVE_WORK scores takes the passes."""
    pytest.importorskip("torch")
    if runtime.blas_controller() is None or runtime._omp_team(2) is None:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here (or no threadpoolctl)")
    (q, k, v), kw = CASES[case]()
    spec = validate(q, k, v, **kw)
    budget = forward.BUDGET
    monkeypatch.setattr(forward, "BUDGET", 1000)         # the one pass must not stop at it
    real, native = runtime.run_native, []
    monkeypatch.setattr(runtime, "run_native", lambda *a, **kw: real(*a, **kw) and (native.append(a[2]) or True))
    with flash.threads(2):
        out, lse, _ = flash.rung_forward(spec)
    assert native == [2]
    monkeypatch.setattr(forward, "NATIVE_WORK", 0)
    with flash.threads(2):
        big = flash.rung_forward(spec)
    assert native == [2]
    monkeypatch.undo()
    assert forward.BUDGET == budget
    for n in (2, 1):
        with flash.threads(n):
            got = _claims(monkeypatch, spec, True)
        assert got[2] and np.array_equal(got[0], out) and np.array_equal(got[1], lse)
    assert np.array_equal(big[0], out) and np.array_equal(big[1], lse)


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
def test_blas_is_held_to_one_thread_only_where_a_product_may_use_more(monkeypatch):
    """OpenBLAS makes a product of at most its small-product limit on the calling thread,
    but hands one with a single column to gemv (threaded from 460 800 multiply-adds):
    the loop's products are cut to the limit where that leaves MIN_CHUNK rows for the
    widest tile. A call whose products all stay on their thread takes no hold (its
    enter and exit cost 90 µs inside a model); the same call with whole tiles does."""
    def tiles(*widths):
        return np.array([[0, 64, 0, w, 0] for w in widths], dtype=np.int64)

    monkeypatch.setattr(blas, "small_product_limit", lambda: 10**6)
    one_thread = numba_loop.Tasks.one_thread
    assert one_thread(tiles(256, 64), 32, 32) and one_thread(tiles(960), 64, 32)   # 16 · 960 · 64 ≤ 10⁶
    assert not one_thread(tiles(2048), 32, 32)                # 16 rows of 2048 keys: over the limit
    assert not one_thread(tiles(1024), 32, 128)               # the widest of D and Dv counts
    assert not one_thread(tiles(256, 1), 32, 32)              # one key: gemv
    assert not one_thread(tiles(256), 32, 1)                  # Dv = 1: gemv
    monkeypatch.setattr(blas, "small_product_limit", lambda: 0)
    assert not one_thread(tiles(64), 32, 32)                  # no small kernels known: whole tiles

    holds = []
    real = runtime.blas_single_threaded
    monkeypatch.setattr(runtime, "blas_single_threaded", lambda: holds.append(1) or real())
    q, k, v = make_qkv((4, 8, 256, 32), (4, 8, 256, 32), dtype="float32", seed=2)
    spec = validate(q, k, v, kv_lengths=np.array([256, 200, 256, 256]))
    with flash.threads(2):
        whole = flash.rung_forward(spec)
        assert len(holds) == 1
        monkeypatch.setattr(blas, "small_product_limit", lambda: 10**6)
        chunked = flash.rung_forward(spec)
    assert len(holds) == 1
    np.testing.assert_allclose(chunked[0], whole[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not LOOP, reason="NumPy's sgemm was not found")
def test_on_torchs_team_and_in_a_kept_call_blas_is_held_only_where_a_product_may_use_more(monkeypatch):
    """As above for the one native pass on torch's team (runtime.run_native) and for the
    flash rung's kept call (flash.direct), which decides once for its plan."""
    pytest.importorskip("torch")
    if runtime.blas_controller() is None or runtime._omp_team(2) is None:
        pytest.skip("torch's OpenMP runtime is not GNU libgomp here (or no threadpoolctl)")
    holds, native = [], []
    real, real_native = runtime.blas_single_threaded, runtime.run_native
    monkeypatch.setattr(runtime, "blas_single_threaded", lambda: holds.append(1) or real())
    monkeypatch.setattr(runtime, "run_native", lambda *a, **kw: native.append(kw) or real_native(*a, **kw))
    q, k, v = make_qkv((4, 8, 256, 32), (4, 8, 256, 32), dtype="float32", seed=2)
    spec = validate(q, k, v, kv_lengths=np.array([256, 200, 256, 256]))
    for small, held in ((10**6, 0), (0, 1)):
        monkeypatch.setattr(blas, "small_product_limit", lambda: small)
        with flash.threads(2):
            out, lse, _ = flash.rung_forward(spec)
            kept = flash.direct(spec)
            assert kept is not None and len(holds) == held
            again = kept(q, k, v, True)
        assert len(native) == 2 * (1 + held) and len(holds) == 2 * held
        assert np.array_equal(again[0], out) and np.array_equal(again[1], lse)


def test_the_packed_block_holds_each_argument_where_the_entry_reads_it():
    """pack writes each array's address, shape, strides and extent at the slot that
    team_tasks reads (a slot off by one would read another array's numbers)."""
    f = np.float32
    q = np.zeros((2, 5, 3, 4), f).transpose(0, 2, 1, 3)        # heads inner: strides (60, 4, 12, 1)
    arrays = dict(k=np.zeros((1, 3, 6, 4), f), v=np.zeros((1, 3, 6, 2), f), out=np.zeros((2, 3, 5, 2), f),
                  lse=np.zeros((2, 3, 5), f), m0=np.zeros((2, 3, 5), f), l0=np.ones((2, 3, 5), f),
                  table=np.zeros((7, 15), np.int64), tiles=np.zeros((9, 5), np.int64), lo=np.zeros(11, np.int64),
                  hi=np.zeros(12, np.int64), counter=np.zeros(1, np.int64), status=np.zeros(7, np.int8),
                  sm=np.zeros(13, f), sl=np.zeros(14, f), sacc=np.zeros((13, 2), f))
    a = arrays
    block = np.zeros(numba_loop.SLOTS, np.int64)
    numba_loop.pack(block, 11, 22, q, 0.25, a["k"], a["v"], a["table"], a["tiles"], a["lo"], a["hi"], 77, a["counter"],
                    a["status"], a["m0"], a["l0"], a["out"], True, a["lse"], a["sm"], a["sl"], a["sacc"], 99)
    assert (block[0], block[1]) == (11, 22)
    for name, x in dict(q=q, **arrays).items():
        at = getattr(numba_loop, f"AT_{name.upper()}")
        n = x.ndim
        assert block[at] == x.ctypes.data, name
        assert tuple(block[at + 1:at + 1 + n]) == x.shape, name
        assert tuple(block[at + 1 + n:at + 1 + 2 * n]) == tuple(s // x.itemsize for s in x.strides), name
    assert block[numba_loop.AT_Q + 9] == 1 + sum((d - 1) * s // 4 for d, s in zip(q.shape, q.strides))
    assert (block[numba_loop.AT_SMALL], block[numba_loop.AT_INNER], block[numba_loop.AT_BUDGET]) == (77, 1, 99)
    assert block[numba_loop.AT_QSCALE] == np.float32(0.25).view(np.int32)
