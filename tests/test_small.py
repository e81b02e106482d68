"""The small rung against the reference: every term it takes, low precision by the
2× rule, the NaN rule, padding rows with sinks, and what it leaves to other rungs."""

import numpy as np
import pytest

import attnkit
from attnkit import backends, flash, reference, small
from attnkit.flash import kernels
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error
from cases import random_case


@pytest.mark.parametrize("seed", range(64))
def test_float64_matches_reference(seed):
    q, k, v, kw, _ = random_case(seed, extras=True)
    spec = validate(q, k, v, **kw)
    assert not small.not_supported_reasons(spec)
    o1, l1, w1 = small.rung_forward(spec, True)
    o0, l0, w0 = reference.rung_forward(spec, True)
    assert o1.dtype == l1.dtype == np.float64 and o1.shape == o0.shape and l1.shape == l0.shape
    assert max_error(o1, o0) <= 1e-12
    assert max_error(l1, l0) <= 1e-12
    assert max_error(w1, w0) <= 1e-12


@pytest.mark.parametrize("compiled", [True, False], ids=["numba", "numpy"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("seed", range(0, 64, 4))
def test_low_precision_within_twice_the_reference_error(seed, dtype, compiled, monkeypatch):
    monkeypatch.setattr(kernels, "USE_COMPILED", compiled)
    q, k, v, kw, _ = random_case(seed, dtype, extras=True)
    spec = validate(q, k, v, **kw)
    oracle = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    oo, lo, _ = reference.rung_forward(oracle)
    assert o1.dtype == dtype and l1.dtype == np.float32
    assert max_error(o1, oo) <= error_budget(oo, o0)
    assert max_error(l1, lo) <= error_budget(lo, l0)


def _nan_rows(x):
    return np.isnan(x).reshape(x.shape[0], -1).any(axis=1)


@pytest.mark.parametrize("where", ["k_excluded", "k_visible", "v_excluded", "v_visible", "v_inf_visible"])
def test_the_nan_rule(where):
    """A NaN or inf reaches only the rows that see it: a key or value past the causal
    band or a kv_length is exempt, a visible one makes its rows NaN."""
    q, k, v = make_qkv((2, 2, 6, 4), (2, 1, 6, 4), seed=3)
    kw = dict(causal=True, kv_lengths=np.array([6, 4]))
    arr, bad = (k if where[0] == "k" else v), (np.inf if "inf" in where else np.nan)
    if where.endswith("excluded"):
        arr[1, 0, 5] = bad                               # past sequence 1's length
    else:
        arr[0, 0, 3] = bad                               # rows 3.. of sequence 0 see key 3
    spec = validate(q, k, v, **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    assert np.array_equal(np.isnan(o1), np.isnan(o0)) and np.array_equal(np.isnan(l1), np.isnan(l0))
    fine = ~np.isnan(o0)
    assert np.abs(o1 - o0)[fine].max() <= 1e-12
    if where.endswith("excluded"):
        assert not np.isnan(o1).any()
    else:
        assert np.isnan(o1[0, :, 3:]).all() and not np.isnan(o1[0, :, :3]).any() and not np.isnan(o1[1]).any()


def test_row_bounds_kept_per_geometry_never_serve_another():
    """The small rung keeps each geometry's row bounds: calls of one shape in a row with
    other bands, alignments or key counts each get their own, the second round from
    the kept ones."""
    q, k, v = make_qkv((2, 4, 6, 8), (2, 2, 9, 8), seed=5)
    short = [x[..., :7, :] for x in (k, v)]                # the same rows, fewer keys
    calls = [(k, v, dict(causal=True)), (k, v, dict(causal=True, align="top_left")),
             (k, v, dict(window=(2, 1))), (k, v, dict(window=(2, 1), causal=True)),
             (k, v, dict(causal=True, window=(3, None))), (*short, dict(causal=True))]
    calls += [(k, v, dict(causal=True, **{name: np.array(n)})) for name, n in
              (("q_lengths", [6, 3]), ("q_lengths", [2, 6]), ("kv_lengths", [9, 4]), ("kv_lengths", [5, 9]))]
    for _ in range(2):
        for kk, vv, kw in calls:
            spec = validate(q, kk, vv, **kw)
            o1, l1, _ = small.rung_forward(spec)
            o0, l0, _ = reference.rung_forward(spec)
            assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12, kw


def test_row_bounds_are_kept_and_the_store_stays_bounded(monkeypatch):
    """A geometry's second call reads the kept arrays; more geometries than the store
    holds start it again (it never grows past 64)."""
    monkeypatch.setattr(small, "_BOUNDS", {})
    q, k, v = make_qkv((2, 2, 5, 4), (2, 2, 7, 4), seed=1)
    first = small._row_bounds(validate(q, k, v, causal=True))
    assert small._row_bounds(validate(q, k, v, causal=True))[0] is first[0]
    other = small._row_bounds(validate(q, k, v, window=(1, 1)))   # a second geometry keeps the first
    assert small._row_bounds(validate(q, k, v, causal=True))[0] is first[0]
    assert small._row_bounds(validate(q, k, v, window=(1, 1)))[0] is other[0]
    for n in range(1, 70):
        small._row_bounds(validate(q, k, v, window=(n, 0)))
        assert len(small._BOUNDS) <= 64


def test_padding_rows_and_fully_masked_rows():
    """Padding rows (i >= q_lengths) give out 0 and lse −inf even with a sink; a row with
    no visible key gives out 0 and lse = its sink (or −inf without one)."""
    q, k, v = make_qkv((3, 2, 5, 4), (3, 2, 4, 4), seed=5)
    kw = dict(q_lengths=np.array([5, 2, 0]), kv_lengths=np.array([4, 0, 3]), sinks=np.array([0.5, -1.0]))
    spec = validate(q, k, v, **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12
    assert np.isneginf(l1[1, :, 2:]).all() and np.isneginf(l1[2]).all() and not o1[1:].any()
    assert np.array_equal(l1[1, :, :2], np.broadcast_to([[0.5], [-1.0]], (2, 2)))   # no key: the sink alone
    spec = validate(q, k, v, keep=np.zeros((5, 4), bool))
    o1, l1, _ = small.rung_forward(spec)
    assert not o1.any() and np.isneginf(l1).all()


def test_gqa_groups_and_broadcast_batches():
    """Query head h reads kv head h // group; q's batch dims broadcast against k's."""
    q, k, v = make_qkv((2, 3, 6, 3, 8), (1, 3, 2, 7, 8), seed=7)
    for kw in ({}, dict(causal=True), dict(window=(2, 1), align="top_left"), dict(softcap=1.5)):
        spec = validate(q, k, v, **kw)
        o1, l1, _ = small.rung_forward(spec)
        o0, l0, _ = reference.rung_forward(spec)
        assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12


def test_every_storage_order_and_a_broadcast_batch():
    """Scores of any operands' memory order (q's batch broadcast, stride 0; k stored
    heads-major or Fortran-ordered...) are taken through NumPy's product, whose result
    then need not be C-ordered: the softcap and the softmax act on it in place."""
    from itertools import permutations
    rng = np.random.default_rng(0)
    shapes = {"q": (2, 4, 3, 5), "k": (2, 2, 6, 5), "v": (2, 2, 6, 3)}
    base = {n: rng.standard_normal(s) for n, s in shapes.items()}

    def stored(x, order):                                # x's values in memory order `order`
        return np.ascontiguousarray(x.transpose(order)).transpose(np.argsort(order))
    kw = dict(causal=True, softcap=1.5)
    want = reference.rung_forward(validate(base["q"], base["k"], base["v"], **kw))[0]
    cases = [(stored(base["q"], a), stored(base["k"], b), base["v"]) for a in permutations(range(4))
             for b in permutations(range(4))]
    cases += [(base["q"], base["k"], stored(base["v"], c)) for c in permutations(range(4))]
    one = base["q"][:1]
    cases.append((np.broadcast_to(one, shapes["q"]), stored(base["k"], (1, 0, 2, 3)), base["v"]))
    for q, k, v in cases:
        ref = want if q.strides[0] else reference.rung_forward(validate(q, k, v, **kw))[0]
        assert max_error(small.rung_forward(validate(q, k, v, **kw))[0], ref) <= 1e-12


@pytest.mark.parametrize("kw", [dict(), dict(causal=True, kv_lengths=np.array([5, 2])),
                                dict(sinks=np.array([0.3, -0.2]), window=(1, 2))])
def test_dropout_draws_what_the_reference_draws(kw):
    q, k, v = make_qkv((2, 2, 5, 4), (2, 2, 6, 4), seed=8)
    spec = validate(q, k, v, dropout=0.4, seed=2 ** 63 + 5, **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12
    assert max_error(o1, small.rung_forward(spec.replace(seed=6))[0]) > 1e-3      # the seed matters


def test_what_it_leaves_to_other_rungs():
    q, k, v = make_qkv((2, 5, 4), (2, 5, 4), seed=1)
    packed = dict(cu_seqlens_q=np.array([0, 2, 5]), cu_seqlens_k=np.array([0, 3, 5]))
    assert small.not_supported_reasons(validate(q, k, v, **packed))
    assert small.not_supported_reasons(validate(q, k, v).replace(extent=(9, 9)))
    assert backends.select(validate(q, k, v)) is small
    assert backends.select(validate(q, k, v, **packed)) is flash
    with pytest.raises(ValueError, match="small: no packed sequences"):
        attnkit.attention(q, k, v, backend="small", **packed)


def test_backward_is_flashs_and_weights_the_references():
    q, k, v = make_qkv((2, 5, 4), (2, 7, 4), seed=2)
    spec = validate(q, k, v, causal=True)
    out, lse, _ = small.rung_forward(spec)
    dout = np.ones_like(out)
    for a, b in zip(small.rung_backward(spec, dout, out, lse), flash.rung_backward(spec, dout, out, lse)):
        assert (a is None and b is None) or np.array_equal(a, b)
    assert np.array_equal(small.rung_weights(spec, lse, [1, 3]), reference.rung_weights(spec, lse, [1, 3]))


def test_torch_calls_reach_it_with_and_without_the_op():
    """A tiny torch call runs the small rung: directly when nothing needs a gradient,
    through the custom op otherwise — the same bits either way, and gradients."""
    torch = pytest.importorskip("torch")
    from attnkit.torch import op
    q, k, v = (torch.from_numpy(x).float() for x in make_qkv((2, 4, 3, 8), (2, 2, 5, 8), seed=4))
    spec = validate(q, k, v, causal=True)
    assert backends.select(spec) is op.bound(small)
    assert op._eager(spec)
    with torch.no_grad():
        plain, lse = attnkit.attention(q, k, v, causal=True, return_lse=True)
    q.requires_grad_(True)
    assert not op._eager(validate(q, k, v, causal=True))
    out, lse2 = attnkit.attention(q, k, v, causal=True, return_lse=True)
    assert torch.equal(out.detach(), plain) and torch.equal(lse2.detach(), lse)
    out.sum().backward()
    ref = q.detach().double().requires_grad_(True)
    attnkit.attention(ref, k.double(), v.double(), causal=True, backend="reference").sum().backward()
    assert max_error(q.grad, ref.grad) <= 1e-5


def test_a_dispatch_mode_and_autograd_see_the_op():
    """Only an unwatched forward with nothing to differentiate skips the custom op: a
    dispatch mode sees it (and gets the same result), as does a forward whose input
    requires a gradient."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.from_numpy(x).float() for x in make_qkv((2, 3, 4), (2, 5, 4), seed=6))
    with torch.no_grad():
        plain = attnkit.attention(q, k, v)
        with Spy():
            watched = attnkit.attention(q, k, v)
    assert "attnkit.attention_fwd.default" in seen and torch.equal(plain, watched)
    seen.clear()
    with Spy():
        attnkit.attention(q, k, v)                       # grad mode on, nothing requires grad
        assert "attnkit.attention_fwd.default" in seen


def test_a_minus_inf_sink_is_no_sink():
    """A sink of −inf (a head whose sink is switched off) adds nothing: its rows equal the
    call without sinks and the reference, never NaN — the row's running max starts at
    −inf and its sum at 0, not at exp(−inf − (−inf)) = NaN."""
    q, k, v = make_qkv((2, 3, 5, 4), (2, 3, 6, 4), seed=11)
    sinks = np.array([-np.inf, 0.7, -np.inf])
    for kw in ({}, dict(causal=True, kv_lengths=np.array([6, 3]))):
        spec = validate(q, k, v, sinks=sinks, **kw)
        o1, l1, _ = small.rung_forward(spec)
        o0, l0, _ = reference.rung_forward(spec)
        assert max_error(o1, o0) <= 1e-12 and max_error(l1, l0) <= 1e-12
        plain, lp, _ = small.rung_forward(validate(q, k, v, **kw))
        assert max_error(o1[:, [0, 2]], plain[:, [0, 2]]) <= 1e-12
        assert max_error(l1[:, [0, 2]], lp[:, [0, 2]]) <= 1e-12


def test_attention_backward_gives_dbias_and_dsinks_on_the_small_rung():
    """attention_backward of a small call (auto runs the small rung) returns dbias and
    dsinks, reduced to the shapes of bias and sinks, as the reference does: a rung whose
    backward skipped dbias unless asked would hand api a None for it."""
    q, k, v = make_qkv((2, 2, 5, 4), (2, 2, 7, 4), seed=12)
    rng = np.random.default_rng(12)
    kw = dict(bias=rng.standard_normal((2, 1, 5, 7)), sinks=np.array([0.2, -0.4]), causal=True)
    assert backends.select(validate(q, k, v, **kw)) is small
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    dout = rng.standard_normal(out.shape)
    got = attnkit.attention_backward(dout, q, k, v, out, lse, **kw)
    want = attnkit.attention_backward(dout, q, k, v, out, lse, backend="reference", **kw)
    assert len(got) == len(want) == 5
    assert got[3].shape == (2, 1, 5, 7) and got[4].shape == (2,)
    for a, b in zip(got, want):
        assert max_error(a, b) <= 1e-12


def _decoding_case(seed):
    """A float32 call of few query rows per kv head (the compiled path), with the terms
    that path takes drawn at random: GQA, broadcast batch dims, causal and window in
    both alignments, lengths, softcap, sinks, a heads-inner q."""
    rng = np.random.default_rng(seed)
    L, Hkv, group = int(rng.choice([1, 2, 4])), int(rng.choice([1, 2])), int(rng.choice([1, 2, 4]))
    S, D = int(rng.choice([1, 5, 45, 130])), int(rng.choice([8, 32, 59, 72]))
    Dv = int(rng.choice([D, 12, 67]))
    batch = [(), (3,), (2, 3)][rng.integers(3)]
    batch_k = batch if rng.random() < 0.5 else tuple(1 if rng.random() < 0.6 else n for n in batch)
    q, k, v = make_qkv(batch + (Hkv * group, L, D), batch_k + (Hkv, S, D), Dv, seed=seed)
    if rng.random() < 0.3:
        q = np.swapaxes(np.ascontiguousarray(np.swapaxes(q, -2, -3)), -2, -3)
    kw = {}
    if rng.random() < 0.5:
        kw["causal"] = True
    if rng.random() < 0.3:
        kw["window"] = (int(rng.integers(0, 9)), int(rng.integers(0, 3)) if rng.random() < 0.5 else None)
    if kw and rng.random() < 0.4:
        kw["align"] = "top_left"
    if rng.random() < 0.3:
        kw["softcap"] = float(rng.uniform(0.5, 5))
    if rng.random() < 0.4:
        kw["sinks"] = rng.standard_normal([(Hkv * group,), batch + (Hkv * group, L)][rng.integers(2)])
    if batch and rng.random() < 0.5:
        kw["kv_lengths"] = rng.integers(0, S + 1, batch)
        if rng.random() < 0.5:
            kw["q_lengths"] = rng.integers(0, L + 1, batch)
    return [x.astype(np.float32) for x in (q, k, v)], kw


@pytest.mark.parametrize("seed", range(60))
def test_decoding_calls_in_one_compiled_call_match_the_reference(seed):
    """Few query rows per kv head run as one compiled call (small_rows): within twice
    the float32 reference's error of the float64 oracle, out and lse."""
    (q, k, v), kw = _decoding_case(seed)
    spec = validate(q, k, v, **kw)
    assert small.streams(spec, kernels.for_dtype(np.float32)), kw
    oracle = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    oo, lo, _ = reference.rung_forward(oracle)
    assert o1.dtype == np.float32 and o1.shape == oo.shape and l1.shape == lo.shape
    assert np.array_equal(np.isneginf(l1), np.isneginf(lo))
    assert max_error(o1, oo) <= error_budget(oo, o0)
    assert max_error(l1, lo) <= error_budget(lo, l0)


@pytest.mark.parametrize("shape", [(2, 8, 2, 32, 32, 32), (1, 4, 4, 48, 48, 72), (2, 6, 2, 40, 100, 16),
                                   (1, 8, 2, 16, 256, 64)])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(window=(5, 0)), dict(causal=True, align="top_left")])
def test_short_prefills_under_a_band_stream_and_match_the_reference(shape, kw):
    """Rows a causal band or window cuts stream up to STREAM_BANDED rows × keys per kv
    head (a short prefill: GQA groups of 2–4, 16–48 rows, D up to 72): out and lse within
    twice the float32 reference's error; without the band, or past the bound, the same
    sizes take the products."""
    B, H, A, L, S, D = shape
    q, k, v = (x.astype(np.float32) for x in make_qkv((B, H, L, D), (B, A, S, D), seed=L + S))
    spec = validate(q, k, v, **kw)
    rows = H // A * L
    assert small.streams(spec, kernels.for_dtype(np.float32)) == (rows * S <= small.STREAM_BANDED)
    assert rows > small.STREAM_ROWS and not small.streams(validate(q, k, v), kernels.for_dtype(np.float32))
    oracle = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    oo, lo, _ = reference.rung_forward(oracle)
    assert max_error(o1, oo) <= error_budget(oo, o0) and max_error(l1, lo) <= error_budget(lo, l0)


@pytest.mark.parametrize("kw", [dict(causal=True, window=(0, 0), align="top_left"),
                                dict(causal=True, window=(2, 0), align="top_left"),
                                dict(causal=True, window=(1, 0), q_lengths=np.array([4, 61]))])
def test_rows_that_see_no_key_past_the_last_one(kw):
    """Query rows whose (empty) key range lies past the last key — a top-left band with
    more queries than keys, padding rows under a window — next to rows that see keys:
    the compiled call computes each four rows' scores over the keys one of them sees
    (none past S) and matches the reference, out 0 and lse −inf where no key is seen."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((2, 2, 64, 16), (2, 1, 8, 16), seed=5))
    spec = validate(q, k, v, **kw)
    assert small.streams(spec, kernels.for_dtype(np.float32))
    oracle = validate(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    oo, lo, _ = reference.rung_forward(oracle)
    assert np.array_equal(np.isneginf(l1), np.isneginf(lo)) and np.isneginf(lo).any()
    assert max_error(o1, oo) <= error_budget(oo, o0) and max_error(l1, lo) <= error_budget(lo, l0)


@pytest.mark.parametrize("kw", [{}, dict(causal=True), dict(kv_lengths=np.array([9, 4]))])
def test_rows_whose_scores_are_all_far_below_zero(kw):
    """Every score near −400 (exp of it underflows unless shifted by the row's max): the
    weights are the reference's — out within float32's rounding of such scores, lse
    within float32's rounding of its size. (Not 2× the float32 reference's error: at
    scores of hundreds that error is a score's rounding, ulp(400) ≈ 3e-5, and which of
    two summation orders rounds worse is luck — over 60 inputs each one was the worse by
    2× or more, in 15–20% of them, at either vector width.)"""
    q, k, v = (x.astype(np.float32) for x in make_qkv((2, 4, 2, 24), (2, 2, 9, 24), 20, seed=8))
    q, k = -np.abs(q), np.abs(k)
    spec = validate(q, k, v, scale=20.0, **kw)
    assert small.streams(spec, kernels.for_dtype(np.float32))
    oracle = validate(*(x.astype(np.float64) for x in (q, k, v)), scale=20.0, **kw)
    o1, l1, _ = small.rung_forward(spec)
    oo, lo, _ = reference.rung_forward(oracle)
    assert np.isfinite(lo).all() and lo.max() < -100
    # a score off by a few of its ulps moves a row's weights by as much, relatively:
    # the output by that times the largest value (a shift or underflow wrong: by O(1))
    ulp = np.spacing(np.float32(20.0 * np.abs(np.einsum("bhld,bhsd->bhls", q, np.repeat(k, 2, axis=1))).max()))
    assert max_error(o1, oo) <= 8 * ulp * np.abs(v).max()
    np.testing.assert_allclose(l1, lo, rtol=4 * np.finfo(np.float32).eps)


@pytest.mark.parametrize("where", ["k_excluded", "k_visible", "v_excluded", "v_visible", "v_inf_visible",
                                   "k_minus_inf", "q_inf"])
def test_the_nan_rule_in_one_compiled_call(where):
    """The compiled path keeps the NaN rule: a NaN or inf past the causal band or a
    kv_length is exempt, a visible one makes its rows NaN; a key whose score is −inf
    (an inf in k) is unseen, so a NaN in its value row reaches no row."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((2, 4, 2, 4), (2, 2, 6, 4), seed=3))
    kw = dict(causal=True, kv_lengths=np.array([6, 4]))
    arr, bad = (k if where[0] == "k" else v), (np.inf if "inf" in where else np.nan)
    if where.endswith("excluded"):
        arr[1, 0, 5] = bad                               # past sequence 1's length
    elif where == "k_minus_inf":
        q[0, :2, :, 0] = np.abs(q[0, :2, :, 0]) + 0.1     # kv head 0's rows: key 2's score −inf
        k[0, 0, 2] = [-np.inf, 0, 0, 0]
        v[0, 0, 2] = np.nan
    elif where == "q_inf":
        q[0, 1, 1, 0] = np.inf                           # ±inf scores (NaN where k is 0): its row NaN
    else:
        arr[0, 0, 4] = bad                               # row 1 sees keys 0..4 of sequence 0
    spec = validate(q, k, v, **kw)
    assert small.streams(spec, kernels.for_dtype(np.float32))
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    assert np.array_equal(np.isnan(o1), np.isnan(o0)) and np.array_equal(np.isnan(l1), np.isnan(l0))
    fine = ~np.isnan(o0)
    assert np.abs(o1 - o0)[fine].max() <= 1e-5
    assert np.isnan(o1).any() == (where.endswith("visible") or where == "q_inf")
    if where == "k_minus_inf":
        assert np.isfinite(o1).all() and np.isfinite(l1).all()


def test_an_unseen_key_among_keys_every_row_sees():
    """A −inf score where every row sees every key (no band, no lengths: the compiled
    path's four-keys-at-once sum) still leaves its key's value row unread."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((2, 4, 1, 4), (2, 2, 9, 4), seed=4))
    q[..., 0] = np.abs(q[..., 0]) + 0.1
    k[1, 1, 6] = [-np.inf, 0, 0, 0]
    v[1, 1, 6] = np.nan
    spec = validate(q, k, v)
    assert small.streams(spec, kernels.for_dtype(np.float32))
    o1, l1, _ = small.rung_forward(spec)
    o0, l0, _ = reference.rung_forward(spec)
    assert np.isfinite(o1).all() and max_error(o1, o0) <= 1e-5 and max_error(l1, l0) <= 1e-5


@pytest.mark.parametrize("backend", ["small", "flash"])
def test_decoding_calls_give_the_same_bits_in_any_layout(backend):
    """The compiled decoding kernels follow any strides but D's (a copy then): heads
    inner, padded rows or every other float give the bits of C-ordered arrays."""
    q, k, v = (x.astype(np.float32) for x in make_qkv((3, 8, 2, 40), (3, 2, 50, 40), seed=7))

    def inner(x):
        return np.ascontiguousarray(np.swapaxes(x, -2, -3)).swapaxes(-2, -3)

    def spaced(x, step, extra):
        y = np.zeros(x.shape[:-1] + (step * x.shape[-1] + extra,), x.dtype)
        y[..., :step * x.shape[-1]:step] = x
        return y[..., :step * x.shape[-1]:step]

    want = attnkit.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    for f in (inner, lambda x: spaced(x, 1, 3), lambda x: spaced(x, 2, 0)):
        got = attnkit.attention(f(q), f(k), f(v), causal=True, return_lse=True, backend=backend)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # one row per kv head, one batch element, D = 2: only q strided along D
    q, k, v = (x.astype(np.float32) for x in make_qkv((1, 3, 1, 2), (1, 3, 9, 2), seed=8))
    want = attnkit.attention(q, k, v, return_lse=True, backend=backend)
    got = attnkit.attention(spaced(q, 2, 0), k, v, return_lse=True, backend=backend)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
