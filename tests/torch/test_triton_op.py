"""The Triton rung through the real torch op (``attnkit.attention(..., backend="triton")``
and autograd) on CPU tensors under TRITON_INTERPRET=1: each term against
``backend="auto"``, and the NaN rule (DESIGN.md §2, ``attnkit.nonfinite``) against the
reference rung in the same precision and against PyTorch SDPA where SDPA's answer is
defined. 16 × 16 tiles, so masked keys sit in skipped, partial and full tiles.
"""

import math

import numpy as np
import pytest

import attnkit
from attnkit.testing import max_error

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
from attnkit.torch import triton as triton_rung  # noqa: E402
from attnkit.torch.triton import tuning as triton_tuning  # noqa: E402

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def interpreter(monkeypatch, fast_interpreter):
    """TRITON_INTERPRET=1 (the fast interpreter: conftest.py), 16 × 16 tiles."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_rung.unavailable() is not None:
        pytest.skip(triton_rung.unavailable())
    monkeypatch.setattr(triton_tuning, "override", lambda *a: {"BLOCK_M": 16, "BLOCK_N": 16})


def tensors(shape_q, shape_k, Dv, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape_v = shape_k[:-1] + (Dv,)
    return [torch.randn(s, generator=g) for s in (shape_q, shape_k, shape_v)]


def run(backend, q, k, v, grad_of=(), dout=None, **kw):
    """out, lse and the gradients of (out · dout).sum() + lse.sum() (NaN-free lse terms
    only) with respect to q, k, v and the tensors in kw named by grad_of."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    kw = dict(kw)
    for name in grad_of:
        kw[name] = kw[name].detach().clone().requires_grad_()
        leaves.append(kw[name])
    out, lse = attnkit.attention(*leaves[:3], return_lse=True, backend=backend, **kw)
    dout = torch.ones_like(out) if dout is None else dout
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    grads = torch.autograd.grad((out * dout).sum() + finite_lse.sum(), leaves)
    return [out.detach(), lse.detach()] + list(grads)


TERMS = {
    "lengths": lambda B, H, L, S: dict(q_lengths=torch.tensor([L, 5]), kv_lengths=torch.tensor([9, S]), causal=True),
    "packed": lambda B, H, L, S: dict(cu_seqlens_q=torch.tensor([0, 10, 10, L]),
                                      cu_seqlens_k=torch.tensor([0, 20, 25, S]), causal=True),
    "sinks": lambda B, H, L, S: dict(sinks=torch.randn(H), window=(4, 0)),
    "alibi": lambda B, H, L, S: dict(alibi_slopes=torch.rand(B + (H,)), causal=True, align="top_left"),
    "dropout": lambda B, H, L, S: dict(dropout=0.25, seed=2024, causal=True),
}


@pytest.mark.parametrize("term", list(TERMS))
def test_each_term_matches_the_cpu_rungs(term):
    """out, lse and every gradient (sinks' too) through the torch op, Triton vs the
    rung backend="auto" picks on the CPU."""
    B = () if term == "packed" else (2,)
    H, L, S = 4, 37, 41
    q, k, v = tensors(B + (H, L, 16), B + (2, S, 16), 24, seed=3)
    torch.manual_seed(0)
    kw = TERMS[term](B, H, L, S)
    grad_of = ("sinks",) if term == "sinks" else ()
    got = run("triton", q, k, v, grad_of, **kw)
    want = run("auto", q, k, v, grad_of, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want):
        assert a.shape == b.shape and max_error(a, b) <= 1e-5, name


# ---- the NaN rule -----------------------------------------------------------------------
def same(name, got, want, tol=2e-5):
    """NaN where want is NaN (and only there), equal infinities, finite values close."""
    got, want = got.double(), want.double()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{name}: NaN positions differ"
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), f"{name}: inf positions differ"
    assert torch.equal(got[~fin & ~torch.isnan(want)], want[~fin & ~torch.isnan(want)]), f"{name}: infinities differ"
    scale = max(1.0, float(want[fin].abs().max())) if fin.any() else 1.0
    err = float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0
    assert err <= tol * scale, f"{name}: error {err:.3g}"


def nonfinite_case(kind):
    """q, k, v (float32, (2, 35, 16) heads over one kv head; 40 keys) with causal and a
    keep mask, poisoned per kind; returns (q, k, v, keyword arguments)."""
    q, k, v = tensors((2, 35, 16), (1, 40, 16), 16, seed=11)
    keep = torch.rand(35, 40, generator=torch.Generator().manual_seed(1)) < 0.8
    keep[:, 30] = False                             # key 30: excluded for every query by keep
    kw = dict(causal=True, align="top_left", keep=keep)
    # key 38 is excluded by causal for rows < 38 (its tile is skipped for rows < 32);
    # key 30 by keep everywhere; key 3 is visible to most rows
    if kind == "q":
        q[0, 7] = NAN
        q[1, 20, 3] = INF
    elif kind in ("k", "v"):
        x = k if kind == "k" else v
        x[0, 38, 2] = NAN
        x[0, 30, 5] = INF
        x[0, 3, 1] = NAN if kind == "k" else INF
        x[0, 12, 0] = -INF
    elif kind == "bias":
        bias = torch.randn(2, 35, 40, generator=torch.Generator().manual_seed(2))
        bias[0, 4, 2] = INF                         # +inf reaches row 4's softmax
        bias[1, 9, 30] = NAN                        # at a key excluded by keep: exempt
        bias[1, 17, 20] = NAN                       # at a visible key: row NaN
        bias[0, 25, :] = -INF                       # a row masked by bias alone
        kw["bias"] = bias
    elif kind == "overflow":                        # scores overflow float32 on rows 5 and 6 only
        q[:, :, 0] = 0.0                            # the other rows never see k's huge dim 0
        q[0, 5, 0] = 1e20
        q[1, 6, 0] = -1e20
        k[0, :8, 0] = 1e20
    elif kind == "huge":                            # every row's scores reach ~1e20 on keys 0-7
        q[0, 5] = 1e20
        q[1, 6] = -1e20
        k[0, :8] = 1e20
    elif kind == "sinks":
        sinks = torch.randn(2, 35, generator=torch.Generator().manual_seed(3))
        sinks[0, 3] = NAN
        sinks[1, 8] = INF
        sinks[0, 10] = -INF
        kw["sinks"] = sinks
    return q, k, v, kw


@pytest.mark.parametrize("kind", ["q", "k", "v", "bias", "overflow", "huge", "sinks"])
def test_nan_rule_matches_the_reference(kind):
    """Non-finite q, k, v, bias, sinks and overflowing scores: out, lse and the
    gradients NaN exactly where the reference (float32, the NumPy rule) has them, the
    rest equal; excluded keys never pass a NaN on, on every tile kind."""
    q, k, v, kw = nonfinite_case(kind)
    grad_of = [n for n in ("bias", "sinks") if n in kw]
    got = run("triton", q, k, v, grad_of, **kw)
    want = run("reference", q, k, v, grad_of, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias/dsinks"), got, want):
        if kind == "huge" and name.startswith("d"):
            # weights recomputed from lse at scores ~1e20 are ill-conditioned (lse's last
            # bit is worth 1e13): only where NaN and inf are is compared; a weight must
            # never round up to inf (it made the dk of keys row 5 cannot see NaN)
            assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{kind} {name}: NaN positions differ"
            assert torch.equal(torch.isinf(a), torch.isinf(b)), f"{kind} {name}: inf positions differ"
        else:
            same(f"{kind} {name}", a, b)
    assert not torch.isnan(got[0]).all()            # the case is not trivially all NaN


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nan_rule_in_half_precision(dtype):
    """The careful variant on half-precision operands (the interpreter keeps bfloat16
    as raw bits): the same NaN positions as the reference, the rest close."""
    q, k, v, kw = nonfinite_case("v")
    q, k, v = (x.to(dtype) for x in (q, k, v))
    got, want = (run(b, q, k, v, **kw) for b in ("triton", "reference"))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        same(f"{dtype} {name}", a, b, tol=2e-2)


def test_nan_in_dout_and_lse_reaches_only_visible_pairs():
    """A NaN upstream gradient on one row, and a NaN lse handed to the backward:
    gradients NaN only through visible pairs, as the reference computes them."""
    q, k, v, kw = nonfinite_case("none")
    out, lse = attnkit.attention(q, k, v, return_lse=True, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(4))
    dout[1, 2, 4] = NAN
    lse = lse.clone()
    lse[0, 6] = NAN
    grads = [attnkit.attention_backward(dout, q, k, v, out, lse, backend=b, **kw) for b in ("triton", "reference")]
    for name, a, b in zip(("dq", "dk", "dv"), *grads):
        same(name, a, b)
    dv = grads[0][2][0]                             # keys 7.. are visible to neither row 2 nor row 6
    assert torch.isnan(dv[:7]).any() and torch.isfinite(dv[7:]).all()


def test_nan_rule_against_sdpa_where_it_is_defined():
    """PyTorch SDPA as a peer on the rows it defines: a NaN query row is NaN, a NaN
    value at a visible key makes its column NaN for the rows that see it, every other
    row (not seeing a poisoned key) equal. (SDPA also spreads 0 · NaN to rows for
    which the key is masked, and keeps an inf value inf; attnkit does neither, see
    attnkit.nonfinite.)"""
    q, k, v = tensors((2, 35, 16), (2, 40, 16), 16, seed=12)
    q[0, 7] = NAN
    v[1, 20, 3] = NAN
    v[1, 33, 6] = NAN
    out = attnkit.attention(q, k, v, causal=True, align="top_left", backend="triton")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.isnan(out[0, 7]).all() and torch.isnan(ref[0, 7]).all()
    for col, key in ((3, 20), (6, 33)):
        assert torch.isnan(out[1, key:, col]).all() and torch.isnan(ref[1, key:, col]).all()
    clean = torch.ones(2, 35, 16, dtype=torch.bool)
    clean[0, 7] = False
    clean[1, 20:, 3] = False
    clean[1, 33:, 6] = False
    clean[1, :, [3, 6]] = False                     # SDPA: NaN there for masked rows too
    assert torch.isfinite(out[clean]).all()
    assert max_error(out[clean], ref[clean]) <= 1e-5
    assert math.isfinite(float(out[1, :20, 3].sum()))   # rows that do not see key 20: finite here


def test_v_nan_at_excluded_keys_is_exempt_on_every_tile_size(monkeypatch):
    """The same NaN-free answer with 16, 32 and 64 tiles: an excluded key's value is
    never read, whichever tile it falls in."""
    q, k, v, kw = nonfinite_case("v")
    outs = []
    for b in (16, 32, 64):
        monkeypatch.setattr(triton_tuning, "override", lambda *a, b=b: {"BLOCK_M": b, "BLOCK_N": b})
        outs.append(attnkit.attention(q, k, v, backend="triton", **kw))
    for o in outs[1:]:
        same("out", o, outs[0], tol=1e-6)
    assert np.isfinite(outs[0][0, :3].numpy()).all()   # rows 0-2 see only keys 0-2: no poisoned key


def softcap_inf_cases():
    """(q, k, v, kw): an infinite entry under softcap, its inf · 0 on an excluded pair
    only (causal row 0 against key 1; a tile's zero-padded rows and keys)."""
    g = torch.Generator().manual_seed(0)
    excluded = [torch.randn(1, 2, 16, generator=g) for _ in range(3)]
    excluded[0][0, 0, 0], excluded[0][0, 1, 0], excluded[1][0, 1, 0] = 0.0, 1.0, INF
    one_row = [torch.randn(1, n, 16, generator=g) for n in (1, 3, 3)]
    one_row[0][0, 0, 0], one_row[1][0, 0, 0] = 1.0, INF        # (L = 1: the tile's padding rows)
    inf_q = [torch.randn(1, n, 16, generator=g) for n in (4, 20, 20)]
    inf_q[0][0, 3, 5] = INF                                     # (S = 20: a partial key tile)
    # each case with the gradient entries the masked-then-scaled factor made NaN
    return {"excluded pair": (*excluded, dict(causal=True), ("dq", 0)), "padding rows": (*one_row, {}, ("dk", 0)),
            "padding keys": (*inf_q, {}, ("dq", 3))}


@pytest.mark.parametrize("case", list(softcap_inf_cases()))
def test_softcap_gradients_of_an_infinite_entry_stay_off_excluded_pairs(case):
    """Under softcap an infinite q or k entry saturates its scores (tanh → ±1: gradient
    0); where it meets a 0 — on a pair the row does not see, or in a tile's zero
    padding — the product is NaN, and the kernels masked the score gradient before its
    softcap factor 1 − tanh², so 0 · NaN spread over a whole dq or dk row. The factor
    is applied inside the mask: the gradients are the reference's (NaN where an
    infinite entry meets a pair a row sees: 0 · inf), that row or key NaN-free."""
    q, k, v, kw, (grad, row) = softcap_inf_cases()[case]
    got = run("triton", q, k, v, softcap=2.0, **kw)
    want = run("reference", q, k, v, softcap=2.0, **kw)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        same(f"{case} {name}", a, b)
    assert torch.isfinite(got[2 + "qkv".index(grad[1])][0, row]).all()
