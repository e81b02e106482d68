"""The torch op with the newer terms — per-sequence lengths, packed sequences, sinks,
ALiBi, dropout — against the reference rung (float64 ≤ 1e-12, gradients by autograd,
dsinks included), dropout seeded from torch's generator, and torch.compile(fullgraph)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402
import attnkit.torch  # noqa: E402
from attnkit import reference  # noqa: E402
from attnkit.spec import validate  # noqa: E402
from attnkit.testing import make_qkv, max_error  # noqa: E402

TERMS = {
    "lengths": lambda: dict(causal=True, q_lengths=np.array([5, 2]), kv_lengths=np.array([9, 3])),
    "kv_lengths_top_left": lambda: dict(causal=True, align="top_left", kv_lengths=np.array([4, 9])),
    "sinks_per_head": lambda: dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])),
    "sinks_per_row": lambda: dict(sinks=np.random.default_rng(3).standard_normal((2, 4, 6)), causal=True),
    "alibi": lambda: dict(alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), causal=True),
    "dropout": lambda: dict(dropout=0.3, seed=42, causal=True),
    "everything": lambda: dict(dropout=0.2, seed=7, alibi_slopes=np.array([0.3, 0.1, 0.2, 0.4]),
                               sinks=np.array([0.1, 0.2, 0.3, 0.4]), kv_lengths=np.array([8, 5]), window=(4, 1)),
}


def tensors(kw):
    return {n: torch.tensor(x) if isinstance(x, np.ndarray) else x for n, x in kw.items()}


@pytest.mark.parametrize("name", list(TERMS))
def test_forward_and_autograd_match_the_reference(name):
    kw = TERMS[name]()
    q, k, v = make_qkv((2, 4, 6, 8), (2, 2, 9, 8), 5, seed=11)
    spec = validate(q, k, v, **kw)
    out, lse, _ = reference.rung_forward(spec)
    dout = np.random.default_rng(4).standard_normal(out.shape)
    want = reference.rung_backward(spec, dout, out, lse)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tkw = tensors(kw)
    if "sinks" in tkw:
        tkw["sinks"].requires_grad_(True)
    tout, tlse = attnkit.attention(tq, tk, tv, return_lse=True, **tkw)
    assert max_error(tout.detach().numpy(), out) <= 1e-12 and max_error(tlse.detach().numpy(), lse) <= 1e-12
    inputs = (tq, tk, tv) + ((tkw["sinks"],) if "sinks" in tkw else ())
    grads = torch.autograd.grad(tout, inputs, torch.tensor(dout))
    expected = want[:3] + ((want.dsinks,) if "sinks" in tkw else ())
    for g, w in zip(grads, expected):
        assert g.shape == w.shape and max_error(g.numpy(), w) <= 1e-12


def test_packed_sequences_through_the_op():
    cu = np.array([0, 3, 3, 8])
    q, k, v = make_qkv((2, 8, 4), (1, 8, 4), seed=12)
    want = attnkit.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, backend="reference")
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    got = attnkit.attention(tq, tk, tv, cu_seqlens_q=torch.tensor(cu), cu_seqlens_k=torch.tensor(cu), causal=True)
    assert max_error(got.detach().numpy(), want) <= 1e-12
    got.sum().backward()
    assert tk.grad.shape == tk.shape


def test_dropout_backward_is_the_gradient_of_the_masked_computation():
    """With a fixed seed the op's gradient equals autograd of the same computation
    written out: softmax, the kept-entries mask from attnkit.philox, scaled by 1/(1-p)."""
    from attnkit import philox
    q, k, v = make_qkv((1, 2, 7, 4), (1, 2, 9, 4), seed=13)
    p, seed = 0.4, 5
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = attnkit.attention(tq, tk, tv, dropout=p, seed=seed)
    g_ours = torch.autograd.grad(out.square().sum(), (tq, tk, tv))
    kept = torch.tensor(philox.kept(seed, p, np.arange(2)[None, :, None, None], np.arange(7)[None, None, :, None],
                                    np.arange(9)[None, None, None, :]))
    eq, ek, ev = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    w = torch.softmax(eq @ ek.transpose(-1, -2) / 2.0, -1)
    manual = (w * kept / (1 - p)) @ ev
    assert (manual - out).abs().max() <= 1e-12
    g_manual = torch.autograd.grad(manual.square().sum(), (eq, ek, ev))
    for a, b in zip(g_ours, g_manual):
        assert (a - b).abs().max() <= 1e-12


def test_dropout_without_a_seed_follows_torch_manual_seed():
    q, k, v = (torch.randn(1, 2, 16, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    runs = []
    for s in (1, 1, 2):
        torch.manual_seed(s)
        runs.append(attnkit.attention(q, k, v, dropout=0.5))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    assert not torch.equal(runs[0], attnkit.attention(q, k, v))


def test_torch_compile_fullgraph_with_the_new_terms():
    q, k, v = (torch.randn(2, 4, 6, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
               for i in range(3))
    sinks = torch.randn(4, requires_grad=True)
    lengths = torch.tensor([6, 3])
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])

    def f(q, k, v, sinks):
        return attnkit.attention(q, k, v, sinks=sinks, kv_lengths=lengths, alibi_slopes=slopes, causal=True,
                                 dropout=0.25, seed=3)

    eager = f(q, k, v, sinks)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    assert torch.equal(eager, compiled)
    ge = torch.autograd.grad(eager.sum(), (q, k, v, sinks))
    gc = torch.autograd.grad(compiled.sum(), (q, k, v, sinks))
    assert all(torch.equal(a, b) for a, b in zip(ge, gc))



def _each_alone(q, k, v, dout, rows_keys, kw):
    """out and (dq, dk, dv) of each sequence attended alone (its rows and keys slices,
    its block of a (rows, keys) bias), put back in place: the loop packed and padded
    calls must equal."""
    out = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype)
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for b, rows, keys in rows_keys:
        xs = [x[b][..., r, :].detach().clone().requires_grad_() for x, r in ((q, rows), (k, keys), (v, keys))]
        one = {n: (x[rows, keys] if n == "bias" else x) for n, x in kw.items()}
        o = attnkit.attention(*xs, backend="reference", **one)
        out[b][..., rows, :] = o.detach()
        for g, r, d in zip(grads, (rows, keys, keys), torch.autograd.grad(o, xs, dout[b][..., rows, :])):
            g[b][..., r, :] += d
    return out, grads


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("how", ["packed", "lengths"])
def test_packed_and_padded_through_the_op_equal_each_sequence_alone(how, compiled):
    """Through the op — eagerly and under torch.compile(fullgraph=True) — packed
    sequences (a batch dim of 1, GQA, a bias in packed coordinates, softcap) and
    q_lengths with kv_lengths (a window): out and autograd's dq, dk, dv equal each
    sequence attended alone (float64 ≤ 1e-12); padding rows give 0 and no gradient."""
    gen = torch.Generator().manual_seed(21)
    if how == "packed":
        cq, ck = torch.tensor([0, 3, 3, 8, 12]), torch.tensor([0, 4, 6, 12, 16])
        shapes, dv = ((1, 4, 12, 8), (1, 2, 16, 8)), 5
        kw = dict(causal=True, bias=torch.randn(12, 16, generator=gen, dtype=torch.float64), softcap=3.0)
        offsets = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
        rows_keys = [(0, slice(int(cq[i]), int(cq[i + 1])), slice(int(ck[i]), int(ck[i + 1]))) for i in range(4)
                     if cq[i + 1] > cq[i]]
    else:
        ql, kl = torch.tensor([10, 3, 0]), torch.tensor([12, 5, 4])
        shapes, dv = ((3, 4, 10, 8), (3, 2, 12, 8)), 8
        kw = dict(causal=True, window=(3, None))
        offsets = dict(q_lengths=ql, kv_lengths=kl)
        rows_keys = [(b, slice(0, int(ql[b])), slice(0, int(kl[b]))) for b in range(3) if ql[b] > 0]
    q = torch.randn(*shapes[0], generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(*shapes[1], generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(*shapes[1][:-1], dv, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(*shapes[0][:-1], dv, generator=gen, dtype=torch.float64)

    def f(q, k, v, offsets):
        return attnkit.attention(q, k, v, **offsets, **kw)
    run = torch.compile(f, fullgraph=True, backend="aot_eager") if compiled else f
    out = run(q, k, v, offsets)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want, want_grads = _each_alone(q, k, v, dout, rows_keys, kw)
    assert (out - want).abs().max() <= 1e-12
    assert all((g - w).abs().max() <= 1e-12 for g, w in zip(grads, want_grads))

def test_tensors_that_would_get_no_gradient_are_refused_while_grad_is_on():
    """No silent holes in autograd: slopes that require grad (attnkit has no ALiBi
    gradient) and attention_kvcache (forward only) raise a TypeError naming the
    argument; under torch.no_grad() both run."""
    q = torch.randn(1, 2, 4, 8)
    slopes = torch.tensor([0.5, 0.25], requires_grad=True)
    with pytest.raises(TypeError, match="^alibi_slopes: attnkit computes no gradient"):
        attnkit.attention(q, q, q, alibi_slopes=slopes)
    cache = torch.zeros(1, 2, 8, 8)
    with pytest.raises(TypeError, match="^q: attention_kvcache is forward only"):
        attnkit.attention_kvcache(q.clone().requires_grad_(), cache, cache, torch.tensor([3]))
    with torch.no_grad():
        assert attnkit.attention(q, q, q, alibi_slopes=slopes).shape == (1, 2, 4, 8)
        assert attnkit.attention_kvcache(q.clone().requires_grad_(), cache, cache, torch.tensor([3])).shape == \
            (1, 2, 4, 8)


NUMBERS = [dict(bias=0.1), dict(sinks=-0.3), dict(alibi_slopes=0.25, causal=True), dict(keep=False),
           dict(drop=np.False_), dict(kv_lengths=3, causal=True), dict(q_lengths=np.int32(2), kv_lengths=7)]


@pytest.mark.parametrize("kw", NUMBERS, ids=lambda kw: "-".join(kw))
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_numbers_for_array_keywords_mean_what_they_mean_in_numpy(kw, dtype):
    """A Python or NumPy scalar number for an array keyword of a torch call (kv_lengths=3,
    keep=False, bias=0.1) is the 0-d array a NumPy call reads (it was a TypeError): the
    same output bits as the NumPy call, forward and the gradients by autograd; floats
    in the accumulation dtype (a float32 bias 0.1 would differ from float64's)."""
    q, k, v = (x.astype(dtype) for x in make_qkv((2, 4, 5, 8), (2, 2, 9, 8), 8, seed=2))
    want = attnkit.attention(q, k, v, **kw)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    got = attnkit.attention(tq, tk, tv, **kw)
    assert np.array_equal(got.detach().numpy(), want)
    got.backward(torch.ones_like(got))
    spec = validate(q, k, v, **kw)
    out, lse, _ = attnkit.flash.rung_forward(spec)
    grads = attnkit.flash.rung_backward(spec, np.ones_like(out), out, lse)
    for t, g in zip((tq, tk, tv), grads[:3]):
        assert max_error(t.grad.numpy(), g) <= (1e-12 if dtype == "float64" else 1e-5)


def test_numbers_for_array_keywords_compile_and_keep_one_library_per_call():
    """kv_lengths=3 and sinks=0.5 inside torch.compile(fullgraph=True) give the eager
    bits, for attention and for attention_kvcache (whose traced op takes the options
    as tensors); a NumPy 0-d array with torch tensors is still refused (one library
    per call)."""
    torch._dynamo.reset()
    q, k, v = (torch.tensor(x) for x in make_qkv((2, 4, 5, 8), (2, 2, 9, 8), 8, seed=2))
    f = torch.compile(lambda q, k, v: attnkit.attention(q, k, v, kv_lengths=3, sinks=0.5), fullgraph=True,
                      backend="aot_eager")
    assert torch.equal(f(q, k, v), attnkit.attention(q, k, v, kv_lengths=torch.tensor(3), sinks=torch.tensor(0.5)))
    n = torch.tensor([6, 9])
    g = torch.compile(lambda q, k, v, n: attnkit.attention_kvcache(q, k, v, n, sinks=0.5, alibi_slopes=0.25),
                      fullgraph=True, backend="aot_eager")
    want = attnkit.attention_kvcache(q, k, v, n, sinks=torch.tensor(0.5), alibi_slopes=torch.tensor(0.25))
    assert torch.equal(g(q, k, v, n), want)
    with pytest.raises(TypeError, match="^kv_lengths: expected a torch.Tensor like q"):
        attnkit.attention(q, k, v, kv_lengths=np.array(3))
