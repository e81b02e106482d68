"""The backward's compiled tasks (numba_backward.backward_tasks: each unit's chunk of
key blocks in one compiled call per thread, the scores key-major so that all five
products take untransposed operands, by NumPy's own sgemm) against the float64
reference and the Python loop (np.matmul and the compiled tile kernels)."""

import numpy as np
import pytest

from attnkit import flash, reference
from attnkit.flash import blas, kernels
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error
from cases import SGEMM_PEAKED_BACKWARD

from .test_loop import CASES

COMPILED = kernels.compiled_kernels()
LOOP = COMPILED is not None and COMPILED.backward_tasks is not None
pytestmark = pytest.mark.skipif(not LOOP, reason="numba or NumPy's sgemm is missing: the backward stays in Python")


def _grads(monkeypatch, spec, dout, out, lse, loop, dlse=None, **blocks):
    """(dq, dk, dv, the compiled tasks' statuses: one array per call of the rung, 1
    where the compiled task finished)."""
    monkeypatch.setattr(kernels, "USE_LOOP", loop)
    seen: dict[int, np.ndarray] = {}
    real = COMPILED.backward_tasks

    def spy(*a):
        seen[id(a[13])] = a[13]                          # every thread of a call gets the same array
        real(*a)
    monkeypatch.setattr(COMPILED, "backward_tasks", spy)
    g = flash.rung_backward(spec, dout, out, lse, dlse, **blocks)
    return g.dq, g.dk, g.dv, list(seen.values())


def _case(case):
    (q, k, v), kw = CASES[case]()
    spec = validate(q, k, v, **kw)
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(3).standard_normal(out.shape).astype(np.float32)
    return (q, k, v), kw, spec, dout, out, lse


def _one_wide():                                          # D = Dv = 1: every leading dim at its least
    q, k, v = make_qkv((2, 4, 70, 1), (2, 2, 90, 1), dtype="float32", seed=3)
    return (q, k, v), dict(causal=True)


def _two_keys_heads_inner():                             # (B, S, H, D) views with S = 2: rows far apart
    q, k, v = (x.transpose(0, 2, 1, 3) for x in make_qkv((2, 50, 4, 32), (2, 2, 4, 32), dtype="float32", seed=8))
    return (q, k, v), dict(causal=True)


def _one_query_row():                                    # a unit of one row (a decoding step's gradient)
    q, k, v = make_qkv((2, 4, 1, 32), (2, 4, 50, 32), dtype="float32", seed=9)
    return (q, k, v), dict(causal=True)


def _empty_sequences():                                  # a sequence without queries, one without keys
    q, k, v = make_qkv((3, 2, 200, 32), (3, 2, 260, 32), dtype="float32", seed=2)
    return (q, k, v), dict(causal=True, q_lengths=np.array([0, 60, 200]), kv_lengths=np.array([50, 0, 260]))


CASES = dict(CASES, **{"empty sequences": _empty_sequences, "heads one wide": _one_wide,
                       "(B, S, H, D) views, two keys": _two_keys_heads_inner, "one query row": _one_query_row})


@pytest.mark.parametrize("small", [0, 10**6, 3 * 10**5], ids=["whole tiles", "AVX-512 chunks", "odd chunks"])
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_backward_is_as_close_as_the_reference(monkeypatch, case, small):
    """Every case of the forward's loop (causal strips, GQA, lengths with an empty
    sequence, packed, (B, S, H, D) views, broadcast and unmergeable batch dims, sinks,
    many keys): dq, dk, dv as close to the float64 reference as the reference's own
    float32 is, every task compiled, and the Python loop by the same budget."""
    monkeypatch.setattr(blas, "small_product_limit", lambda: small)
    (q, k, v), kw, spec, dout, out, lse = _case(case)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True)
    *py, none = _grads(monkeypatch, spec, dout, out, lse, False)
    assert seen and all(s.all() for s in seen) and not none
    wide = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    o64, l64, _ = reference.rung_forward(wide)
    oracle = reference.rung_backward(wide, dout.astype(np.float64), o64, l64)
    same = reference.rung_backward(spec, dout, *reference.rung_forward(spec)[:2])
    for a, b, o, s in zip(got, py, oracle, same):
        budget = error_budget(o, s)
        assert max_error(a, o) <= budget and max_error(b, o) <= budget and max_error(a, b) <= budget


@SGEMM_PEAKED_BACKWARD
@pytest.mark.parametrize("D", [80, 128])
@pytest.mark.parametrize("small", [0, 10**6], ids=["whole tiles", "AVX-512 chunks"])
def test_compiled_backward_of_peaked_scores_is_as_close_as_the_reference(monkeypatch, small, D):
    """Scores of a few tens under a scale (1/√D) that is not a power of 2: exp(s − lse)
    is the saved softmax only where s has the forward's bits, scale · (q kᵀ) — not
    (q · scale) kᵀ, whose rounding moved every gradient 2–9× the reference's error."""
    monkeypatch.setattr(blas, "small_product_limit", lambda: small)
    q, k, v = make_qkv((1, 4, 96, D), (1, 4, 160, D), dtype="float32", seed=4)
    spec = validate(4 * q, 4 * k, v)
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(3).standard_normal(out.shape).astype(np.float32)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True)
    assert seen and all(s.all() for s in seen)
    wide = validate(*(x.astype(np.float64) for x in (4 * q, 4 * k, v)))
    o64, l64, _ = reference.rung_forward(wide)
    oracle = reference.rung_backward(wide, dout.astype(np.float64), o64, l64)
    same = reference.rung_backward(spec, dout, *reference.rung_forward(spec)[:2])
    for a, o, s in zip(got, oracle, same):
        assert max_error(a, o) <= error_budget(o, s)


def test_compiled_backward_reads_each_operand_at_its_own_batch_index(monkeypatch):
    """q and k shared by the batch (v not), dout broadcast over it (out not): each
    operand is read at its own batch index, and the gradients have the bits of
    expanded, C-ordered copies (δ is summed from C-ordered rows, whatever dout's
    layout)."""
    q, k, v = make_qkv((1, 3, 90, 16), (1, 3, 120, 16), dtype="float32", seed=7)
    v = np.random.default_rng(3).standard_normal((3, 3, 120, 16)).astype(np.float32)
    spec = validate(q, k, v, causal=True)
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(2).standard_normal((1, 3, 90, 16)).astype(np.float32)
    *got, seen = _grads(monkeypatch, spec, np.broadcast_to(dout, out.shape), out, lse, True)
    wq, wk = (np.ascontiguousarray(np.broadcast_to(x, (3,) + x.shape[1:])) for x in (q, k))
    *want, _ = _grads(monkeypatch, validate(wq, wk, v, causal=True), np.ascontiguousarray(
        np.broadcast_to(dout, out.shape)), out, lse, True)
    assert seen and seen[0].all()
    assert np.array_equal(got[0], want[0].sum(axis=0, keepdims=True))
    assert np.array_equal(got[1], want[1].sum(axis=0, keepdims=True)) and np.array_equal(got[2], want[2])


def test_compiled_backward_with_a_gradient_for_lse(monkeypatch):
    """dlse enters δ = rowsum(dout ∘ out) − dlse: the same gradients as the Python loop."""
    _, _, spec, dout, out, lse = _case("L != S, window, sinks")
    dlse = np.random.default_rng(4).standard_normal(lse.shape).astype(np.float32)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True, dlse)
    *want, _ = _grads(monkeypatch, spec, dout, out, lse, False, dlse)
    assert seen and seen[0].all()
    for a, b in zip(got, want):
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5)


def test_compiled_backward_same_bits_on_one_and_two_threads(monkeypatch):
    _, _, spec, dout, out, lse = _case("GQA causal, each head in strips")
    runs = []
    for n in (1, 2, 1):
        with flash.threads(n):
            runs.append(_grads(monkeypatch, spec, dout, out, lse, True, block_n=64)[:3])
    assert all(np.array_equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r))


@pytest.mark.parametrize("where", ["q", "k", "dout", "lse", "dlse"])
def test_a_nonfinite_operand_leaves_its_task_to_the_python_loop(monkeypatch, where):
    """A NaN in one head's operand: that task (alone) runs on the Python loop, whose
    exempt products keep keys the NaN row cannot see free of it; the other tasks stay
    compiled, and everything equals the Python loop's result. (A NaN in dlse is seen
    only when δ is: after the key block's first tile has written dk and dv.)"""
    q, k, v = make_qkv((1, 3, 200, 16), (1, 3, 200, 16), dtype="float32", seed=2)
    spec = validate(q, k, v, causal=True)
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    dlse = np.zeros_like(lse)
    x = {"q": q, "k": k, "dout": dout, "lse": lse, "dlse": dlse}[where]
    x[0, 1, 120, ...] = np.nan
    spec = validate(q, k, v, causal=True)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True, dlse, block_m=64, block_n=64)
    *want, _ = _grads(monkeypatch, spec, dout, out, lse, False, dlse, block_m=64, block_n=64)
    assert seen and 0 < seen[0].sum() < len(seen[0])
    for a, b in zip(got, want):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)
    assert np.isfinite(got[0][0, 1, :120]).all()         # rows before the NaN row: no NaN in dq


def test_a_nan_query_row_in_a_task_of_keys_it_cannot_see(monkeypatch):
    """Query row 10 holds a NaN that the saved out and lse do not carry; a task of keys
    16–31 (its own dq chunk) takes rows 0–31, of which row 10 sees none: its weights
    and ds there are 0, yet dk = dsᵀ q would meet the NaN (0 · NaN). The task must
    leave it to the Python loop: dk of keys 16–31 finite."""
    q, k, v = make_qkv((1, 1, 64, 8), (1, 1, 64, 8), dtype="float32", seed=4)
    out, lse, _ = flash.rung_forward(validate(q, k, v, causal=True))
    q[0, 0, 10, 3] = np.nan
    spec = validate(q, k, v, causal=True)
    dout = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True, block_m=32, block_n=16)
    *want, _ = _grads(monkeypatch, spec, dout, out, lse, False, block_m=32, block_n=16)
    assert seen and len(seen[0]) == 4                    # one task per key block of 16
    assert np.isfinite(got[1][0, 0, 11:]).all() and np.isnan(got[1][0, 0, :11]).any()
    for a, b in zip(got, want):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        assert np.allclose(a, b, rtol=1e-4, atol=1e-5, equal_nan=True)


def test_a_key_whose_every_score_is_minus_inf_is_excluded_not_nan(monkeypatch):
    """An infinite k entry against positive q entries: every score with that key is
    −inf, which excludes it (the NaN rule) and leaves lse finite. Its weight is 0, but
    dq = Σ ds k would still meet the inf (0 · inf): the compiled task must leave such a
    block to the Python loop's exempt products — gradients as finite as the reference's."""
    q, k, v = make_qkv((1, 2, 50, 8), (1, 2, 70, 8), dtype="float32", seed=1)
    q = np.abs(q) + np.float32(0.1)
    k[0, 1, 30, 2] = -np.inf
    spec = validate(q, k, v)
    out, lse, _ = flash.rung_forward(spec)
    assert np.isfinite(lse).all()
    dout = np.random.default_rng(0).standard_normal(out.shape).astype(np.float32)
    *got, seen = _grads(monkeypatch, spec, dout, out, lse, True)
    want = reference.rung_backward(spec, dout, out, lse)
    assert seen and not seen[0].all()
    for a, b in zip(got, want):
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(b)
        assert np.allclose(a[fin], b[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("H, Hkv, L, S, blocks", [(2, 2, 60, 200, {}), (4, 2, 60, 200, {}),
                                                  (8, 4, 100, 500, dict(block_n=512))],
                         ids=["two heads", "two GQA groups of two", "two tasks of two GQA groups"])
def test_a_task_that_overflows_part_way_starts_over_from_zero(monkeypatch, H, Hkv, L, S, blocks):
    """Finite operands whose dout vᵀ overflows in the last kv head's keys: the compiled
    task (two kv heads side by side) has already written its first kv head's dq rows
    (each query head's) when it sees the inf; it zeroes them — and nothing of the task
    before it — and the Python loop redoes it (nothing counted twice). One thread: the
    tasks in order."""
    q, k, v = make_qkv((1, H, L, 16), (1, Hkv, S, 16), dtype="float32", seed=5)
    spec = validate(q, k, v)
    out, lse, _ = flash.rung_forward(spec)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)
    v = v.copy()
    v[0, -1, 150] = 1e30                                 # dout · v ~ 1e40: inf in float32
    dout[0, -(H // Hkv):] *= 1e10
    spec = validate(q, k, v)
    with flash.threads(1):
        *got, seen = _grads(monkeypatch, spec, dout, out, lse, True, **blocks)
        *want, _ = _grads(monkeypatch, spec, dout, out, lse, False, **blocks)
    assert seen and not seen[0][-1] and seen[0][:-1].all()
    for a, b in zip(got, want):
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isinf(a), np.isinf(b))
        fin = np.isfinite(b)
        assert np.allclose(a[fin], b[fin], rtol=1e-5, atol=1e-6)
    assert np.isfinite(got[0][0, 0]).all()


@pytest.mark.parametrize("shapes, kw, blocks, want", [
    (((2, 4, 128, 32), (2, 4, 128, 32)), {}, {}, True),                    # a BERT-like batch
    (((1, 8, 300, 32), (1, 8, 300, 32)), dict(causal=True), {}, True),     # causal: every key seen
    (((1, 2, 300, 32), (1, 2, 300, 32)), dict(causal=True), {}, False),    # few units: key chunks of dq
    (((2, 4, 128, 32), (2, 4, 128, 32)), dict(kv_lengths=np.array([128, 100])), {}, False),   # padded keys
    (((2, 4, 128, 32), (2, 4, 128, 32)), dict(q_lengths=np.array([128, 100])), {}, False),    # padded rows
    (((2, 8, 64, 32), (2, 2, 64, 32)), {}, {}, False),                     # a GQA group stacked: one dk
    (((1, 1, 64, 32), (1, 1, 2048, 32)), {}, {}, False),                   # few units: key chunks of dq
    (((1, 8, 1024, 32), (1, 8, 1024, 32)), dict(causal=True, window=(100, 0)), dict(block_m=64, block_n=512),
     True),
    (((1, 8, 64, 32), (1, 8, 1024, 32)), dict(causal=True, window=(10, 0), align="top_left"),
     dict(block_n=128), False),                                           # key blocks no row sees
])
def test_the_tasks_cover_every_gradient_element_exactly_where_said(monkeypatch, shapes, kw, blocks, want):
    """Where the compiled tasks write every element of dq, dk and dv, the backward
    skips their zero fill (np.empty): the predicate against the tasks' own writes —
    every element written, or (not covered) some left to the zero fill."""
    from attnkit.flash import backward as bw
    from attnkit.flash.plan import Call
    q, k, v = make_qkv(*shapes, dtype="float32", seed=1)
    spec = validate(q, k, v, **kw)
    call = Call(spec, blocks.get("block_m"), blocks.get("block_n"), backward=True)
    BN = call.BLOCK_N
    kblocks = {id(u): [(c, min(c + BN, u.seg.k1)) for c in range(u.seg.k0, u.seg.k1, BN)] for u in call.units}
    n_chunks = max(1, min(max((len(b) for b in kblocks.values()), default=1), -(-8 // max(len(call.units), 1))))
    assert bw._covered(call, kblocks, n_chunks) == want
    out, lse, _ = flash.rung_forward(spec)
    real = np.empty
    filled = []

    def nan_empty(shape, dtype):                         # what np.empty may hold: NaN everywhere
        x = real(shape, dtype)
        if np.dtype(dtype).kind == "f":                  # (integer arrays, the rows' bounds: no NaN)
            x[...] = np.nan
            filled.append(x)
        return x
    monkeypatch.setattr(np, "empty", nan_empty)
    g = flash.rung_backward(spec, out, out, lse, **blocks)
    monkeypatch.undo()
    assert (len(filled) >= 3) == want
    assert all(np.isfinite(x).all() for x in g[:3])


def test_terms_inside_the_scores_keep_the_python_backward(monkeypatch):
    q, k, v = make_qkv((2, 100, 16), (2, 50, 16), dtype="float32")
    for kw in (dict(causal=True, softcap=5.0), dict(alibi_slopes=np.array([0.1, 0.2])), dict(dropout=0.2, seed=3),
               dict(bias=np.zeros((100, 50), np.float32))):
        spec = validate(q, k, v, **kw)
        out, lse, _ = flash.rung_forward(spec)
        assert _grads(monkeypatch, spec, out, out, lse, True)[3] == []
    spec = validate(q, k, v)
    out, lse, _ = flash.rung_forward(spec)
    assert _grads(monkeypatch, spec, out, out, lse, True)[3] != []
