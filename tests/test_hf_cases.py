# ruff: noqa: F811  (pytest fixtures imported from test_hf)
"""More of the transformers integration, each case one that a mutation run of hf.py
found untested: the is_causal keyword and default, masks with position biases and
sparse indices, when packing applies (and when not), FlashAttention's keywords with
unequal offsets and a non-causal layer's window, chunked prefill, right padding with
fewer queries than keys, attention weights for transformers' collector, the mask
builder's materialised masks, which model families get the short masks, and a static
cache under torch.compile. The fixtures (the registration under "flash" and "auto")
are test_hf's."""

import sys
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import masking_utils as mu  # noqa: E402

import attnkit.hf  # noqa: E402
from test_hf import batch, calls, decoder, packed_sequences, registered  # noqa: E402,F401

F = torch.nn.functional


def qkv(B=1, H=2, L=5, S=None, D=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = L if S is None else S
    return (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (L, S, S))


def layer(is_causal=True):
    module = torch.nn.Module()
    module.is_causal = is_causal
    return module


def sdpa(q, k, v, mask=None, **kw):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw).transpose(1, 2)


def bottom_right(L, S):
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)


# --- is_causal: the keyword over the layer's attribute; transformers' default without either

def test_clip_text_is_causal_by_keyword_only():
    """CLIP's text layers keep is_causal = False and pass is_causal=True as a keyword."""
    cfg = transformers.CLIPTextConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=16)
    ids, _ = batch()
    outs = []
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        model = transformers.CLIPTextModel._from_config(cfg, attn_implementation=impl).double().eval()
        outs.append(hidden(model, input_ids=ids))
    assert (outs[0] - outs[1]).abs().max() <= 1e-10


def hidden(model, **kw):
    with torch.no_grad():
        return model(**kw).last_hidden_state


def test_a_layer_without_is_causal_is_causal_as_for_sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    q, k, v = qkv()
    module = torch.nn.Module()                        # no is_causal attribute, no keyword
    ours, _ = attnkit.hf.attention_forward(module, q, k, v, None)
    peer, _ = sdpa_attention_forward(module, q, k, v, None)
    assert (ours - peer).abs().max() <= 1e-12


# --- masks and biases together

def test_a_float_mask_adds_to_the_position_bias():
    q, k, v = qkv(L=5)
    bias = torch.randn(1, 2, 5, 5, dtype=torch.float64)
    mask = torch.zeros(1, 1, 5, 5, dtype=torch.float64).masked_fill(~bottom_right(5, 5), torch.finfo(torch.float64).min)
    out, _ = attnkit.hf.attention_forward(layer(False), q, k, v, mask, position_bias=bias)
    assert (out - sdpa(q, k, v, bias + mask)).abs().max() <= 1e-12


def test_indices_fold_into_a_float_mask_as_into_a_boolean_one():
    q, k, v = qkv(L=6)
    keep = bottom_right(6, 6)[None, None]
    indices = torch.tensor([[[0, 0], [0, 1], [1, 2], [0, 3], [2, 4], [1, 5]]])    # (B, L, topk)
    as_float = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
    a, _ = attnkit.hf.attention_forward(layer(), q, k, v, keep, indices=indices)
    b, _ = attnkit.hf.attention_forward(layer(), q, k, v, as_float, indices=indices)
    assert (a - b).abs().max() <= 1e-12



@pytest.mark.parametrize("mask", ["4-D boolean", "4-D float", "none"])
def test_block_indices_keep_the_chosen_blocks_with_the_mask(mask):
    """MiniMax-M3's ``block_indices`` (B, index heads, L, topk; −1 none) against blocks
    of the layer's ``indexer.block_size``: each query sees the keys of its blocks that
    the mask lets it see, the index head's choice shared by its query heads (two of
    four here), whatever form the mask has."""
    q, k, v = qkv(H=4, L=7, S=9)
    causal = bottom_right(7, 9)[None, None]
    blocks = torch.tensor([[[[2, -1]] * 7, [[0, 1]] * 7]])          # 9 keys in blocks of 3: 0–2, 3–5, 6–8
    chosen = torch.zeros(1, 2, 7, 9, dtype=torch.bool)
    chosen[:, 0, :, 6:], chosen[:, 1, :, :6] = True, True
    want = sdpa(q, k, v, causal & chosen.repeat_interleave(2, dim=1))
    module = layer()
    module.indexer = types.SimpleNamespace(block_size=3)
    given = {"4-D boolean": causal, "4-D float": torch.zeros(causal.shape, dtype=torch.float64).masked_fill(
        ~causal, float("-inf")), "none": None}[mask]
    out, _ = attnkit.hf.attention_forward(module, q, k, v, given, block_indices=blocks)
    assert (out - want).abs().max() <= 1e-12
    with pytest.raises(ValueError, match=r"^block_indices: the layer's indexer.block_size must be a positive int"):
        attnkit.hf.attention_forward(layer(), q, k, v, given, block_indices=blocks)


# --- packed sequences: only where the mask is exactly the packed one

def block_causal(lengths):
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ((seq[:, None] == seq[None, :]) & torch.ones(len(seq), len(seq), dtype=torch.bool).tril())[None, None]


def test_restarting_positions_are_not_packed_with_fewer_queries_than_keys():
    """A chunk of 3 queries on 6 keys whose positions restart: the 4-D mask as given."""
    q, k, v = qkv(L=3, S=6)
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool).tril(3)
    out, _ = attnkit.hf.attention_forward(layer(), q, k, v, mask, position_ids=torch.tensor([[3, 4, 0]]))
    assert (out - sdpa(q, k, v, mask)).abs().max() <= 1e-12


def test_restarting_positions_of_one_row_are_not_packed_for_a_batch():
    """position_ids (1, L) broadcast over a batch of 2: the mask as given, per row."""
    q, k, v = qkv(B=2, L=5)
    mask = block_causal([2, 3]).repeat(2, 1, 1, 1)
    out, _ = attnkit.hf.attention_forward(layer(), q, k, v, mask, position_ids=torch.tensor([[0, 1, 0, 1, 2]]))
    assert (out - sdpa(q, k, v, mask)).abs().max() <= 1e-12


def test_a_sliding_window_keyword_on_a_plain_packed_mask_packs_without_a_window(calls):
    """OLMoE-like: sliding_window passed with a plain (packed) causal mask."""
    q, k, v = qkv(L=7)
    mask = block_causal([4, 3])
    out, _ = attnkit.hf.attention_forward(layer(), q, k, v, mask, sliding_window=2,
                                          position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))
    assert (out - sdpa(q, k, v, mask)).abs().max() <= 1e-12
    assert calls[-1].get("cu_seqlens_q") is not None and calls[-1].get("window") is None


def test_cu_seq_lens_in_a_layer_that_is_not_causal_take_a_symmetric_window():
    """FlashAttention reads a non-causal layer's sliding_window as (w − 1, w − 1), as
    transformers' bidirectional sliding mask |i − j| < w: each sequence alone, so."""
    q, k, v = qkv(L=7)
    cu = torch.tensor([0, 3, 7])
    out, _ = attnkit.hf.attention_forward(layer(False), q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                          sliding_window=2)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        i = torch.arange(b - a)
        near = (i[:, None] - i[None, :]).abs() < 2
        assert (out[:, a:b] - sdpa(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], near)).abs().max() <= 1e-12


def test_restarting_positions_pack_a_bidirectional_sliding_mask_with_its_window(calls):
    """A layer that is not causal with transformers' packed bidirectional sliding mask
    (|i − j| < w inside each sequence) and restarting positions: packed, window (w − 1,
    w − 1), the mask's result."""
    q, k, v = qkv(L=7)
    seq = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    i = torch.arange(7)
    mask = ((seq[:, None] == seq[None, :]) & ((i[:, None] - i[None, :]).abs() < 2))[None, None]
    out, _ = attnkit.hf.attention_forward(layer(False), q, k, v, mask, sliding_window=2,
                                          position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2]]))
    assert (out - sdpa(q, k, v, mask)).abs().max() <= 1e-12
    assert calls[-1].get("cu_seqlens_q") is not None and calls[-1]["window"] == (1, 1)


def test_cu_seq_lens_with_more_keys_than_queries():
    """FlashAttention's keywords with cu_seq_lens_k != cu_seq_lens_q: causal, bottom-right per sequence."""
    q, k, v = qkv(L=5, S=7)
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 3, 7])
    out, _ = attnkit.hf.attention_forward(layer(), q, k, v, None, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    for (a, b), (c, d) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        want = sdpa(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], bottom_right(int(b - a), int(d - c)))
        assert (out[:, a:b] - want).abs().max() <= 1e-12


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_packed_batch_with_a_one_token_sequence(name, calls):
    """Positions 0, 1, 2, 3, 4, 0, 0, 1, 2: a restart where the position does not go down."""
    seqs, packed, pos = packed_sequences((5, 1, 3))
    model = decoder(name, "attnkit")
    with torch.no_grad():
        out = model(input_ids=packed, position_ids=pos, use_cache=False).logits[0]
        assert calls and all(c.get("cu_seqlens_q") is not None for c in calls)
        start = 0
        for s in seqs:
            assert (out[start:start + len(s)] - model(input_ids=s[None]).logits[0]).abs().max() <= 1e-10
            start += len(s)


# --- a cache without a static cache's mask

def test_chunked_prefill_on_a_dynamic_cache_matches_sdpa():
    """Second chunk (5 queries on 11 keys), no padding: no mask, causal aligned bottom-right."""
    ids, _ = batch(2)
    outs = []
    for impl in ("sdpa", "attnkit"):
        model = decoder("llama", impl)
        cache = transformers.DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids[:, :6], cache=cache)
            outs.append(model(input_ids=ids[:, 6:], cache=cache).logits)
    assert (outs[0] - outs[1]).abs().max() <= 1e-10


def test_right_padding_with_fewer_queries_than_keys_is_aligned_bottom_right():
    """Right padding gives kv_lengths (top-left) only where L == S, also when the same mask
    was just read for L == S (another layer, or the full sequence)."""
    q, k, v = qkv(B=2, L=5)
    for first in (False, True):
        pad = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
        if first:
            attnkit.hf.attention_forward(layer(), q, k, v, pad)
        out, _ = attnkit.hf.attention_forward(layer(), q[:, :, 3:], k, v, pad)
        keep = pad.bool()[:, None, None, :] & bottom_right(2, 5)
        assert (out - sdpa(q[:, :, 3:], k, v, keep)).abs().max() <= 1e-12


# --- attention weights

@pytest.mark.parametrize("key", ["attentions", "cross_attentions", "mask_decoder_attentions"])
def test_weights_when_the_collector_records_them(key):
    from transformers.utils.output_capturing import _active_collector
    q, k, v = qkv()
    token = _active_collector.set({key: []})
    try:
        _, w = attnkit.hf.attention_forward(layer(), q, k, v, None)
    finally:
        _active_collector.reset(token)
    assert w is not None and w.shape == (1, 2, 5, 5)


def test_weights_on_a_static_cache_span_the_cache_as_eagers():
    """A static cache's keys are cut to the tokens so far before attending; the weights
    still come back over the whole cache (0 on its empty slots), prefill and decoding
    alike, as eager's do."""
    ids, mask = batch(2, 10)
    got = {}
    for impl in ("eager", "attnkit"):
        model = decoder("llama", impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            first = model(input_ids=ids, attention_mask=mask, cache=cache, output_attentions=True).attentions
            step = model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1), cache=cache,
                         output_attentions=True).attentions
        got[impl] = (first[0], step[0])
    for ours, eager, rows in zip(got["attnkit"], got["eager"], (mask.bool(), torch.ones(2, 1, dtype=torch.bool))):
        assert ours.shape == eager.shape
        real = rows[:, None, :, None].expand_as(eager)   # eager's left-padded rows: an average, or NaN
        assert (ours - eager)[real].abs().max() <= 1e-6  # (eager's softmax runs in float32)
        assert (ours[..., 11:] == 0).all()


# --- the mask builder

def attend_with(m, q, k, v, module):
    return attnkit.hf.attention_forward(module, q, k, v, m)[0]


def test_materialized_masks_where_transformers_asks_for_them():
    """allow_is_bidirectional_skip=False (the mask is concatenated with another, T5Gemma2):
    a 4-D mask; keys not starting at position 0 (kv_offset): the causal mask of their
    positions; a 2-D mask longer than the keys: cut as sdpa's mask cuts it."""
    pad = torch.ones(2, 5, dtype=torch.bool)
    m = attnkit.hf.attention_mask(2, 5, 5, mask_function=mu.bidirectional_mask_function, attention_mask=pad,
                                  allow_is_bidirectional_skip=False)
    assert m is not None and m.dim() == 4
    q, k, v = qkv(L=2, S=5)
    m = attnkit.hf.attention_mask(1, 2, 5, q_offset=10, kv_offset=8, mask_function=mu.causal_mask_function)
    want = mu.sdpa_mask(1, 2, 5, q_offset=10, kv_offset=8, mask_function=mu.causal_mask_function,
                        allow_is_causal_skip=False)
    assert (attend_with(m, q, k, v, layer()) - sdpa(q, k, v, want)).abs().max() <= 1e-12
    q, k, v = qkv(B=2, L=3, S=5)
    long = torch.ones(2, 7, dtype=torch.bool)
    long[1, 0] = False
    m = attnkit.hf.attention_mask(2, 3, 5, q_offset=2, mask_function=mu.causal_mask_function, attention_mask=long)
    want = mu.sdpa_mask(2, 3, 5, q_offset=2, mask_function=mu.causal_mask_function, attention_mask=long,
                        allow_is_causal_skip=False)
    assert (attend_with(m, q, k, v, layer()) - sdpa(q, k, v, want)).abs().max() <= 1e-12


# --- which models get the short masks

def family(monkeypatch, module_name, flags, own_config=True):
    """A config class in module_name and a modeling module of model classes with
    _supports_sdpa = flags (their config_class the config's, or another class)."""
    cfg = type("Cfg", (), {"__module__": module_name})
    mod = types.ModuleType(module_name.replace(".configuration_", ".modeling_"))
    for i, f in enumerate(flags):
        cls = type(f"Model{i}", (transformers.PreTrainedModel,), {
            "__module__": mod.__name__, "_supports_sdpa": f, "config_class": cfg if own_config else object})
        setattr(mod, cls.__name__, cls)
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(attnkit.hf, "_TRUSTED", {})
    return cfg()


def test_layers_are_trusted_only_when_every_model_class_supports_sdpa(monkeypatch):
    name = "transformers.models.fakefam.configuration_fakefam"
    assert attnkit.hf._trusts_layers(family(monkeypatch, name, [True, True]))
    assert not attnkit.hf._trusts_layers(family(monkeypatch, name, [True, False]))
    # no class names the config (BLIP's text config): the family's classes decide
    assert not attnkit.hf._trusts_layers(family(monkeypatch, name, [False], own_config=False))
    # remote code (outside transformers.models) is trusted
    assert attnkit.hf._trusts_layers(family(monkeypatch, "transformers_modules.fake.configuration_fake", [False]))


def test_only_the_classes_of_the_configs_own_model_decide(monkeypatch):
    """A family module whose classes belong to two configs (a text model next to its
    vision model): the config's own classes decide, not the others'."""
    name = "transformers.models.twofam.configuration_twofam"
    cfg = family(monkeypatch, name, [True])
    mod = sys.modules[name.replace(".configuration_", ".modeling_")]
    other = type("OtherModel", (transformers.PreTrainedModel,), {
        "__module__": mod.__name__, "_supports_sdpa": False, "config_class": object})
    mod.OtherModel = other
    assert attnkit.hf._model_classes(type(cfg)) == [mod.Model0]
    assert attnkit.hf._trusts_layers(cfg)


# --- torch.compile with a static cache

@pytest.mark.parametrize("with_mask", [False, True], ids=["no mask", "a mask over the cache"])
def test_a_static_cache_compiles_whole(with_mask):
    """The static cache's offset is a tensor while tracing: sdpa_mask builds the mask
    (also from a fixed-length 2-D mask over the whole cache, whose slots past the tokens
    so far only causality hides), as sdpa's."""
    torch._dynamo.reset()
    ids, _ = batch(2)
    model = decoder("llama", "attnkit", torch.float32)
    peer = decoder("llama", "sdpa", torch.float32)
    outs = []
    for run in (torch.compile(model, fullgraph=True), model, peer):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        mask = {}
        if with_mask:
            mask = dict(attention_mask=torch.zeros(2, 16, dtype=torch.long))
            mask["attention_mask"][:, :8] = 1
        with torch.no_grad():
            run(input_ids=ids[:, :6], cache=cache, **mask)
            outs.append(run(input_ids=ids[:, 6:8], cache=cache, **mask).logits)
    assert (outs[0] - outs[1]).abs().max() <= 1e-5 and (outs[1] - outs[2]).abs().max() <= 1e-5


# --- helpers pinned down (mutation run of hf.py, 2026-12-05)

def test_packed_offsets_from_one_row_of_restarting_positions():
    offsets = attnkit.hf._packed_offsets
    assert torch.equal(offsets(torch, torch.tensor([[0, 1, 2, 0, 1, 2, 3]])), torch.tensor([0, 3, 7]))
    assert torch.equal(offsets(torch, torch.tensor([[0, 0, 1]])), torch.tensor([0, 1, 3]))
    assert torch.equal(offsets(torch, torch.tensor([[0, 0]])), torch.tensor([0, 1, 2]))   # two one-token sequences
    for not_packed in (None, torch.tensor([0, 1, 0, 1]), torch.tensor([[0, 1, 0], [0, 1, 0]]),
                       torch.tensor([[0]]), torch.tensor([[3, 4, 5, 6]])):
        assert offsets(torch, not_packed) is None


def test_block_causal_masks_with_a_window_that_is_not_symmetric():
    """A non-causal layer with a one-sided window (2 keys back, none ahead)."""
    cu = torch.tensor([0, 3, 7])
    seq = torch.repeat_interleave(torch.arange(2), torch.diff(cu))
    i = torch.arange(7)
    mask = ((seq[:, None] == seq[None, :]) & (i[None, :] >= i[:, None] - 2) & (i[None, :] <= i[:, None]))[None, None]
    assert attnkit.hf._is_block_causal(torch, mask, cu, False, (2, 0))
    assert not attnkit.hf._is_block_causal(torch, mask, cu, False, (2, 2))


def test_indices_without_a_four_dimensional_mask_are_named():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^indices: .* need the layer's 4-D mask, got None"):
        attnkit.hf.attention_forward(layer(), q, k, v, None, indices=torch.zeros(1, 5, 2, dtype=torch.long))


def test_without_transformers_collector_weights_follow_the_keyword_only(monkeypatch):
    monkeypatch.setattr(attnkit.hf, "_COLLECTOR", [None])   # another transformers version: no collector
    assert attnkit.hf._recording_attentions() is False
    q, k, v = qkv()
    assert attnkit.hf.attention_forward(layer(), q, k, v, None)[1] is None
    assert attnkit.hf.attention_forward(layer(), q, k, v, None, output_attentions=True)[1].shape == (1, 2, 5, 5)


def test_a_padding_mask_is_read_once_until_it_changes(monkeypatch):
    """Every layer of a forward gets the same 2-D mask: it is read once; a write through
    .data (which bumps no version) is not seen, an in-place change is."""
    monkeypatch.setattr(attnkit.hf, "_LAST_PADDING", [None])
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 4:] = 0
    assert attnkit.hf._padding(mask, True)["kv_lengths"].tolist() == [6, 4]
    mask.data[1, 4] = 1                                  # the same memory, the same version
    assert attnkit.hf._padding(mask, True)["kv_lengths"].tolist() == [6, 4]
    assert "keep" in attnkit.hf._padding(mask, False)    # another question: read again
    mask[1, 4] = 1                                       # a new version: read again
    assert attnkit.hf._padding(mask, True)["kv_lengths"].tolist() == [6, 5]
    with torch.inference_mode():                         # no version counter: read every time
        m = torch.ones(2, 6, dtype=torch.long)
        m[1, 3:] = 0
        assert attnkit.hf._padding(m, True)["kv_lengths"].tolist() == [6, 3]
        m[1, 3] = 1
        assert attnkit.hf._padding(m, True)["kv_lengths"].tolist() == [6, 4]


@pytest.mark.parametrize("L", [1, 3])
def test_per_token_sinks_with_or_without_their_last_axis(L):
    """Per-token sink logits as (B, H, L, 1) (their last axis dropped) or already (B, H, L),
    a decoding step (L = 1) too."""
    q, k, v = qkv(L=L, S=6)
    sinks = torch.randn(1, 2, L, 1, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    four = attnkit.hf.attention_forward(layer(), q, k, v, None, sinks=sinks)[0]
    three = attnkit.hf.attention_forward(layer(), q, k, v, None, sinks=sinks[..., 0])[0]
    want = attnkit.attention(q, k, v, causal=L > 1, sinks=sinks[..., 0]).transpose(1, 2)
    assert torch.equal(four, three) and (four - want).abs().max() <= 1e-12


def test_two_new_tokens_against_earlier_keys_are_causal():
    """L = 2 queries after 3 earlier keys (a speculative step): causal, bottom-right,
    without a mask and with a 2-D padding mask."""
    q, k, v = qkv(L=2, S=5)
    causal = bottom_right(2, 5)
    assert (attnkit.hf.attention_forward(layer(), q, k, v, None)[0] - sdpa(q, k, v, causal)).abs().max() <= 1e-12
    pad = torch.tensor([[0, 1, 1, 1, 1]])
    got = attnkit.hf.attention_forward(layer(), q, k, v, pad)[0]
    assert (got - sdpa(q, k, v, causal & pad.bool()[:, None, None, :])).abs().max() <= 1e-12


def test_the_mask_builder_defaults_are_transformers_own():
    """Called with fewer arguments, the builder assumes what transformers' sdpa_mask does."""
    import inspect
    ours, theirs = (inspect.signature(f).parameters for f in (attnkit.hf.attention_mask, mu.sdpa_mask))
    for name in ("q_offset", "kv_offset", "attention_mask", "local_size", "allow_is_causal_skip",
                 "allow_is_bidirectional_skip"):
        assert ours[name].default == theirs[name].default, name


def test_the_mask_builder_on_a_static_cache_gives_the_tokens_so_far():
    """A causal layer on a static cache of 4 slots: a 2-D mask of 3 tokens stays a mask
    (even when the batch is also 4: the slots past it are empty), and without a mask the
    tokens so far are ones — also when the offset is a tensor (a static cache's)."""
    cfg = decoder("llama", "attnkit").config
    causal = mu.causal_mask_function
    m = attnkit.hf.attention_mask(4, 1, 4, q_offset=2, mask_function=causal,
                                  attention_mask=torch.ones(4, 3, dtype=torch.long), config=cfg)
    assert m is not None and m.dtype == torch.bool and m.shape == (4, 3) and bool(m.all())
    for offset in (5, torch.tensor(5)):
        m = attnkit.hf.attention_mask(2, 1, 16, q_offset=offset, mask_function=causal, config=cfg)
        assert m is not None and m.shape == (2, 6) and bool(m.all()), offset
        assert attnkit.hf.attention_mask(2, 1, 6, q_offset=offset, mask_function=causal, config=cfg) is None
        # a mask over more slots than the tokens so far is cut to them, one over fewer padded
        for width, want in ((16, [1, 1, 1, 1, 1, 0]), (4, [1, 0, 1, 1, 0, 0])):
            given = torch.ones(1, width, dtype=torch.long)
            given[0, 1] = 0
            if width == 16:
                given[0, 5:] = 0
            m = attnkit.hf.attention_mask(1, 1, 16, q_offset=offset, mask_function=causal, attention_mask=given,
                                          config=cfg)
            want_ = torch.tensor([want], dtype=torch.bool)
            want_[0, 1] = False
            assert torch.equal(m, want_), (offset, width)
    # a bidirectional layer's shorter mask stays as it is (the hook cuts the keys to it)
    m = attnkit.hf.attention_mask(1, 3, 8, mask_function=mu.bidirectional_mask_function,
                                  attention_mask=torch.tensor([[1, 0, 1]]), allow_is_bidirectional_skip=True,
                                  config=cfg)
    assert torch.equal(m, torch.tensor([[True, False, True]]))


def test_register_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)      # import torch fails
    with pytest.raises(ImportError, match=r"^attnkit.hf needs torch and transformers: pip install 'attnkit\[hf\]'"):
        attnkit.hf.register()


@pytest.mark.parametrize("padded", [False, True], ids=["no padding", "right padding"])
def test_gemma_layers_made_bidirectional_under_a_causal_mask_attend_as_eager(padded):
    """Gemma's use_bidirectional_attention makes its layers' is_causal False, while
    GemmaModel (and PaliGemma without token_type_ids) still builds a causal mask: eager
    attends causally. The short masks leave causality to the layer, so such configs get
    transformers' own mask (sdpa, given None without padding, attends both ways)."""
    cfg = transformers.GemmaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=8, intermediate_size=64,
                                   use_bidirectional_attention=True)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    if padded:
        mask[1, 6:] = 0
    out = {}
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = transformers.GemmaModel._from_config(cfg, attn_implementation=impl).double().eval()
        with torch.no_grad():
            out[impl] = model(input_ids=ids, attention_mask=mask).last_hidden_state[mask.bool()]
    assert (out["eager"] - out["attnkit"]).abs().max() <= 1e-6      # (eager's softmax is float32)


def test_which_configs_have_non_causal_layers():
    see = attnkit.hf._layers_not_causal
    flag = lambda x: types.SimpleNamespace(use_bidirectional_attention=x)        # noqa: E731
    assert see(flag(True)) and see(flag("all"))                                  # gemma, gemma4's "all"
    assert not see(flag(False)) and not see(flag("vision")) and not see(flag(None)) and not see(None)
    composite = types.SimpleNamespace(use_bidirectional_attention=None, get_text_config=lambda: flag(True))
    assert see(composite)                                                        # paligemma's text config


class _Config:
    """A config as _layers_not_causal reads it, counting get_text_config's calls."""
    def __init__(self, flag=None, text=None):
        self.use_bidirectional_attention, self.reads = flag, 0
        if text is not None:
            self.text_config = text

    def get_text_config(self):
        self.reads += 1
        return getattr(self, "text_config", self)


def test_a_configs_causality_is_read_for_that_config_only():
    """Read once per config object: another config (a freed one's id reused included)
    gets its own answer."""
    see = attnkit.hf._layers_not_causal
    reused = 0
    for i in range(50):
        first = _Config(i % 2 == 0)
        assert see(first) is (i % 2 == 0) and see(first) is (i % 2 == 0)
        old = id(first)
        del first
        second = _Config(i % 2 == 1)
        reused += id(second) == old
        assert see(second) is (i % 2 == 1)
    assert reused                                      # the stale entry was there to be found


def test_a_kept_causality_follows_what_it_rests_on(monkeypatch):
    """The answer kept for a config is used (get_text_config read once) while the
    attributes it rests on are the same objects: a flag set on the config or on its
    text config, or a text config replaced, is read again; nothing is kept while
    torch.compile traces."""
    see = attnkit.hf._layers_not_causal
    cfg = _Config(False)
    assert not see(cfg) and not see(cfg) and cfg.reads == 1
    cfg.use_bidirectional_attention = True
    assert see(cfg) and see(cfg) and cfg.reads == 2
    text = _Config("all")
    composite = _Config(None, text)
    assert see(composite) and see(composite) and composite.reads == 1
    text.use_bidirectional_attention = False
    assert not see(composite) and composite.reads == 2
    composite.text_config = _Config(True)
    assert see(composite) and composite.reads == 3
    monkeypatch.setattr(attnkit.hf, "_compiling", lambda: True)
    fresh = _Config(True)
    assert see(fresh) and see(fresh) and fresh.reads == 2
    kept = attnkit.hf._NOT_CAUSAL.get(id(fresh))         # (a dead config's entry may share its id:
    assert kept is None or kept[0]() is not fresh        # the test failed once so)


def test_a_model_made_after_its_config_changed_attends_as_eager():
    """One config object, a model run, its use_bidirectional_attention then set and a
    second model made of it (non-causal layers under a causal mask): the second model
    attends as eager."""
    cfg = transformers.GemmaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=8, intermediate_size=64)
    ids = torch.randint(3, 97, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    first = transformers.GemmaModel(cfg).double().eval()
    first.set_attn_implementation("attnkit")
    with torch.no_grad():
        first(input_ids=ids)
    cfg.use_bidirectional_attention = True
    second = transformers.GemmaModel(cfg).double().eval()
    assert second.config is cfg and not second.layers[0].self_attn.is_causal
    out = {}
    for impl in ("eager", "attnkit"):
        second.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = second(input_ids=ids).last_hidden_state
    assert (out["eager"] - out["attnkit"]).abs().max() <= 1e-6


def test_register_takes_a_non_empty_name():
    for bad in (3, None, ""):
        with pytest.raises(TypeError, match="^name: expected a non-empty str"):
            attnkit.hf.register(bad)
