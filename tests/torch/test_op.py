"""The torch rung: autograd op, gradcheck, SDPA and reference peers, torch.compile,
MultiheadAttention against torch.nn.MultiheadAttention."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import attnkit  # noqa: E402
import attnkit.torch  # noqa: E402
from attnkit.testing import max_error  # noqa: E402
from peers import torch_index_keep  # noqa: E402

MaskKinds = {
    "none": {},
    "causal_br": {"causal": True},
    "causal_tl": {"causal": True, "align": "top_left"},
    "window": {"window": (1, 2)},
    "window_causal_tl": {"window": (2, None), "causal": True, "align": "top_left"},
    "keep": {"keep": "keep"},
    "drop": {"drop": "drop"},
    "keep_and_drop": {"keep": "keep", "drop": "drop"},
    "bias": {"bias": "bias"},
    "softcap": {"softcap": 0.7},
    "everything": {"causal": True, "window": (3, None), "drop": "drop", "bias": "bias", "softcap": 2.0},
}


def make(shape_q, shape_k, Dv=None, *, dtype=torch.float64, seed=0, grad=True):
    g = torch.Generator().manual_seed(seed)
    shape_v = tuple(shape_k[:-1]) + ((shape_k[-1] if Dv is None else Dv),)
    return tuple(torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in (shape_q, shape_k, shape_v))


def masks_for(kind, L, S, H, dtype=torch.float64, seed=1):
    """The keyword arguments of mask kind ``kind``, with random boolean masks."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(MaskKinds[kind])
    if "keep" in kw:
        keep = torch.rand(H, L, S, generator=g) > 0.3
        keep[..., 0] = True
        kw["keep"] = keep
    if "drop" in kw:
        drop = torch.rand(1, L, S, generator=g) > 0.7
        drop[..., -1] = False
        kw["drop"] = drop
    if "bias" in kw:                             # broadcast over batch and heads: dbias is reduced
        kw["bias"] = torch.randn(1, L, S, generator=g, dtype=dtype).requires_grad_(True)
    return kw


def has_empty_rows(kw, L, S):
    keep = torch_index_keep(L, S, kw.get("causal", False), kw.get("window"), kw.get("align", "bottom_right"))
    if kw.get("keep") is not None:
        keep = keep & kw["keep"]
    if kw.get("drop") is not None:
        keep = keep & ~kw["drop"]
    return not bool(keep.any(-1).all())


# ---- gradcheck ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", list(MaskKinds))
@pytest.mark.parametrize("L,S", [(3, 5), (5, 3)])
def test_gradcheck_every_mask_kind(kind, L, S):
    """float64 gradients of out (and of lse where every row has a key) for q, k, v and
    bias, with GQA (4 query heads on 2 kv heads), D != Dv and L != S both ways."""
    q, k, v = make((1, 4, L, 3), (2, S, 3), Dv=2, seed=L)
    kw = masks_for(kind, L, S, 4)
    bias = kw.pop("bias", None)
    with_lse = not has_empty_rows(kw, L, S)

    def f(q, k, v, bias):
        return attnkit.attention(q, k, v, bias=bias, return_lse=with_lse, **kw)

    assert torch.autograd.gradcheck(f, (q, k, v, bias), atol=1e-8)


def test_gradcheck_two_d_inputs_and_full_bias():
    q, k, v = make((4, 3), (6, 3), Dv=5)
    bias = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: attnkit.attention(*a[:3], bias=a[3], causal=True,
                                                                 return_lse=True), (q, k, v, bias))


def test_lse_gradient_makes_merge_differentiable():
    """Attention over two key blocks merged with attnkit.merge has the gradients of
    attention over all keys: the lse output carries its gradient."""
    q, k, v = make((2, 2, 5, 4), (2, 2, 9, 4), seed=3)
    full = attnkit.attention(q, k, v, causal=True)
    gfull = torch.autograd.grad(full.square().sum(), (q, k, v))
    keep = torch_index_keep(5, 9, True, None, "bottom_right")    # causal, as a mask to slice
    parts = [attnkit.attention(q, k[..., s, :], v[..., s, :], keep=keep[:, s], return_lse=True)
             for s in (slice(0, 4), slice(4, 9))]
    out, _ = attnkit.merge([p[0] for p in parts], [p[1] for p in parts])
    assert max_error(out.detach(), full.detach()) <= 1e-12
    gmerged = torch.autograd.grad(out.square().sum(), (q, k, v))
    for x, y in zip(gmerged, gfull):
        assert max_error(x, y) <= 1e-12


# ---- peers: F.scaled_dot_product_attention and attnkit.reference ------------------------
SDPA_CASES = {
    "plain": dict(),
    "causal_top_left": dict(causal=True, align="top_left"),
    "causal_bottom_right": dict(causal=True),
    "window": dict(window=(2, 1)),
    "keep": dict(keep="keep"),
    "bias": dict(bias="bias"),
}


def sdpa_peer(q, k, v, L, S, kw):
    """SDPA with an additive mask built from torch.tril/triu and the raw keep/bias."""
    mask = None
    if kw.get("causal") or kw.get("window"):
        ik = torch_index_keep(L, S, kw.get("causal", False), kw.get("window"), kw.get("align", "bottom_right"))
        mask = torch.zeros(L, S, dtype=q.dtype).masked_fill(~ik, float("-inf"))
    if kw.get("keep") is not None:
        mask = torch.zeros(kw["keep"].shape, dtype=q.dtype).masked_fill(~kw["keep"], float("-inf"))
    if kw.get("bias") is not None:
        mask = kw["bias"] if mask is None else mask + kw["bias"]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[-3] != k.shape[-3])


@pytest.mark.parametrize("case", list(SDPA_CASES))
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.float64, 1e-12)])
def test_forward_and_backward_match_sdpa(case, dtype, tol):
    L, S = 6, 10
    q, k, v = make((2, 4, L, 16), (2, 2, S, 16), Dv=16, dtype=dtype, seed=4)
    kw = masks_for(case, L, S, 4, dtype) if case in ("keep", "bias") else dict(SDPA_CASES[case])
    ours = attnkit.attention(q, k, v, **kw)
    peer = sdpa_peer(q, k, v, L, S, kw)
    assert ours.dtype == dtype and ours.shape == peer.shape
    assert max_error(ours.detach(), peer.detach()) <= tol
    dout = torch.randn_like(ours)
    xs = (q, k, v) + ((kw["bias"],) if "bias" in kw else ())
    for a, b in zip(torch.autograd.grad(ours, xs, dout), torch.autograd.grad(peer, xs, dout)):
        assert a.shape == b.shape and max_error(a, b) <= 10 * tol


@pytest.mark.parametrize("kind", list(MaskKinds))
@pytest.mark.parametrize("L,S", [(7, 4), (1, 9), (15, 15)])
def test_forward_backward_weights_match_reference(kind, L, S):
    """Tensors through the torch rung against NumPy arrays through the reference rung:
    out, lse, weights, and attention_backward's gradients, float64."""
    q, k, v = make((2, 2, L, 5), (2, 1, S, 5), Dv=3, seed=5, grad=False)
    kw = masks_for(kind, L, S, 2)
    if "bias" in kw:
        kw["bias"] = kw["bias"].detach()
    npkw = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    out, lse, w = attnkit.attention(q, k, v, return_lse=True, return_weights=True, **kw)
    rout, rlse, rw = attnkit.attention(q.numpy(), k.numpy(), v.numpy(), return_lse=True, return_weights=True,
                                       backend="reference", **npkw)
    assert (out.dtype, lse.dtype, w.dtype) == (torch.float64,) * 3
    for a, b in ((out, rout), (lse, rlse), (w, rw)):
        assert isinstance(a, torch.Tensor) and max_error(a, b) <= 1e-12
    dout = torch.randn_like(out)
    grads = attnkit.attention_backward(dout, q, k, v, out, lse, **kw)
    rgrads = attnkit.attention_backward(dout.numpy(), q.numpy(), k.numpy(), v.numpy(), rout, rlse,
                                        backend="reference", **npkw)
    assert len(grads) == len(rgrads)
    for a, b in zip(grads, rgrads):
        assert isinstance(a, torch.Tensor) and a.shape == b.shape and max_error(a, b) <= 1e-12
    rows = sorted({0, L - 1})
    wr = attnkit.attention_weights(q, k, lse=lse, rows=rows, **kw)
    assert isinstance(wr, torch.Tensor) and max_error(wr, rw[..., rows, :]) <= 1e-12


def test_fully_masked_rows_give_zeros_and_minus_inf_without_nan():
    """L > S bottom-right causal: the first L - S rows see no key."""
    q, k, v = make((2, 6, 4), (2, 3, 4), seed=6)
    out, lse, w = attnkit.attention(q, k, v, causal=True, return_lse=True, return_weights=True)
    (out.sum() + lse[:, 3:].sum()).backward()
    assert torch.all(out[:, :3] == 0) and torch.all(lse[:, :3] == -np.inf) and torch.all(w[:, :3] == 0)
    assert torch.all(q.grad[:, :3] == 0)
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()


def test_gradients_of_a_block_with_global_out_and_lse():
    """attention_backward on a block of keys with the GLOBAL out and lse gives that
    block's share: dq sums over blocks, dk/dv are the slices (ring attention's use)."""
    q, k, v = make((1, 2, 5, 4), (1, 2, 8, 4), seed=7, grad=False)
    out, lse = attnkit.attention(q, k, v, return_lse=True)
    dout = torch.randn_like(out)
    dq, dk, dv = attnkit.attention_backward(dout, q, k, v, out, lse)
    parts = [attnkit.attention_backward(dout, q, k[..., s, :], v[..., s, :], out, lse)
             for s in (slice(0, 3), slice(3, 8))]
    assert max_error(parts[0][0] + parts[1][0], dq) <= 1e-12
    assert max_error(torch.cat([parts[0][1], parts[1][1]], -2), dk) <= 1e-12
    assert max_error(torch.cat([parts[0][2], parts[1][2]], -2), dv) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_dtypes(dtype):
    """out/weights keep q's dtype, lse is float32; bfloat16 (no NumPy dtype) runs
    upcast to float32; gradients come back in the inputs' dtypes, close to float64's."""
    q, k, v = make((2, 9, 16), (2, 13, 16), dtype=dtype, seed=8)
    bias = torch.randn(9, 13, dtype=dtype, requires_grad=True)
    out, lse, w = attnkit.attention(q, k, v, bias=bias, causal=True, return_lse=True, return_weights=True)
    assert (out.dtype, w.dtype, lse.dtype) == (dtype, dtype, torch.float32)
    oracle = attnkit.attention(*(x.detach().double().numpy() for x in (q, k, v)),
                               bias=bias.detach().double().numpy(), causal=True)
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    assert max_error(out.detach().float(), oracle) <= tol
    out.float().sum().backward()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype, bias.grad.dtype) == (dtype,) * 4
    assert bias.grad.shape == bias.shape
    x64 = [x.detach().double().requires_grad_() for x in (q, k, v, bias)]
    attnkit.attention(*x64[:3], bias=x64[3], causal=True).sum().backward()
    for got, want in zip((q, k, v, bias), x64):                 # the values, not only the dtypes
        scale = float(want.grad.abs().max()) + 1.0
        assert max_error(got.grad.double(), want.grad) <= 10 * tol * scale


def test_non_contiguous_inputs_and_broadcast_batch():
    base_q, k, v = make((2, 3, 7, 8), (1, 3, 5, 8), seed=9, grad=False)
    q = base_q.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_(True)   # strided
    assert not q.is_contiguous()
    kt = k.expand(2, 3, 5, 8)                                                          # stride 0
    out = attnkit.attention(q, kt, v, causal=True)
    ref = attnkit.attention(q.detach().numpy(), k.numpy(), v.numpy(), causal=True, backend="reference")
    assert out.shape == (2, 3, 7, 8) and max_error(out.detach(), ref) <= 1e-12
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_deterministic_bits():
    q, k, v = make((2, 4, 33, 16), (2, 4, 40, 16), dtype=torch.float32, seed=10)
    runs = []
    for _ in range(2):
        out = attnkit.attention(q, k, v, causal=True)
        runs.append((out,) + torch.autograd.grad(out.sum(), (q, k, v)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_weights_carry_no_gradient_and_bias_without_grad_gets_none():
    q, k, v = make((3, 4), (5, 4), seed=11)
    bias = torch.randn(3, 5, dtype=torch.float64)
    out, w = attnkit.attention(q, k, v, bias=bias, return_weights=True)
    assert out.requires_grad and not w.requires_grad
    out.sum().backward()
    assert bias.grad is None and q.grad is not None


def test_no_backend_error_lists_reasons():
    q = torch.randn(1, 2, 4, device="meta")
    with pytest.raises(ValueError, match=r"no backend can run this call(.|\n)*flash: runs on the CPU.*got device meta"):
        attnkit.attention(q, q, q)
    q, k, v = make((2, 4), (3, 4), grad=False)
    with pytest.raises(ValueError, match=r"keep: expected a tensor on q's device cpu, got meta"):
        attnkit.attention(q, k, v, keep=torch.ones(2, 3, dtype=torch.bool, device="meta"))
    with pytest.raises(TypeError, match="keep"):
        attnkit.attention(q, k, v, keep=torch.ones(2, 3))


def test_custom_ops_pass_opcheck():
    """Schema, fake (meta) implementation and autograd registration of the custom ops,
    with the flat arguments of one Spec (to_op_args / from_op_args round trip)."""
    from attnkit.spec import validate
    from attnkit.torch import op
    q, k, v = make((1, 2, 3, 4), (1, 1, 5, 4), Dv=2, dtype=torch.float32, seed=12)
    keep = torch.rand(3, 5) > 0.2
    bias = torch.randn(2, 3, 5, requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    spec = validate(q, k, v, keep=keep, bias=bias, scale=0.5, causal=True, window=(None, 1), align="top_left",
                    softcap=3.0, sinks=sinks, alibi_slopes=torch.tensor([0.5, 0.25]))
    args = op.to_op_args(spec, "flash")
    back, rung = op.from_op_args(args)
    assert rung == "flash" and back.window == spec.window and back.scale == spec.scale
    torch.library.opcheck(torch.ops.attnkit.attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out, lse, _ = torch.ops.attnkit.attention_fwd(*args)
    out, lse = out.detach(), lse.detach()
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    torch.library.opcheck(torch.ops.attnkit.attention_bwd.default, (dout, dlse, out, lse, True) + args,
                          test_utils=("test_schema", "test_faketensor"))
    detached = tuple(x.detach() if isinstance(x, torch.Tensor) else x for x in args)
    torch.library.opcheck(torch.ops.attnkit.attention_weights.default, (lse, torch.tensor([0, 2])) + detached,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_matches_eager():
    """A function calling attnkit compiles without graph breaks, forward and backward.
    backend="aot_eager" runs Dynamo (fullgraph: no graph breaks) and AOTAutograd over
    the ops' fake implementations, the parts attnkit provides; Inductor's code
    generation adds nothing about attnkit and takes long on 2 cores."""
    def f(q, k, v, keep, bias):
        out, lse = attnkit.attention(q, k, v, causal=True, window=(3, None), keep=keep, bias=bias,
                                     return_lse=True)
        return out.square().sum() + lse.sum()

    q, k, v = make((1, 2, 6, 8), (1, 1, 6, 8), dtype=torch.float32, seed=13)
    keep = torch.rand(6, 6) > 0.2
    bias = torch.randn(6, 6, requires_grad=True)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, keep, bias)
    g_got = torch.autograd.grad(got, (q, k, v, bias))
    want = f(q, k, v, keep, bias)
    g_want = torch.autograd.grad(want, (q, k, v, bias))
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)


def test_triton_rung_through_the_same_op(monkeypatch):
    """backend="triton" runs the same autograd op on the Triton kernels (on the CPU under
    TRITON_INTERPRET=1), out, lse and every gradient — lse's included — as the CPU path."""
    from attnkit.torch import triton as triton_rung
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if triton_rung.unavailable() is not None:
        pytest.skip(triton_rung.unavailable())
    q, k, v = make((1, 2, 5, 16), (1, 1, 7, 16), Dv=8, dtype=torch.float32, seed=14)
    bias = torch.randn(5, 7, requires_grad=True)
    res = []
    for backend in ("triton", "auto"):
        out, lse = attnkit.attention(q, k, v, causal=True, bias=bias, return_lse=True, backend=backend)
        res.append((out, lse) + torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v, bias)))
    for a, b in zip(*res):
        assert a.shape == b.shape and max_error(a.detach(), b.detach()) <= 1e-5


@pytest.mark.real_auto
def test_cpu_tensors_run_the_flash_rung_when_heads_are_large(monkeypatch):
    """Large calls go through flash (small ones through the small rung): forward and
    backward match the reference rung, and flash really ran."""
    from attnkit import flash
    calls = []
    for name in ("rung_forward", "rung_backward"):
        fn = getattr(flash, name)
        monkeypatch.setattr(flash, name, lambda *a, _fn=fn, _n=name, **kw: calls.append(_n) or _fn(*a, **kw))
    q, k, v = make((1, 2, 750, 8), (1, 1, 770, 8), Dv=5, seed=3)
    out = attnkit.attention(q, k, v, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert calls == ["rung_forward", "rung_backward"]
    qn, kn, vn = (x.detach().numpy() for x in (q, k, v))
    ref, lse = attnkit.attention(qn, kn, vn, causal=True, return_lse=True, backend="reference")
    assert max_error(out.detach().numpy(), ref) <= 1e-12
    want = attnkit.attention_backward(2 * ref, qn, kn, vn, ref, lse, causal=True, backend="reference")
    for g, w in zip(grads, want):
        assert max_error(g.numpy(), w) <= 1e-12


@pytest.mark.parametrize("seed", [2 ** 62 + 3, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 5, 2 ** 64 - 1])
def test_large_dropout_seeds_through_the_op_equal_the_numpy_rung(seed):
    """Seeds in [2⁶², 2⁶⁴) travel through the op as int64 (wrapped) and come back whole:
    the same dropped weights as the NumPy rung, forward and backward."""
    q, k, v = make((2, 7, 8), (2, 9, 8), seed=21)
    kw = dict(dropout=0.4, seed=seed, causal=True)
    out = attnkit.attention(q, k, v, **kw)
    want = attnkit.attention(*(x.detach().numpy() for x in (q, k, v)), **kw, backend="flash")
    assert max_error(out.detach().numpy(), want) <= 1e-12
    g = torch.autograd.grad(out.sum(), (q, k, v))
    spec_np = (x.detach().numpy() for x in (q, k, v))
    gw = attnkit.attention_backward(np.ones_like(want), *spec_np, want,
                                    attnkit.attention(*(x.detach().numpy() for x in (q, k, v)), **kw,
                                                      return_lse=True)[1], **kw)
    for a, b in zip(g, gw):
        assert max_error(a.numpy(), b) <= 1e-12


def test_a_backward_through_lse_alone():
    """A loss of lse only (out unused: autograd hands the op no dout) gets lse's
    gradients, the same as with out's gradient zero."""
    q, k, v = make((1, 2, 5, 4), (1, 2, 7, 4), seed=22)
    _, lse = attnkit.attention(q, k, v, causal=True, return_lse=True)
    g = torch.autograd.grad(lse.square().sum(), (q, k, v), allow_unused=True)
    out, lse = attnkit.attention(q, k, v, causal=True, return_lse=True)
    want = torch.autograd.grad(lse.square().sum() + (out * 0).sum(), (q, k, v))
    assert all(a is not None and torch.equal(a, b) for a, b in zip(g[:2], want[:2]))
    assert g[2] is None or torch.equal(g[2], want[2])


def test_attention_weights_through_the_op_with_rows_lse_and_torch_compile():
    """attention_weights on torch tensors: rows, a given lse (a key block's weights with
    the whole's lse are its share of the whole's), the fake implementation's shapes
    with and without rows, and torch.compile."""
    from attnkit.torch import op
    q, k, v = make((1, 3, 6, 4), (1, 3, 8, 4), dtype=torch.float32, seed=23, grad=False)
    kw = dict(causal=True, align="top_left")
    out, lse = attnkit.attention(q, k, v, **kw, return_lse=True)
    w = attnkit.attention_weights(q, k, **kw)
    assert w.shape == (1, 3, 6, 8)
    assert max_error(attnkit.attention_weights(q, k, **kw, rows=[4, 1]).numpy(), w[..., [4, 1], :].numpy()) <= 1e-6
    block = attnkit.attention_weights(q, k[..., :5, :], lse=lse, **kw)
    assert max_error(block.numpy(), w[..., :5].numpy()) <= 1e-6
    assert not torch.allclose(block, attnkit.attention_weights(q, k[..., :5, :], **kw))
    from attnkit.spec import validate
    args = op.to_op_args(validate(q, k, None, need_v=False, **kw), "flash")
    for rows in (None, torch.tensor([0, 5, 2])):
        torch.library.opcheck(torch.ops.attnkit.attention_weights.default, (lse, rows) + args,
                              test_utils=("test_schema", "test_faketensor"))

    def f(q, k, rows):
        return attnkit.attention_weights(q, k, causal=True, align="top_left", rows=rows).sum(-1)

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, None)
    assert got.shape == (1, 3, 6) and torch.allclose(got, f(q, k, None))
    got = torch.compile(f, backend="aot_eager")(q, k, [3, 0])           # rows: graph breaks allowed
    assert got.shape == (1, 3, 2) and torch.allclose(got, f(q, k, [3, 0]))


def test_python_int_rows_of_a_torch_call_are_checked_like_numpy_rows():
    """Python-int rows of a torch call take their own path (kept constant under
    torch.compile): the same rows, the same named errors."""
    q, k, _ = make((1, 2, 3, 4), (1, 2, 5, 4), dtype=torch.float32, seed=28, grad=False)
    full = attnkit.attention_weights(q, k)
    assert torch.allclose(attnkit.attention_weights(q, k, rows=[-3, 2]), full[..., [0, 2], :], atol=1e-6, rtol=0)
    assert torch.allclose(attnkit.attention_weights(q, k, rows=(1,)), full[..., [1], :], atol=1e-6, rtol=0)
    assert torch.allclose(attnkit.attention_weights(q, k, rows=-1), full[..., [2], :], atol=1e-6, rtol=0)
    assert attnkit.attention_weights(q, k, rows=[]).shape == (1, 2, 0, 5)
    for rows, err in (([-4, 0], ValueError), ([0, 3], ValueError), (3, ValueError), ([True], TypeError),
                      ([0.5], TypeError), ([[0]], TypeError)):
        with pytest.raises(err, match=r"^rows\b"):
            attnkit.attention_weights(q, k, rows=rows)


def test_attention_weights_with_rows_compiles_without_graph_breaks():
    q, k, _ = make((1, 2, 5, 4), (1, 2, 6, 4), dtype=torch.float32, seed=26, grad=False)

    def f(q, k):
        return attnkit.attention_weights(q, k, rows=[3, 0]).sum(-1)

    f(q, k)                                              # warm: the torch bridge is imported
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k)
    assert torch.allclose(got, f(q, k))


def test_backward_op_outputs_match_its_fake_without_sinks_or_bias_gradient():
    """The backward op's placeholders (no sinks; a bias whose gradient is not wanted)
    have the fake implementation's shapes."""
    from attnkit.spec import validate
    from attnkit.torch import op
    q, k, v = make((1, 2, 3, 4), (1, 2, 5, 4), dtype=torch.float32, seed=24, grad=False)
    bias = torch.randn(3, 5)
    for kw in (dict(), dict(bias=bias)):
        args = op.to_op_args(validate(q, k, v, causal=True, **kw), "flash")
        out, lse, _ = torch.ops.attnkit.attention_fwd(*args)
        torch.library.opcheck(torch.ops.attnkit.attention_bwd.default,
                              (torch.randn_like(out), None, out, lse, False) + args,
                              test_utils=("test_schema", "test_faketensor"))
        g = torch.ops.attnkit.attention_bwd(torch.randn_like(out), None, out, lse, False, *args)
        assert g[3].numel() == 0 and g[4].numel() == 0


def test_blocks_of_a_larger_problem_through_the_op():
    """A block with origin and extent (ring attention on torch tensors) is computed at
    its global positions, as on NumPy arrays."""
    from attnkit import flash
    from attnkit.spec import Spec
    from attnkit.torch import op
    q, k, v = make((1, 2, 4, 8), (1, 1, 6, 8), seed=25, grad=False)
    kw = dict(causal=True, alibi_slopes=np.array([0.3, 0.7]), dropout=0.25, seed=9, origin=(5, 2), extent=(12, 10))
    blk = Spec.from_arrays(q, k, v, scale=0.3, **dict(kw, alibi_slopes=torch.tensor(kw["alibi_slopes"])))
    out, lse, _ = op.bound(flash).rung_forward(blk)
    want = flash.rung_forward(Spec.from_arrays(*(x.numpy() for x in (q, k, v)), scale=0.3, **kw))
    assert max_error(out.numpy(), want[0]) <= 1e-12 and max_error(lse.numpy(), want[1]) <= 1e-12


FIRST_CALL_COMPILED = r"""
import torch, attnkit
q = torch.randn(1, 2, 5, 4)
f = torch.compile(lambda q: attnkit.attention(q, q, q, causal=True), fullgraph=True, backend="aot_eager")
assert torch.allclose(f(q), attnkit.attention(q, q, q, causal=True))
print("ok")
"""
# the op imported, the rungs not yet: dynamic shapes and gradients (Dynamo traces the
# rung's import, then restarts; a different path the second time is an error)
FIRST_CALL_COMPILED_DYNAMIC = r"""
import torch, attnkit, attnkit.torch
f = torch.compile(lambda q, k: attnkit.attention(q, k, k, causal=True), fullgraph=True, backend="aot_eager",
                  dynamic=True)
q, k = torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 7, 8, requires_grad=True)
assert torch.allclose(f(q, k), attnkit.attention(q, k, k, causal=True))
print("ok")
"""


@pytest.mark.real_auto
@pytest.mark.parametrize("script", [FIRST_CALL_COMPILED, FIRST_CALL_COMPILED_DYNAMIC])
def test_the_first_call_of_a_process_may_be_compiled(script):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_only_dropout_without_a_seed_draws_from_torchs_generator():
    """A call without dropout leaves torch's global generator untouched; dropout without
    a seed draws one from it (so torch.manual_seed makes it reproducible)."""
    q, k, v = make((1, 2, 4, 8), (1, 2, 6, 8), seed=27, grad=False)
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    attnkit.attention(q, k, v, causal=True)
    attnkit.attention(q, k, v, dropout=0.0, seed=None)
    assert torch.equal(torch.rand(3), want)
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(attnkit.attention(q, k, v, dropout=0.5))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(torch.rand(3), want)


def test_three_d_inputs_match_the_fake_implementations():
    """Inputs without batch dims (H, L, D): the fake (meta) shapes of the forward and
    weights ops are the real ones (torch.compile traces with them)."""
    from attnkit.spec import validate
    from attnkit.torch import op
    q, k, v = make((2, 3, 4), (2, 5, 4), Dv=6, dtype=torch.float32, seed=28, grad=False)
    args = op.to_op_args(validate(q, k, v, causal=True), "flash")
    torch.library.opcheck(torch.ops.attnkit.attention_fwd.default, args, test_utils=("test_schema", "test_faketensor"))
    out, lse, _ = torch.ops.attnkit.attention_fwd(*args)
    assert out.shape == (2, 3, 6) and lse.shape == (2, 3)
    wargs = op.to_op_args(validate(q, k, None, need_v=False, causal=True), "flash")
    torch.library.opcheck(torch.ops.attnkit.attention_weights.default, (lse, None) + wargs,
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_cpu_kvcache_takes_tensors_needing_grad_under_no_grad_and_returns_tensors():
    q = torch.randn(1, 2, 1, 8, requires_grad=True)
    kc, vc = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8)
    with torch.no_grad():
        out, lse = attnkit.attention_kvcache(q, kc, vc, torch.tensor([4]), return_lse=True)
    assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    want = attnkit.attention(q.detach(), kc[..., :4, :], vc[..., :4, :])
    assert torch.allclose(out, want, atol=1e-6)


def test_a_rung_on_torch_tensors_gets_the_ops_arguments_as_tensors(monkeypatch):
    """A rung that computes on torch tensors (Triton's kind: arrays = "torch") gets the
    tensors themselves through the ops — rows included — and its results back as they are."""
    from types import SimpleNamespace

    from attnkit import flash
    from attnkit.spec import validate
    from attnkit.torch import op
    seen = {}

    def rung_weights(spec, lse, rows):
        seen.update(q=spec.q, lse=lse, rows=rows)
        return torch.zeros(spec.batch + (spec.H, spec.L if rows is None else len(rows), spec.S))

    def rung_kvcache(kv):
        seen.update(kv=kv)
        return "out", "lse"

    fake = SimpleNamespace(name="fake", arrays="torch", rung_weights=rung_weights, rung_kvcache=rung_kvcache,
                           not_supported_reasons=lambda spec: [])
    monkeypatch.setattr(op, "_rung", lambda name: fake)
    q, k, _ = make((1, 2, 4, 8), (1, 2, 6, 8), dtype=torch.float32, seed=29, grad=False)
    spec = validate(q, k, None, need_v=False)
    rung = op.TorchRung(fake)
    w = rung.rung_weights(spec, None, np.array([3, 1]))
    assert w.shape == (1, 2, 2, 6) and seen["lse"] is None and isinstance(seen["q"], torch.Tensor)
    assert seen["rows"].tolist() == [3, 1]
    rung.rung_weights(spec, torch.zeros(1, 2, 4), None)
    assert seen["rows"] is None and isinstance(seen["lse"], torch.Tensor)
    kv = SimpleNamespace(spec=spec)
    assert rung.rung_kvcache(kv) == ("out", "lse") and seen["kv"] is kv
    assert op.bound(flash).name == "torch (flash)" and op.bound(flash) is op.bound(flash)


@pytest.mark.parametrize("how", ["func.jvp", "forward_ad", "forward_ad with grad"])
def test_forward_mode_ad_is_refused_not_lost(how):
    """The op has no forward-mode derivative: a tangent through it must raise, never
    come back as zeros or None (the NumPy rung would see only the primal values)."""
    import torch.autograd.forward_ad as fwAD
    q, k, v = (torch.randn(1, 2, 4, 8, dtype=torch.float64) for _ in range(3))
    with pytest.raises(NotImplementedError, match="forward-mode"):
        if how == "func.jvp":
            torch.func.jvp(lambda x: attnkit.attention(x, k, v), (q,), (torch.randn_like(q),))
        else:
            with fwAD.dual_level():
                attnkit.attention(fwAD.make_dual(q, torch.randn_like(q)), k.requires_grad_(how.endswith("grad")), v)
    if how == "forward_ad":                              # KV-cache decoding (forward only) too
        with pytest.raises(NotImplementedError, match="forward-mode"), fwAD.dual_level():
            attnkit.attention_kvcache(fwAD.make_dual(q, torch.randn_like(q)), k, v, torch.tensor([3]))
    with fwAD.dual_level():                              # a dual level with no tangent among the inputs: fine
        assert attnkit.attention(q, k, v).shape == (1, 2, 4, 8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_backward_reads_the_float32_output(dtype):
    """rowsum(dout ∘ out) comes from the float32 out the CPU rung computed, not from
    out rounded to q's dtype: a bias broadcast over keys has gradient exactly 0
    (softmax ignores a shift of a row), which the rounded out made 7e-3 in bfloat16.
    The op's fake has the extra output (compiled, the same gradients)."""
    from attnkit.spec import validate
    from attnkit.torch import op
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, n, 8, generator=g).to(dtype).requires_grad_() for n in (11, 17, 17))
    bias = torch.randn(1, 1, 11, 1, generator=g).to(dtype).requires_grad_()
    dout = torch.randn(2, 3, 11, 8, generator=g).to(dtype)

    def grads(fn):
        out = fn(q, k, v, bias)
        return torch.autograd.grad(out, (q, k, v, bias), dout)

    eager = grads(lambda *a: attnkit.attention(*a[:3], bias=a[3]))
    assert eager[3].float().abs().max() <= 1e-5
    compiled = grads(torch.compile(lambda *a: attnkit.attention(*a[:3], bias=a[3]), fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
    args = op.to_op_args(validate(q, k, v, bias=bias), "flash")
    torch.library.opcheck(torch.ops.attnkit.attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("compiled", [False, True])
def test_autocast_hands_the_op_its_dtype_as_for_sdpa(compiled):
    """Under torch.autocast, q, k and v run in autocast's dtype, as SDPA's do: a float32
    q and k next to a bfloat16 v (a model's rotary embedding) is one bfloat16 call, and
    float64 is left alone. Gradients reach the float32 inputs in float32."""
    q, k = (torch.randn(2, 4, 5, 8, requires_grad=True), torch.randn(2, 2, 7, 8, requires_grad=True))
    v = torch.randn(2, 2, 7, 8).bfloat16().requires_grad_()
    def f(q, k, v):
        return attnkit.attention(q, k, v, causal=True)
    if compiled:
        torch._dynamo.reset()                            # no graph of another rung's test run
        f = torch.compile(f, fullgraph=True, backend="aot_eager")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = f(q, k, v)
        q64, k64 = (x.detach().double() for x in (q, k))
        assert f(q64, k64, k64).dtype == torch.float64
    want = attnkit.attention(q.detach().bfloat16(), k.detach().bfloat16(), v.detach(), causal=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    out.float().sum().backward()
    assert q.grad.dtype == k.grad.dtype == torch.float32 and v.grad.dtype == torch.bfloat16
    assert f(q.detach(), k.detach(), v.detach().float()).dtype == torch.float32   # autocast off


def test_vmap_over_lengths_is_a_named_error():
    """Lengths are read on the host to check them; inside torch.func.vmap a batched
    tensor has no values to read: a TypeError naming the argument, not an internal
    RuntimeError."""
    q = torch.randn(3, 2, 4, 8)
    lengths = torch.tensor([[4], [2], [3]])
    with pytest.raises(TypeError, match="^kv_lengths"):
        torch.func.vmap(lambda a, n: attnkit.attention(a, a, a, kv_lengths=n))(q[:, None], lengths)


@pytest.mark.parametrize("paged", [False, True])
def test_a_decoding_loop_compiles_whole(paged):
    """attention_kvcache under torch.compile(fullgraph=True): one op that writes the
    cache and attends when the graph runs — the same bits and the same cache as eager
    calls; a bad length is the same named error, raised when the graph runs."""
    torch._dynamo.reset()
    B, H, Hkv, D, Dv, P = 2, 4, 2, 8, 5, 4
    shape = (6, Hkv, P) if paged else (B, Hkv, 12)
    table = torch.tensor([[4, 1, 0], [2, 5, 3]]) if paged else None
    caches = {name: (torch.zeros(shape + (D,)), torch.zeros(shape + (Dv,))) for name in ("compiled", "eager")}

    def step(q, kc, vc, n, kn, vn):
        return attnkit.attention_kvcache(q, kc, vc, n, block_table=table, k_new=kn, v_new=vn, causal=True,
                                         window=(3, None), sinks=torch.tensor([0.5, -1.0, 0.0, 2.0]),
                                         return_lse=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=True)
    n = torch.tensor([0, 3])
    for i in range(4):
        g = torch.Generator().manual_seed(i)
        q, kn, vn = (torch.randn(s, generator=g) for s in ((B, H, 2, D), (B, Hkv, 2, D), (B, Hkv, 2, Dv)))
        got = compiled(q, *caches["compiled"], n, kn, vn)
        want = step(q, *caches["eager"], n, kn, vn)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        n = n + 2
    assert all(torch.equal(a, b) for a, b in zip(caches["compiled"], caches["eager"]))
    before = [c.clone() for c in caches["compiled"]]
    with pytest.raises(ValueError, match="^cache_lengths"):
        compiled(q, *caches["compiled"], torch.tensor([0, 11]), kn, vn)     # 11 + 2 keys > 12 slots
    assert all(torch.equal(a, b) for a, b in zip(caches["compiled"], before))


def test_a_compiled_decoding_call_takes_one_int_length():
    """cache_lengths as one int under torch.compile(fullgraph=True): the op gets it as
    (B,) — the same bits as the eager call with a (B,) tensor."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, kc, vc = torch.randn(2, 2, 1, 4, generator=g), torch.randn(2, 1, 8, 4, generator=g), torch.randn(2, 1, 8, 4)
    f = torch.compile(lambda q, kc, vc: attnkit.attention_kvcache(q, kc, vc, 5), fullgraph=True, backend="aot_eager")
    assert torch.equal(f(q, kc, vc), attnkit.attention_kvcache(q, kc, vc, torch.tensor([5, 5])))


def test_a_traced_decoding_call_is_checked_like_an_eager_one():
    """While tracing, every argument but the lengths' values is checked as in an eager
    call (a seed out of range, a NumPy sinks array, a window side past 2**30)."""
    torch._dynamo.reset()
    q, kc, vc = torch.randn(1, 2, 1, 4), torch.zeros(1, 1, 8, 4), torch.zeros(1, 1, 8, 4)
    n = torch.tensor([3])
    bad = [("seed", dict(dropout=0.5, seed=-1)), ("sinks", dict(sinks=np.array([0.1, 0.2]))),
           ("scale", dict(scale="x"))]
    for name, kw in bad:
        f = torch.compile(lambda q, kc, vc, n, kw=kw: attnkit.attention_kvcache(q, kc, vc, n, **kw),
                          fullgraph=True, backend="eager")
        with pytest.raises(Exception) as e:
            f(q, kc, vc, n)
        chain, err = [], e.value
        while err is not None:
            chain.append(err)
            err = err.__cause__ or err.__context__
        assert any(f"{name}: expected" in str(x) for x in chain), chain   # Dynamo wraps the named error
    f = torch.compile(lambda q, kc, vc, n: attnkit.attention_kvcache(q, kc, vc, n, window=(2**70, 0)),
                      fullgraph=True, backend="eager")
    assert torch.equal(f(q, kc, vc, n), attnkit.attention_kvcache(q, kc, vc, n, window=(None, 0)))


def test_an_inference_tensor_cache_outside_inference_mode_is_named():
    with torch.inference_mode():
        vc = torch.zeros(1, 1, 4, 2)
    kc, new = torch.zeros(1, 1, 4, 2), torch.ones(1, 1, 1, 2)
    with pytest.raises(ValueError, match="^v_cache"):
        attnkit.attention_kvcache(torch.ones(1, 1, 1, 2), kc, vc, torch.tensor([0]), k_new=new, v_new=new)
    assert not kc.any()


def test_importing_attnkit_torch_registers_every_op():
    """In a fresh process, ``import attnkit.torch`` alone registers the ops its doc
    names (a saved graph that uses one runs without a traced call first)."""
    import subprocess
    import sys
    code = ("import torch, attnkit.torch; print(all(hasattr(torch.ops.attnkit, n) for n in "
            "('attention_fwd', 'attention_bwd', 'attention_weights', 'attention_kvcache')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.stdout.strip() == "True", run.stderr


def test_the_kvcache_op_passes_torchs_checks():
    """Schema (the cache written, declared) and fake tensors (the out's Dv, lse's dtype)
    against the real op."""
    q, kc, vc = torch.randn(2, 4, 1, 8), torch.zeros(2, 2, 6, 8), torch.zeros(2, 2, 6, 5)
    args = (q, kc, vc, torch.tensor([2, 3]), None, torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 5),
            None, True, 3, None, "bottom_right", None, None, None, torch.tensor([1, 0]), None, 0.0, None, "auto")
    torch.library.opcheck(torch.ops.attnkit.attention_kvcache.default, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("window", [(2, 0), (None, 0), (0, None)])
def test_a_compiled_decoding_call_keeps_each_window_side(window):
    """The window crosses the op as two ints: each side, without causal, with L = 3
    rows (one row would hide a side)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q, kc, vc = (torch.randn(s, generator=g) for s in ((1, 2, 3, 4), (1, 1, 8, 4), (1, 1, 8, 4)))
    n = torch.tensor([6])
    def f(q, kc, vc, n):
        return attnkit.attention_kvcache(q, kc, vc, n, window=window)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(q, kc, vc, n), f(q, kc, vc, n))



@pytest.mark.parametrize("rung", ["reference", "small", "flash"])
@pytest.mark.parametrize("bad", [dict(kv_lengths=[3, 9000000]), dict(q_lengths=[-5, 1]),
                                 dict(kv_starts=[-2000000, 0]), dict(kv_starts=[2, 0], kv_lengths=[1, 3])],
                         ids=["kv_lengths", "q_lengths", "kv_starts", "starts-past-lengths"])
def test_a_compiled_call_checks_its_sequences_when_it_runs(bad, rung):
    """torch.compile traces without reading the lengths' values; the op checks them when
    the graph runs (out-of-range lengths had the NumPy rungs read outside the arrays:
    a segmentation fault) with attention's own error."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 2, 3, 8) for _ in range(3))
    kw = {n: torch.tensor(x) for n, x in bad.items()}
    f = torch.compile(lambda q, k, v, kw: attnkit.attention(q, k, v, backend=rung, **kw), fullgraph=True,
                      backend="eager")
    with pytest.raises(ValueError, match=f"^{next(iter(bad)) if len(bad) == 1 else 'kv_starts'}: "):
        f(q, k, v, kw)
