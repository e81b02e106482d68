"""Per-sequence lengths and packed sequences on the flash rung: equal to each sequence
attended alone, forward and backward (float64 ≤ 1e-10; float32 by the 2× rule), for
every mask term, GQA, L ≠ S, empty sequences, sequences shorter than a tile and
longer than several; one sequence's keys never change another's outputs (bitwise);
tiles past a sequence's end are not computed."""

import numpy as np
import pytest

import attnkit
from attnkit import flash, reference
from attnkit.backends import Grads
from attnkit.flash import plan
from attnkit.spec import validate
from attnkit.testing import error_budget, make_qkv, max_error

MASKS = {"plain": {}, "causal": dict(causal=True), "causal_top_left": dict(causal=True, align="top_left"),
         "window": dict(window=(3, 2)), "softcap_causal": dict(softcap=2.0, causal=True),
         "alibi_sinks": dict(alibi_slopes=np.array([0.5, 0.2, 0.1, 0.3]), sinks=np.array([0.0, 1.0, -1.0, 0.5]),
                             causal=True),
         "dropout": dict(dropout=0.3, seed=4, window=(None, 1))}
LQ, LK = [0, 3, 1, 40, 17], [5, 0, 9, 33, 61]          # empty, tiny, and several tiles of 8


def alone(q, k, v, dout, kw, b=None, rows=None, keys=None):
    """Forward and backward of one sequence attended alone on the reference."""
    qs, ks, vs, ds = q[..., rows, :], k[..., keys, :], v[..., keys, :], dout[..., rows, :]
    spec = validate(qs, ks, vs, **kw)
    o, lse, _ = reference.rung_forward(spec)
    return o, lse, reference.rung_backward(spec, ds, o, lse)


@pytest.mark.parametrize("mask", list(MASKS))
def test_packed_equals_each_sequence_alone(mask):
    kw = MASKS[mask]
    if "dropout" in kw:
        pytest.skip("dropout's counters are packed positions: a sequence alone draws other bits")
    cq, ck = np.cumsum([0] + LQ), np.cumsum([0] + LK)
    q, k, v = make_qkv((4, cq[-1], 8), (2, ck[-1], 8), 6, seed=1)
    dout = np.random.default_rng(2).standard_normal((4, cq[-1], 6))
    spec = validate(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, **kw)
    out, lse, _ = flash.rung_forward(spec, block_m=8, block_n=8)
    g = flash.rung_backward(spec, dout, out, lse, block_m=8, block_n=8)
    for i in range(len(LQ)):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if LQ[i] == 0:
            continue
        if LK[i] == 0:                                   # no key: out 0, lse the sink's or -inf, no gradient
            assert np.all(out[:, rows] == 0) and np.all(g.dq[:, rows] == 0)
            continue
        o, l, gw = alone(q, k, v, dout, kw, rows=rows, keys=keys)
        assert max_error(out[:, rows], o) <= 1e-10 and max_error(lse[:, rows], l) <= 1e-10
        assert max_error(g.dq[:, rows], gw.dq) <= 1e-10
        assert max_error(g.dk[:, keys], gw.dk) <= 1e-10 and max_error(g.dv[:, keys], gw.dv) <= 1e-10
    if "sinks" in kw:                                    # dsinks: the sum over sequences (the keyless one's
        parts = [alone(q, k, v, dout, kw, rows=slice(cq[i], cq[i + 1]), keys=slice(ck[i], ck[i + 1]))[2].dsinks
                 for i in range(len(LQ)) if LQ[i] and LK[i]]                       # rows have out 0: no gradient)
        assert max_error(g.dsinks, sum(parts)) <= 1e-10


@pytest.mark.parametrize("mask", list(MASKS))
def test_padded_lengths_equal_each_sequence_alone(mask):
    kw = MASKS[mask]
    ql, kl = np.array([0, 3, 1, 40, 17]), np.array([5, 0, 9, 33, 61])
    q, k, v = make_qkv((5, 4, 40, 8), (5, 2, 61, 8), 6, seed=3)
    dout = np.random.default_rng(4).standard_normal((5, 4, 40, 6))
    spec = validate(q, k, v, q_lengths=ql, kv_lengths=kl, **kw)
    out, lse, _ = flash.rung_forward(spec, block_m=8, block_n=8)
    g = flash.rung_backward(spec, dout, out, lse, block_m=8, block_n=8)
    ref_out, ref_lse, _ = reference.rung_forward(spec)
    ref_g = reference.rung_backward(spec, dout, ref_out, ref_lse)
    assert max_error(out, ref_out) <= 1e-10 and max_error(lse, ref_lse) <= 1e-10
    for a, b in zip(g, ref_g):
        assert (a is None) == (b is None) and (a is None or max_error(a, b) <= 1e-10)
    for b in range(5):
        assert np.all(out[b, :, ql[b]:] == 0) and np.all(lse[b, :, ql[b]:] == -np.inf)   # padding rows
        assert np.all(g.dk[b, :, kl[b]:] == 0) and np.all(g.dq[b, :, ql[b]:] == 0)
        if ql[b] and kl[b] and "dropout" not in kw:     # and equal to the sequence attended alone
            o, _, gw = alone(q[b], k[b], v[b], dout[b], kw, rows=slice(0, ql[b]), keys=slice(0, kl[b]))
            assert max_error(out[b, :, :ql[b]], o) <= 1e-10 and max_error(g.dv[b, :, :kl[b]], gw.dv) <= 1e-10


def test_one_sequence_never_changes_another_bitwise():
    cq = ck = np.cumsum([0, 20, 37, 5])
    q, k, v = make_qkv((2, 62, 16), (2, 62, 16), dtype="float32", seed=5)
    before = flash.rung_forward(validate(q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True))[0]
    k2, v2 = k.copy(), v.copy()
    k2[:, 20:57] = np.random.default_rng(6).standard_normal((2, 37, 16)) * 100    # sequence 1 only
    v2[:, 20:57] = np.nan
    after = flash.rung_forward(validate(q, k2, v2, cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True))[0]
    assert np.array_equal(before[:, :20], after[:, :20]) and np.array_equal(before[:, 57:], after[:, 57:])
    assert np.isnan(after[:, 20:57]).all()


def test_low_precision_packed_within_twice_the_reference_error():
    cq = ck = np.cumsum([0, 130, 7, 300])
    q, k, v = make_qkv((4, 437, 32), (2, 437, 32), dtype="float32", seed=7)
    kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=True)
    got = flash.rung_forward(validate(q, k, v, **kw))
    same = reference.rung_forward(validate(q, k, v, **kw))
    oracle = reference.rung_forward(validate(*(x.astype(np.float64) for x in (q, k, v)), **kw))
    for a, s, o in zip(got[:2], same[:2], oracle[:2]):
        assert max_error(a, o) <= error_budget(o, s)


def test_tiles_past_a_sequences_end_are_skipped(monkeypatch):
    """A padded batch costs what its real tokens cost: the tiles computed are those of
    the sequences' own lengths."""
    seen = []
    scores = plan.Call.scores

    def spy(self, s, u, q_t, k_t, r0, r1, c0, c1, *a, **kw):
        seen.append((u.b, r0, r1, c0, c1))
        return scores(self, s, u, q_t, k_t, r0, r1, c0, c1, *a, **kw)

    monkeypatch.setattr(plan.Call, "scores", spy)
    q, k, v = make_qkv((2, 1, 256, 8), (2, 1, 256, 8), seed=8)
    flash.rung_forward(validate(q, k, v, q_lengths=np.array([256, 32]), kv_lengths=np.array([256, 40])),
                       block_m=16, block_n=16)
    short = [t for t in seen if t[0] == (1,)]
    assert max(t[2] for t in short) <= 32 and max(t[4] for t in short) <= 40
    assert len(short) == 2 * 3                           # 2 row blocks × 3 key blocks (40 keys)


def test_many_short_sequences_use_both_workers_and_stay_exact():
    """A BERT-like batch (32 sequences of 12 heads): the planner batches heads, every
    worker gets tasks, and the result is the reference's."""
    q, k, v = make_qkv((32, 12, 64, 16), (32, 12, 64, 16), seed=9)
    call = plan.Call(validate(q, k, v), None, None)
    assert len(call.units) >= 8 and all(u.nk > 1 for u in call.units)
    with flash.threads(2):
        got = attnkit.attention(q, k, v, backend="flash")
    assert max_error(got, attnkit.attention(q, k, v, backend="reference")) <= 1e-12


# ---- found by mutation testing (scripts/mutation.py, docs/mutation.md) ------------------
def test_query_lengths_alone_pad_rows():
    """q_lengths without kv_lengths: rows past each sequence's length are padding (out 0,
    lse -inf, no gradient) on the flash rung too, and the rest is the reference's."""
    q, k, v = make_qkv((3, 2, 9, 8), (3, 1, 7, 8), 5, seed=11)
    dout = np.random.default_rng(12).standard_normal((3, 2, 9, 5))
    spec = validate(q, k, v, causal=True, q_lengths=np.array([9, 4, 0]))
    out, lse, _ = flash.rung_forward(spec, block_m=4, block_n=4)
    g = flash.rung_backward(spec, dout, out, lse, block_m=4, block_n=4)
    ref_out, ref_lse, _ = reference.rung_forward(spec)
    ref_g = reference.rung_backward(spec, dout, ref_out, ref_lse)
    assert max_error(out, ref_out) <= 1e-12 and max_error(lse, ref_lse) <= 1e-12
    assert all(max_error(a, b) <= 1e-12 for a, b in zip(g[:3], ref_g[:3]))
    assert np.all(out[1, :, 4:] == 0) and np.all(lse[2] == -np.inf) and np.all(g.dq[1, :, 4:] == 0)


def _array_terms(rng, shape):
    """keep, drop and bias (the mask terms given as arrays) of shape (..., L, S), and all at once."""
    keep, drop, bias = rng.random(shape) < 0.8, rng.random(shape[-2:]) < 0.2, rng.standard_normal(shape)
    return {"keep": dict(keep=keep), "drop": dict(drop=drop), "bias": dict(bias=bias),
            "all": dict(keep=keep, drop=drop, bias=bias, softcap=2.0, causal=True, window=(3, None))}


def _block(kw, rows, keys, b=None):
    """kw with its array terms cut to one sequence's block (batch element b first)."""
    cut = {n: (x if b is None or x.ndim < 4 else x[b])[..., rows, keys] for n, x in kw.items()
           if n in ("keep", "drop", "bias")}
    return {**kw, **cut}


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("term", ["keep", "drop", "bias", "all"])
def test_array_terms_in_packed_coordinates_equal_each_sequence_alone(term, backend):
    """keep, drop and bias given over the packed rows and keys: each sequence gets its
    own block of them — out, lse, every gradient (dbias 0 off the blocks) and the
    weights (0 off the blocks) equal the sequence attended alone with that block."""
    cq, ck = np.cumsum([0] + LQ), np.cumsum([0] + LK)
    q, k, v = make_qkv((4, cq[-1], 8), (2, ck[-1], 8), 6, seed=9)
    rng = np.random.default_rng(10)
    kw = _array_terms(rng, (4, cq[-1], ck[-1]))[term]
    dout = rng.standard_normal((4, cq[-1], 6))
    packed = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, backend=backend, **kw)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **packed)
    g = Grads(*attnkit.attention_backward(dout, q, k, v, out, lse, **packed), None)
    w = attnkit.attention_weights(q, k, **packed)
    off = np.ones((cq[-1], ck[-1]), dtype=bool)
    for i in range(len(LQ)):
        rows, keys = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        off[rows, keys] = False
        if LQ[i] == 0 or LK[i] == 0:
            continue
        one = _block(kw, rows, keys)
        o, l, gw = alone(q, k, v, dout, one, rows=rows, keys=keys)
        assert max_error(out[:, rows], o) <= 1e-10 and max_error(lse[:, rows], l) <= 1e-10
        assert max_error(g.dq[:, rows], gw.dq) <= 1e-10
        assert max_error(g.dk[:, keys], gw.dk) <= 1e-10 and max_error(g.dv[:, keys], gw.dv) <= 1e-10
        ws = attnkit.attention_weights(q[:, rows], k[:, keys], backend="reference", **one)
        assert max_error(w[:, rows, keys], ws) <= 1e-10
        if "bias" in kw:
            assert max_error(g.dbias[:, rows, keys], gw.dbias) <= 1e-10
    assert np.all(w[:, off] == 0) and ("bias" not in kw or np.all(g.dbias[:, off] == 0))


@pytest.mark.parametrize("backend", ["flash", "reference"])
@pytest.mark.parametrize("term", ["keep", "drop", "bias", "all"])
def test_array_terms_with_lengths_equal_each_sequence_alone(term, backend):
    """keep, drop and bias with q_lengths and kv_lengths: out, lse and every gradient of
    each batch element equal its sequence attended alone with its block of them."""
    ql, kl = np.array([0, 3, 1, 40, 17]), np.array([5, 0, 9, 33, 61])
    q, k, v = make_qkv((5, 4, 40, 8), (5, 2, 61, 8), 6, seed=11)
    rng = np.random.default_rng(12)
    kw = _array_terms(rng, (5, 4, 40, 61))[term]
    dout = rng.standard_normal((5, 4, 40, 6))
    padded = dict(q_lengths=ql, kv_lengths=kl, backend=backend, **kw)
    out, lse = attnkit.attention(q, k, v, return_lse=True, **padded)
    g = Grads(*attnkit.attention_backward(dout, q, k, v, out, lse, **padded), None)
    for b in range(5):
        assert np.all(out[b, :, ql[b]:] == 0) and np.all(g.dq[b, :, ql[b]:] == 0)
        assert np.all(g.dk[b, :, kl[b]:] == 0) and np.all(g.dv[b, :, kl[b]:] == 0)
        if "bias" in kw:
            assert np.all(g.dbias[b, :, ql[b]:] == 0) and np.all(g.dbias[b, :, :, kl[b]:] == 0)
        if ql[b] == 0 or kl[b] == 0:
            continue
        rows, keys = slice(0, ql[b]), slice(0, kl[b])
        one = _block(kw, rows, keys, b)
        o, l, gw = alone(q[b], k[b], v[b], dout[b], one, rows=rows, keys=keys)
        assert max_error(out[b, :, rows], o) <= 1e-10 and max_error(lse[b, :, rows], l) <= 1e-10
        assert max_error(g.dq[b, :, rows], gw.dq) <= 1e-10
        assert max_error(g.dk[b, :, keys], gw.dk) <= 1e-10 and max_error(g.dv[b, :, keys], gw.dv) <= 1e-10
        if "bias" in kw:
            assert max_error(g.dbias[b, :, rows, keys], gw.dbias) <= 1e-10


def test_one_padded_sequence_never_changes_another_bitwise():
    """Forward and backward: another batch element's keys and values, and a sequence's
    own keys past its length, change no other output or gradient bit."""
    ql, kl = np.array([7, 20, 13]), np.array([9, 20, 5])
    q, k, v = make_qkv((3, 2, 20, 8), (3, 2, 20, 8), dtype="float32", seed=13)
    dout = np.random.default_rng(14).standard_normal((3, 2, 20, 8)).astype(np.float32)

    def run(k, v):
        spec = validate(q, k, v, q_lengths=ql, kv_lengths=kl, causal=True)
        out, lse, _ = flash.rung_forward(spec, block_m=8, block_n=8)
        return out, lse, flash.rung_backward(spec, dout, out, lse, block_m=8, block_n=8)
    before = run(k, v)
    k2, v2 = k.copy(), v.copy()
    k2[1], v2[1] = 100.0, np.nan                       # batch element 1 only
    k2[2, :, 5:], v2[2, :, 5:] = np.nan, np.inf        # element 2's keys past its length
    after = run(k2, v2)
    for b in (0, 2):
        assert np.array_equal(before[0][b], after[0][b]) and np.array_equal(before[1][b], after[1][b])
        assert np.array_equal(before[2].dq[b], after[2].dq[b])
        assert np.array_equal(before[2].dk[b, :, :kl[b]], after[2].dk[b, :, :kl[b]])
        assert np.array_equal(before[2].dv[b, :, :kl[b]], after[2].dv[b, :, :kl[b]])
    assert np.all(after[2].dk[2, :, 5:] == 0) and np.all(after[2].dv[2, :, 5:] == 0)


@pytest.mark.parametrize("how", ["packed", "lengths"])
def test_packed_and_padded_never_allocate_an_L_by_S_array(how):
    """Sequences' edges are tile bounds, not a mask: a packed or padded call of 8,192
    tokens allocates a small part of what a boolean L × S mask would."""
    from cases import peak_bytes

    def case(T):
        q, k, v = make_qkv((1, T, 16), (1, T, 16), dtype="float32", seed=15)
        if how == "packed":
            cu = np.array([0, T // 8, T // 8 + 1, T * 5 // 8, T])
            return validate(q, k, v, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
        q, k, v = (np.stack([x, x]) for x in (q, k, v))
        return validate(q, k, v, causal=True, q_lengths=np.array([T - 192, 100]), kv_lengths=np.array([T, 50]))
    warm = case(256)                                     # the same kind of call compiles outside the trace
    w_out, w_lse, _ = flash.rung_forward(warm)
    flash.rung_backward(warm, w_out, w_out, w_lse)
    T = 8192
    spec = case(T)
    (out, lse, _), fwd_peak = peak_bytes(lambda: flash.rung_forward(spec))
    _, bwd_peak = peak_bytes(lambda: flash.rung_backward(spec, out, out, lse))
    assert fwd_peak < T * T // 8 and bwd_peak < T * T // 2
