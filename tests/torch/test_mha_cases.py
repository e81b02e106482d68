"""attnkit.torch.MultiheadAttention: cases found by mutation testing of torch/mha.py
(scripts/mutation.py) — initialisation, bias=False, kdim or vdim alone, float masks
combined, from_torch's refusals and the attributes torch's module carries."""

import pytest

torch = pytest.importorskip("torch")

from attnkit.testing import max_error  # noqa: E402
from attnkit.torch import MultiheadAttention  # noqa: E402


def pair(E=16, H=4, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw).double()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref, MultiheadAttention.from_torch(ref)


def inputs(B=2, L=5, S=7, E=16, kdim=None, vdim=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, E, generator=g, dtype=torch.float64),
            torch.randn(B, S, kdim or E, generator=g, dtype=torch.float64),
            torch.randn(B, S, vdim or E, generator=g, dtype=torch.float64))


def check_against_torch(ref, ours, q, k, v, **kw):
    o1, w1 = ref(q, k, v, average_attn_weights=False, **kw)
    o2, w2 = ours(q, k, v, average_attn_weights=False, **kw)
    assert max_error(o1.detach(), o2.detach()) <= 1e-12 and max_error(w1.detach(), w2) <= 1e-12
    g1 = torch.autograd.grad(o1.square().sum(), list(ref.parameters()))
    g2 = torch.autograd.grad(o2.square().sum(), list(ours.parameters()))
    for a, b in zip(g1, g2):
        assert max_error(a, b) <= 1e-12


@pytest.mark.parametrize("kw", [{}, {"kdim": 6, "vdim": 10}, {"bias": False}])
def test_fresh_module_is_initialised_like_torch(kw):
    """Under the same seed a new module's parameters equal torch's exactly: xavier
    weights, zero in_proj_bias and out_proj.bias (catches a skipped init, a bias left
    uninitialised or the out_proj bias kept at nn.Linear's random init)."""
    torch.manual_seed(5)
    ref = torch.nn.MultiheadAttention(16, 4, batch_first=True, **kw)
    torch.manual_seed(5)
    ours = MultiheadAttention(16, 4, **kw)
    s1, s2 = ref.state_dict(), ours.state_dict()
    assert list(s1) == list(s2)
    for name in s1:
        assert torch.equal(s1[name], s2[name]), name


def test_bias_false_matches_torch():
    """bias=False: no in_proj_bias (registered as None) and no out_proj bias; the
    forward unpacks three None biases (catches the None registration dropped or the
    wrong count of None biases)."""
    ref, ours = pair(bias=False)
    assert ours.in_proj_bias is None and ours.out_proj.bias is None
    assert list(ours.state_dict()) == list(ref.state_dict())
    q, k, v = inputs()
    check_against_torch(ref, ours, q, k, v)


@pytest.mark.parametrize("kw", [{"kdim": 6}, {"vdim": 10}])
def test_kdim_or_vdim_alone_uses_separate_projections(kw):
    """Only one of kdim / vdim differing from E already needs separate q/k/v
    projection weights, as in torch (catches `and` -> `or` in _qkv_same_embed_dim)."""
    ref, ours = pair(**kw)
    assert ours.in_proj_weight is None and not ours._qkv_same_embed_dim
    q, k, v = inputs(**kw)
    check_against_torch(ref, ours, q, k, v)


MIXED = {
    "float_attn_float_padding": lambda: {"attn_mask": torch.randn(2 * 4, 5, 7, dtype=torch.float64),
                                         "key_padding_mask": torch.randn(2, 7, dtype=torch.float64)},
    "float_2d_attn_float_padding": lambda: {"attn_mask": torch.randn(5, 7, dtype=torch.float64),
                                            "key_padding_mask": torch.randn(2, 7, dtype=torch.float64)},
    "float_attn_bool_padding": lambda: {"attn_mask": torch.randn(5, 7, dtype=torch.float64),
                                        "key_padding_mask": torch.arange(7)[None, :] >= torch.tensor([[7], [4]])},
}


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask:UserWarning")
@pytest.mark.parametrize("mask", list(MIXED))
def test_float_attn_mask_and_padding_mask_combine_like_torch(mask):
    """A float attn_mask and a float key_padding_mask are both added to the scores
    (catches the padding replacing the attn_mask, or being subtracted from it); a float
    attn_mask with a boolean padding mask keeps both."""
    ref, ours = pair()
    q, k, v = inputs()
    torch.manual_seed(2)
    kw = MIXED[mask]()
    check_against_torch(ref, ours, q, k, v, **kw)


@pytest.mark.parametrize("kw", [{"add_bias_kv": True}, {"add_zero_attn": True},
                                {"add_bias_kv": True, "add_zero_attn": True}])
def test_from_torch_refuses_bias_kv_and_zero_attn(kw):
    """from_torch names the unsupported options, each on its own (catches `or` -> `and`,
    which lets add_zero_attn through silently and add_bias_kv through to a
    load_state_dict error)."""
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True, **kw)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
        MultiheadAttention.from_torch(ref)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
        MultiheadAttention(8, 2, **kw)


@pytest.mark.parametrize("kw", [{}, {"kdim": 6, "vdim": 10}, {"bias": False}])
def test_attributes_mirror_torch_and_from_torch_copies_an_attnkit_module(kw):
    """Code written for torch's module reads its attributes (bias_k, bias_v,
    add_zero_attn, ...): they carry torch's values, so from_torch also copies an
    attnkit module (catches bias_k / add_zero_attn not set or set wrong); batch_first
    defaults to True (a documented difference from torch)."""
    ref, ours = pair(**kw)
    for name in ("embed_dim", "num_heads", "head_dim", "kdim", "vdim", "_qkv_same_embed_dim", "dropout",
                 "batch_first", "bias_k", "bias_v", "add_zero_attn"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert MultiheadAttention(16, 4).batch_first is True
    copy = MultiheadAttention.from_torch(ours)
    q, k, v = inputs(**{n: kw[n] for n in ("kdim", "vdim") if n in kw})
    assert torch.equal(copy(q, k, v)[0], ours(q, k, v)[0])


def test_value_defaults_to_key_and_key_to_query():
    """mha(q, k) attends over k as values too, mha(q) is self-attention, like torch."""
    ref, ours = pair()
    q, k, _ = inputs()
    for args in ((q, k), (q,)):
        full = args + (args[-1],) * (3 - len(args))
        assert torch.equal(ours(*args)[0], ours(*full)[0])
        assert max_error(ref(*full)[0].detach(), ours(*args)[0].detach()) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bool, torch.float64])
def test_unbatched_input_with_key_padding_mask_matches_torch(dtype):
    """Unbatched (L, E) inputs take an (S,) key_padding_mask, given a batch dim with
    them (catches the mask left 1-D or dropped)."""
    ref, ours = pair()
    q, k, v = (x[0] for x in inputs())
    kpm = torch.arange(7) >= 4 if dtype == torch.bool else torch.randn(7, dtype=torch.float64)
    o1, w1 = ref(q, k, v, key_padding_mask=kpm)
    o2, w2 = ours(q, k, v, key_padding_mask=kpm)
    assert o2.shape == (5, 16) and w2.shape == (5, 7)
    assert max_error(o1.detach(), o2.detach()) <= 1e-12 and max_error(w1.detach(), w2) <= 1e-12
    assert not torch.allclose(o2, ours(q, k, v)[0])
