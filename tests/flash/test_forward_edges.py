"""Edge cases of the flash rung's forward pass (flash/forward.py) found by mutation
testing: −inf sinks on the tiled and split-KV paths, the weights-only pass on a call
that has values, ALiBi on the streaming kernel for a row block that does not start
at row 0, split-KV parts whose maxima lie hundreds apart (exp overflows unless the
merge shifts by the largest), fully masked rows and the weights of split rows. Each
case is compared with the reference (float64: 1e-12; float32: the 2× rule of
DESIGN.md §6), NaN and −inf positions exactly."""

import numpy as np
import pytest

import attnkit
from attnkit import flash, reference
from attnkit.flash import plan
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error


def _blocks(call):
    return [(u, r0, r1) for u in call.units for r0, r1 in call.row_blocks(u)]


def _split(call):
    """The number of split-KV parts of the call's first row block (1: no split)."""
    blocks = _blocks(call)
    u, r0, r1 = blocks[0]
    return call.splits(len(blocks), u.seg.k1 - u.seg.k0)


def _assert_matches_reference(spec, kw, got):
    """(out, lse, weights) of the flash rung against the float64 reference: NaN where
    it is NaN, and within 1e-12 (float64) or the 2× rule (float32) elsewhere."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (spec.q, spec.k, spec.v))
    oracle = reference.rung_forward(validate(q, k, v, **kw), True)
    same = reference.rung_forward(spec, True)
    for g, o, s in zip(got, oracle, same):
        assert np.array_equal(np.isnan(g), np.isnan(o))
        g, o, s = (np.where(np.isnan(x), 0.0, x) for x in (g, o, s))
        tol = 1e-12 if spec.dtype == "float64" else error_budget(o, s)
        assert max_error(g, o) <= tol


@pytest.mark.parametrize("shape", ["row blocks", "split-KV"])
def test_minus_inf_sinks_are_no_sink_on_the_tiled_and_split_paths(shape):
    """A −inf sink is no sink (a row as without one; with every key excluded too: out
    0, lse −inf, weights 0), in float64 on the tiled path and on a decoding shape cut
    into split-KV parts (the sink joins the first part only). Catches a sink
    initialisation that shifts a −inf sink by itself (exp(−inf − (−inf)) = NaN) and
    a split-KV merge that does the same for a row with no key in any part."""
    rng = np.random.default_rng(11)
    if shape == "row blocks":
        q, k, v = make_qkv((2, 2, 150, 16), (2, 2, 170, 16), 12, seed=11)
        sinks = rng.standard_normal((2, 2, 150))
        sinks[..., ::3] = -np.inf                        # one row in three: no sink
        keep = rng.random((150, 170)) < 0.9
        keep[7] = False                                  # row 7 sees no key, its sink is −inf
        sinks[..., 7] = -np.inf
        kw = dict(sinks=sinks, keep=keep, causal=True)
        empty = (slice(None), slice(None), 7)
    else:
        q, k, v = make_qkv((1, 4, 2, 16), (1, 2, 4096, 16), seed=12)
        keep = np.ones((4, 2, 4096), bool)
        keep[0, 1] = False                               # head 0 row 1 sees no key
        keep[2, 0, :3000] = False                        # head 2 row 0 sees the last part only
        kw = dict(sinks=np.array([-np.inf, -np.inf, -np.inf, 0.5]), keep=keep)
        empty = (0, 0, 1)
    spec = validate(q, k, v, **kw)
    assert (_split(plan.Call(spec, None, None)) > 1) == (shape == "split-KV")
    out, lse, w = flash.rung_forward(spec, True)
    assert np.all(out[empty] == 0) and np.all(lse[empty] == -np.inf) and np.all(w[empty] == 0)
    assert not np.isnan(out).any() and not np.isnan(lse).any() and not np.isnan(w).any()
    _assert_matches_reference(spec, kw, (out, lse, w))


@pytest.mark.parametrize("kw", [dict(causal=True), dict(causal=True, dropout=0.3, seed=3), dict()],
                         ids=["causal", "dropout", "full"])
def test_weights_without_lse_on_a_call_with_values(kw):
    """Weights without lse run the forward's softmax over their rows with no out: on a
    call that holds values (a full spec, as the forward and the torch op build) that
    pass must not take the P·V product — a condition that takes it whenever values
    exist reads v for nothing and fails on the row strips a causal diagonal is cut
    into (one head, rows > SUB_M). Weights are before dropout, as the reference's."""
    q, k, v = make_qkv((1, 300, 8), (1, 310, 8), 6, seed=13)
    spec = validate(q, k, v, **kw)
    u = plan.Call(spec, None, None).units[0]
    assert u.nk * u.g == 1 and spec.L > plan.SUB_M      # the strips' path
    want = reference.rung_weights(spec)
    assert max_error(flash.rung_weights(spec), want) <= 1e-12
    assert max_error(flash.rung_weights(spec, rows=[0, 150, 299]), want[..., [0, 150, 299], :]) <= 1e-12
    no_v = attnkit.attention_weights(q, k, **kw, backend="flash")
    assert max_error(no_v, want) <= 1e-12


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_alibi_on_the_streaming_kernel_for_the_last_row_block_of_a_long_sequence(align):
    """One head per unit and more rows than BLOCK_M: the last, short row block starts at
    r0 = BLOCK_M and takes the streaming (decoding) kernel. Each row's ALiBi slope and
    diagonal must be its own (a per-row slope array of the wrong length is silently
    no ALiBi; a diagonal off by r0 or the alignment shifts every bias)."""
    q, k, v = make_qkv((1, 2, 1030, 16), (1, 2, 1100, 16), dtype="float32", seed=14)
    kw = dict(alibi_slopes=np.array([0.5, 0.05]), causal=True, align=align)
    spec = validate(q, k, v, **kw)
    call = plan.Call(spec, None, None)
    assert any(r0 > 0 and call.streams(u, r0, r1) for u, r0, r1 in _blocks(call))
    _assert_matches_reference(spec, kw, flash.rung_forward(spec, True))


@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_alibi_decoding_split_kv_parts_with_maxima_hundreds_apart(dtype, align):
    """Decoding with steep ALiBi slopes over 4096 keys (long-context BLOOM/MPT-style
    heads): the split-KV parts' maxima lie hundreds apart (over 700: exp overflows in
    float64; over 88 in float32, where the parts come from the streaming kernel), the
    largest in the last part (bottom-right: the query sits at the end) or the first
    (top-left: at the start). Catches a merge shifted by anything but the largest
    part maximum (the smallest, or the largest of the parts after the first), and
    split rows whose weights are never written."""
    q, k, v = make_qkv((1, 4, 1, 32), (1, 2, 4096, 32), dtype=dtype, seed=15)
    kw = dict(alibi_slopes=np.array([1.0, 0.5, 0.25, 0.01]), align=align)
    spec = validate(q, k, v, **kw)
    call = plan.Call(spec, None, None)
    assert _split(call) > 1 and all(call.streams(*b) for b in _blocks(call)) == (dtype == "float32")
    out, lse, w = flash.rung_forward(spec, True)
    assert np.isfinite(out).all() and np.isfinite(lse).all() and np.isfinite(w).all()
    _assert_matches_reference(spec, kw, (out, lse, w))
