"""out's memory layout for torch tensors: queries whose heads lie inner in memory
(transformers' (B, L, H, D) seen as (B, H, L, D)) give out in that layout outside the
custom op, as PyTorch SDPA does, so transformers' transpose back costs no copy; the
op itself (autograd, torch.compile) keeps contiguous outputs, as its fake says."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnkit  # noqa: E402
from attnkit.backends import select  # noqa: E402
from attnkit.spec import validate  # noqa: E402
from attnkit.spec.core import heads_inner  # noqa: E402


def _blhd(*shape):
    """A (B, H, L, D) view of a (B, L, H, D) tensor."""
    B, H, L, D = shape
    return torch.randn(B, L, H, D, generator=torch.Generator().manual_seed(L * H)).transpose(1, 2)


@pytest.mark.parametrize("case", ["flash", "small", "GQA causal, lengths", "3-D", "two heads of two rows",
                                  "3-D, small"])
def test_heads_inner_queries_give_out_in_their_layout_outside_the_op(case):
    """The flash cases hold more than SMALL_TOTAL scores (the flash rung writes the
    layout itself); "small" and the two-by-two case take the small rung (the op lays
    its out so)."""
    kw = {}
    if case == "small":
        q, k, v = _blhd(2, 4, 6, 8), _blhd(2, 4, 6, 8), _blhd(2, 4, 6, 8)
    elif case == "flash":
        q, k, v = _blhd(2, 4, 600, 16), _blhd(2, 4, 600, 16), _blhd(2, 4, 600, 16)
    elif case == "two heads of two rows":               # the smallest shape whose layouts differ
        q, k, v = _blhd(3, 2, 2, 8), _blhd(3, 2, 2, 8), _blhd(3, 2, 2, 8)
    elif case == "3-D":                                  # (L, H, D) seen as (H, L, D): no batch axis
        q, k, v = _blhd(1, 4, 600, 16)[0], _blhd(1, 4, 600, 16)[0], _blhd(1, 4, 600, 16)[0]
    elif case == "3-D, small":
        q, k, v = _blhd(1, 4, 6, 8)[0], _blhd(1, 4, 6, 8)[0], _blhd(1, 4, 6, 8)[0]
    else:
        q, k, v = _blhd(3, 8, 300, 16), _blhd(3, 2, 300, 16), _blhd(3, 2, 300, 16)
        kw = dict(causal=True, kv_lengths=torch.tensor([300, 150, 7]), q_lengths=torch.tensor([300, 150, 7]))
    assert heads_inner(q)
    spec = validate(q, k, v, **kw)
    assert (select(spec, "auto").mod.name == "flash") == (case not in ("small", "two heads of two rows", "3-D, small"))
    with torch.no_grad():
        out = attnkit.attention(q, k, v, **kw)
        want = attnkit.attention(*(x.contiguous() for x in (q, k, v)), **kw)
    assert heads_inner(out) and not out.is_contiguous()
    back = out.transpose(-3, -2)
    assert back.is_contiguous() and back.contiguous().data_ptr() == out.data_ptr()   # no copy
    assert torch.equal(out, want) and want.is_contiguous()


def test_the_op_keeps_contiguous_outputs():
    """With gradients (the custom op) out stays contiguous whatever q's layout: under
    torch.compile the op may be handed q in another layout than its fake saw."""
    q, k, v = (x.requires_grad_() for x in (_blhd(2, 4, 300, 16), _blhd(2, 4, 300, 16), _blhd(2, 4, 300, 16)))
    out = attnkit.attention(q, k, v)
    assert out.is_contiguous()
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape


def test_numpy_callers_keep_c_ordered_out():
    q = np.ascontiguousarray(np.random.default_rng(0).standard_normal((2, 300, 4, 16), dtype=np.float32))
    qv = q.transpose(0, 2, 1, 3)
    assert attnkit.attention(qv, qv, qv).flags.c_contiguous


def test_the_flash_rung_writes_out_in_qs_layout_when_asked():
    """The copy is saved at the source: the flash rung's tasks write out straight into
    the heads-inner buffer (the same bits as the C-ordered out)."""
    from attnkit import flash
    from attnkit.spec import validate
    q = np.random.default_rng(1).standard_normal((2, 300, 4, 16), dtype=np.float32).transpose(0, 2, 1, 3)
    spec = validate(q, q, q, causal=True)
    out, lse, _ = flash.rung_forward(spec.replace(out_like_q=True))
    want, want_lse, _ = flash.rung_forward(spec)
    assert heads_inner(out) and want.flags.c_contiguous
    assert np.array_equal(out, want) and np.array_equal(lse, want_lse)


def test_a_decoding_call_runs_on_views_of_the_tensors(monkeypatch):
    """A decoding step (few rows per kv head, no mask arrays, no gradient) of CPU tensors
    runs the small rung's compiled call on NumPy views of them, without a NumPy Spec:
    the bits of the NumPy call, in q's layout."""
    from attnkit.torch import op
    q, k, v = _blhd(4, 8, 1, 32), _blhd(4, 2, 45, 32), _blhd(4, 2, 45, 32)
    want = attnkit.attention(*(x.numpy() for x in (q, k, v)), return_lse=True)

    def refuse(*a, **kw):
        raise AssertionError("a NumPy Spec was made")
    monkeypatch.setattr(op, "numpy_spec", refuse)
    with torch.no_grad():
        out, lse = attnkit.attention(q, k, v, return_lse=True)
    assert np.array_equal(out.numpy(), want[0]) and np.array_equal(lse.numpy(), want[1])


def test_out_already_in_qs_layout_is_no_copy():
    """out that a rung wrote with its heads inner where q has them comes back as is."""
    from attnkit.torch import op
    q, t = _blhd(2, 3, 5, 4), _blhd(2, 3, 5, 4)
    assert op._out(t, q, True) is t
    c = t.contiguous()                                   # C order: copied into q's layout
    laid = op._out(c, q, True)
    assert heads_inner(laid) and laid.data_ptr() != c.data_ptr() and torch.equal(laid, c)
