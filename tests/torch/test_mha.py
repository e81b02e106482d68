"""attnkit.torch.MultiheadAttention against torch.nn.MultiheadAttention: masks, GQA,
layouts, state_dict names, named errors for the module's own arguments, and
attention-weight dropout."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import attnkit.torch  # noqa: E402
from attnkit.testing import max_error  # noqa: E402
from attnkit.torch import MultiheadAttention  # noqa: E402


def pair(E=16, H=4, seed=0, **kw):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True, **kw).double()
    with torch.no_grad():                        # non-zero biases so they are tested too
        for p in ref.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return ref, attnkit.torch.MultiheadAttention.from_torch(ref)


def inputs(B=2, L=5, S=7, E=16, kdim=None, vdim=None, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, L, E, generator=g, dtype=torch.float64),
            torch.randn(B, S, kdim or E, generator=g, dtype=torch.float64),
            torch.randn(B, S, vdim or E, generator=g, dtype=torch.float64))


MHA_MASKS = {
    "none": lambda L, S, B, H: {},
    "attn_bool": lambda L, S, B, H: {"attn_mask": torch.rand(L, S) > 0.7},
    "attn_float_per_head": lambda L, S, B, H: {"attn_mask": torch.randn(B * H, L, S, dtype=torch.float64)},
    "padding_bool": lambda L, S, B, H: {"key_padding_mask": torch.arange(S)[None, :] >= torch.tensor([[S], [S - 3]])},
    "padding_float": lambda L, S, B, H: {"key_padding_mask": torch.randn(B, S, dtype=torch.float64)},
    "both_bool": lambda L, S, B, H: {"attn_mask": torch.rand(L, S) > 0.7,
                                      "key_padding_mask": torch.arange(S)[None, :] >= torch.tensor([[S], [S - 2]])},
}


@pytest.mark.parametrize("mask", list(MHA_MASKS))
@pytest.mark.parametrize("average", [True, False])
def test_mha_matches_torch(mask, average):
    ref, ours = pair()
    q, k, v = inputs()
    torch.manual_seed(2)
    kw = MHA_MASKS[mask](5, 7, 2, 4)
    if "attn_mask" in kw and kw["attn_mask"].dtype == torch.bool:
        kw["attn_mask"][:, 0] = False            # no fully masked rows: torch gives NaN there
    o1, w1 = ref(q, k, v, average_attn_weights=average, **kw)
    o2, w2 = ours(q, k, v, average_attn_weights=average, **kw)
    assert max_error(o1.detach(), o2.detach()) <= 1e-12 and max_error(w1.detach(), w2) <= 1e-12
    g1 = torch.autograd.grad(o1.square().sum(), list(ref.parameters()))
    g2 = torch.autograd.grad(o2.square().sum(), list(ours.parameters()))
    for a, b in zip(g1, g2):
        assert max_error(a, b) <= 1e-12
    o3, w3 = ours(q, k, v, need_weights=False, **kw)
    assert w3 is None and torch.equal(o3, o2)


def test_mha_causal_cross_dims_batch_first_false_and_unbatched():
    ref, ours = pair(kdim=6, vdim=10)
    assert ours.in_proj_weight is None and ours.k_proj_weight.shape == (16, 6)
    q, k, v = inputs(L=6, S=6, kdim=6, vdim=10)
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    o1, w1 = ref(q, k, v, attn_mask=causal, is_causal=True)
    o2, w2 = ours(q, k, v, is_causal=True)
    assert max_error(o1.detach(), o2.detach()) <= 1e-12 and max_error(w1.detach(), w2) <= 1e-12
    ref.batch_first = False
    ours_tf = attnkit.torch.MultiheadAttention.from_torch(ref)
    assert not ours_tf.batch_first
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
    assert max_error(ref(qt, kt, vt)[0].detach(), ours_tf(qt, kt, vt)[0].detach()) <= 1e-12
    o1, w1 = ref(q[0], k[0], v[0])
    o2, w2 = ours_tf(q[0], k[0], v[0])
    assert o2.shape == (6, 16) and max_error(o1.detach(), o2.detach()) <= 1e-12
    assert max_error(w1.detach(), w2) <= 1e-12


def test_mha_gqa_equals_full_heads_with_repeated_kv_weights():
    """num_kv_heads=2 of 4 heads is a full MHA whose k/v projections repeat each kv
    head's rows for the query heads that read it."""
    torch.manual_seed(3)
    E, H, Hkv, hd = 16, 4, 2, 4
    ours = attnkit.torch.MultiheadAttention(E, H, num_kv_heads=Hkv).double()
    assert ours.in_proj_weight.shape == (E + 2 * Hkv * hd, E)
    with torch.no_grad():
        ours.in_proj_bias.normal_()
    wq, wk, wv = ours.in_proj_weight.split([E, Hkv * hd, Hkv * hd])
    bq, bk, bv = ours.in_proj_bias.split([E, Hkv * hd, Hkv * hd])

    def rep(x):
        return x.reshape(Hkv, hd, *x.shape[1:]).repeat_interleave(H // Hkv, 0).reshape(E, *x.shape[1:])

    full = torch.nn.MultiheadAttention(E, H, batch_first=True).double()
    with torch.no_grad():
        full.in_proj_weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        full.in_proj_bias.copy_(torch.cat([bq, rep(bk), rep(bv)]))
        full.out_proj.load_state_dict(ours.out_proj.state_dict())
    q, k, v = inputs()
    o1, w1 = full(q, k, v, average_attn_weights=False)
    o2, w2 = ours(q, k, v, average_attn_weights=False)
    assert max_error(o1.detach(), o2.detach()) <= 1e-12 and max_error(w1.detach(), w2) <= 1e-12


def test_mha_state_dict_names_match_torch_and_unsupported_options_raise():
    ref = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    ours = attnkit.torch.MultiheadAttention(8, 2)
    assert list(ours.state_dict()) == list(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match="add_bias_kv"):
        attnkit.torch.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="num_kv_heads"):
        attnkit.torch.MultiheadAttention(8, 4, num_kv_heads=3)


def test_module_arguments_get_named_errors():
    for kw, name in ((dict(embed_dim=16, num_heads=4, num_kv_heads=0), "num_kv_heads"),
                     (dict(embed_dim=16, num_heads=4, num_kv_heads=3), "num_kv_heads"),
                     (dict(embed_dim=15, num_heads=4), "embed_dim"), (dict(embed_dim=16, num_heads=0), "num_heads"),
                     (dict(embed_dim=16, num_heads=4, dropout=1.0), "dropout"),
                     (dict(embed_dim=16, num_heads=4, kdim=0), "kdim"), (dict(embed_dim=16, num_heads=4, vdim=2.5), "vdim")):
        with pytest.raises(ValueError, match=f"^{name}"):
            MultiheadAttention(**kw)
    for kw, name in ((dict(dtype=torch.int64), "dtype"),):
        with pytest.raises(TypeError, match=f"^{name}"):
            MultiheadAttention(16, 4, **kw)
    mha = MultiheadAttention(16, 4)
    q = torch.randn(2, 5, 16)
    for args, kw, err, name in (((torch.randn(2, 5, 12),), {}, ValueError, "query"),
                                ((q, torch.randn(2, 7, 12), torch.randn(2, 7, 16)), {}, ValueError, "key"),
                                ((q,), dict(key_padding_mask=torch.ones(2, 5, dtype=torch.int64)), TypeError,
                                 "key_padding_mask"),
                                ((q,), dict(key_padding_mask=torch.zeros(2, 4, dtype=torch.bool)), ValueError,
                                 "key_padding_mask"),
                                ((q,), dict(attn_mask=torch.zeros(3, 5, 5, dtype=torch.bool)), ValueError, "attn_mask"),
                                ((q,), dict(attn_mask=torch.zeros(5, 4)), ValueError, "attn_mask"),
                                ((q.double(),), {}, TypeError, "query: expected the module's dtype float32"),
                                ((q.numpy(),), {}, TypeError, "query: expected a torch.Tensor"),
                                ((q, q.to("meta"), q.to("meta")), {}, ValueError, "key: expected a tensor on the "
                                 "module's device"),
                                ((q,), dict(key_padding_mask=np.zeros((2, 5), bool)), TypeError, "key_padding_mask"),
                                ((q,), dict(attn_mask=torch.zeros(5, 5, dtype=torch.bool, device="meta")), ValueError,
                                 "attn_mask: expected a tensor on query's device")):
        with pytest.raises(err, match=f"^{name}"):
            mha(*args, **kw)


def test_attention_weight_dropout_while_training():
    """dropout=p drops attention weights in training (reproducibly under
    torch.manual_seed), never in eval; the mean over many seeds is the eval output."""
    torch.manual_seed(0)
    mha = MultiheadAttention(16, 4, dropout=0.5).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mha.eval()
    clean = mha(x, x, x, need_weights=False)[0]
    mha.train()
    outs = []
    for s in (3, 3, 4):
        torch.manual_seed(s)
        outs.append(mha(x, x, x, need_weights=False)[0])
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
    assert not torch.allclose(outs[0], clean)
    mean = torch.stack([mha(x, x, x, need_weights=False)[0] for _ in range(400)]).mean(0)
    assert (mean - clean).abs().max() < 0.1
    outs[0].sum().backward()
    assert mha.in_proj_weight.grad is not None



def test_need_weights_takes_what_torch_takes():
    """torch.nn.MultiheadAttention reads need_weights as a truth value (None, 0)."""
    mha = MultiheadAttention(16, 4).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for flag in (None, 0, 1):
        out, w = mha(x, x, x, need_weights=flag)
        assert (w is None) == (not flag) and torch.equal(out, mha(x, x, x, need_weights=False)[0])


def encoder(num_kv_heads=None, layers=2, seed=0):
    """torch's encoder (float32: its fused inference path takes no float64) and a copy
    with attnkit's module in every layer."""
    torch.manual_seed(seed)
    ref = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True), layers)
    ours = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 4, 32, 0.0, batch_first=True), layers)
    ours.load_state_dict(ref.state_dict())
    for layer in ours.layers:
        layer.self_attn = MultiheadAttention.from_torch(layer.self_attn) if num_kv_heads is None else \
            MultiheadAttention(16, 4, num_kv_heads=num_kv_heads)
    return ref.eval(), ours.eval()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("padding", [False, True], ids=["no padding", "padding (nested tensors)"])
def test_in_torchs_encoder_in_inference(context, padding, monkeypatch):
    """torch.nn.TransformerEncoder(Layer) in eval without gradients takes torch's fused
    path (and with a padding mask turns the batch into nested tensors): with attnkit's
    module in its layers, attention stays attnkit's (each layer's call is counted) and
    the result is torch's own encoder's."""
    ref, ours = encoder()
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(1))
    mask = dict(src_key_padding_mask=torch.arange(6)[None, :] >= torch.tensor([[6], [4], [2]])) if padding else {}
    calls = []
    real = attnkit.api.attention
    monkeypatch.setattr(attnkit.api, "attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    with getattr(torch, context)():
        want, got = ref(x, **mask), ours(x, **mask)
        one = ours.layers[0](x, **{"src_key_padding_mask": mask["src_key_padding_mask"]} if padding else {})
        assert max_error(one, ref.layers[0](x, **mask)) <= 1e-5
    assert len(calls) == 3 and got.shape == want.shape and max_error(got, want) <= 1e-5


def test_a_gqa_module_in_torchs_encoder_in_inference_is_as_in_training():
    """GQA's packed projection would be wrong in torch's fused kernel: eval without
    gradients gives what a training-mode (no dropout) forward gives."""
    _, ours = encoder(num_kv_heads=2)
    x = torch.randn(3, 6, 16, generator=torch.Generator().manual_seed(2))
    pad = torch.arange(6)[None, :] >= torch.tensor([[6], [4], [2]])
    with torch.no_grad():
        fast = [ours(x), ours(x, src_key_padding_mask=pad)]
        ours.train()
        slow = [ours(x), ours(x, src_key_padding_mask=pad)]
    real = ~pad[..., None]                              # (padded positions: 0 from torch's nested path)
    assert max_error(fast[0], slow[0]) <= 1e-6 and max_error(fast[1] * real, slow[1] * real) <= 1e-6


def test_nested_inputs_refuse_what_they_cannot_carry():
    _, mha = pair()
    x = torch.nested.as_nested_tensor([torch.randn(3, 16, dtype=torch.float64), torch.randn(5, 16, dtype=torch.float64)])
    out, w = mha(x, x, x, need_weights=False)
    assert out.is_nested and [t.shape[0] for t in out.unbind()] == [3, 5] and w is None
    for bad in (dict(need_weights=True), dict(need_weights=False, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))):
        with pytest.raises(ValueError, match="^query, key, value: nested tensors"):
            mha(x, x, x, **bad)


def test_a_dynamically_quantized_out_proj_and_a_truthy_batch_first_still_work():
    """The inputs are checked against the input projection they meet (a quantized
    out_proj has no weight tensor); batch_first takes what torch's module takes."""
    mha = MultiheadAttention(16, 4).eval()
    quantized = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(mha), {torch.nn.Linear}, dtype=torch.qint8)
    x = torch.randn(2, 5, 16)
    assert quantized[0](x, x, x)[0].shape == (2, 5, 16)
    ours = MultiheadAttention.from_torch(torch.nn.MultiheadAttention(16, 4, batch_first=1))
    assert ours(x, x, x)[0].shape == (2, 5, 16)
