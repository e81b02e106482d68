"""Hugging Face transformers on attnkit: tiny random models built from configs (no
downloads) give sdpa's / eager's outputs with attn_implementation="attnkit" — decoders
with left and right padding, encoders, encoder-decoders, generation with a cache,
static caches, gradients (sink parameters included), training with dropout, packed
(padding-free) batches, sparse-attention indexers, models without attention backends
— and the integration refuses keywords it cannot honour."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnkit.hf  # noqa: E402
from attnkit import api, backends  # noqa: E402

COMMON = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64)
DECODERS = {
    "llama": lambda: transformers.LlamaConfig(num_key_value_heads=2, **COMMON),
    "qwen3": lambda: transformers.Qwen3Config(num_key_value_heads=2, head_dim=8, **COMMON),
    "mistral": lambda: transformers.MistralConfig(num_key_value_heads=2, sliding_window=5, **COMMON),
    "gemma2": lambda: transformers.Gemma2Config(num_key_value_heads=2, head_dim=8, sliding_window=5, **COMMON),
    "gemma3": lambda: transformers.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, sliding_window=5, **COMMON),
    "gpt_oss": lambda: transformers.GptOssConfig(num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                                 num_experts_per_tok=2, sliding_window=5, **COMMON),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, n_positions=64),
}


@pytest.fixture(autouse=True, params=["flash", "auto"], ids=["under-flash", "under-auto"])
def registered(request, monkeypatch):
    """The registration, every test twice: with "auto" choosing the flash rung (what
    real sizes run) and as it chooses for these tiny models (the small rung; the
    reference for packed batches)."""
    if request.param == "flash":
        monkeypatch.setattr(backends, "SMALL_TOTAL", 0)
    attnkit.hf.register()


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments of every attnkit.attention call the models make."""
    seen = []
    real = api.attention

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(api, "attention", spy)
    return seen


def decoder(name, impl, dtype=torch.float64):
    torch.manual_seed(0)                         # the same random weights for every implementation
    return transformers.AutoModelForCausalLM.from_config(DECODERS[name](), attn_implementation=impl,
                                                         experts_implementation="eager").to(dtype).eval()


def batch(n=3, L=11):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (n, L), generator=g)
    mask = torch.ones(n, L, dtype=torch.long)
    mask[1, :4] = 0                              # left padding
    if n > 2:
        mask[2, 7:] = 0                          # right padding
    return ids, mask


def logits(model, **kw):
    with torch.no_grad():
        return model(**kw).logits


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_decoders_match_sdpa_in_float64_and_eager_in_float32(name, calls):
    ids, mask = batch()
    real = mask.bool()
    ours = logits(decoder(name, "attnkit"), input_ids=ids, attention_mask=mask)
    tol = 1e-10
    try:
        peer = logits(decoder(name, "sdpa"), input_ids=ids, attention_mask=mask)
    except ValueError:                           # no sdpa support: eager, whose left-padded rows are NaN in
        peer = logits(decoder(name, "eager"), input_ids=ids, attention_mask=mask)   # float64 and whose softmax
        real = real & torch.isfinite(peer).all(-1)                                    # runs in float32
        assert real[0].all() and real[2].any()
        tol = 1e-6
    assert (ours - peer)[real].abs().max() <= tol
    eager = logits(decoder(name, "eager", torch.float32), input_ids=ids, attention_mask=mask)
    ours32 = logits(decoder(name, "attnkit", torch.float32), input_ids=ids, attention_mask=mask)
    assert (ours32 - eager)[real].abs().max() <= 1e-5
    plain = [c for c in calls if c.get("bias") is None and c.get("window") is None]
    for c in plain:                              # never an L × S mask for a plain layer's padding
        keep = c.get("keep")
        assert keep is None or keep.shape[-2] == 1 or name in ("mistral", "gemma2", "gemma3", "gpt_oss")


def test_right_padding_becomes_lengths(calls):
    ids, mask = batch()
    mask[1] = 1                                   # right padding only
    logits(decoder("llama", "attnkit"), input_ids=ids, attention_mask=mask)
    assert calls and all(c.get("kv_lengths") is not None and c.get("keep") is None for c in calls)
    assert calls[0]["kv_lengths"].tolist() == mask.sum(-1).tolist() and calls[0]["align"] == "top_left"


def test_no_padding_means_no_mask(calls):
    ids, _ = batch()
    logits(decoder("llama", "attnkit"), input_ids=ids)
    assert calls and all(c["causal"] and c.get("keep") is None and c.get("kv_lengths") is None for c in calls)


def test_a_padding_mask_is_read_again_when_it_changes():
    """The padding read off a 2-D mask is kept for the next layer's same tensor: a mask
    changed in place, or another mask, is read anew (a stale read would attend padding)."""
    class Layer(torch.nn.Module):
        is_causal = False
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))

    def run(mask):
        return attnkit.hf.attention_forward(Layer(), q, k, v, mask)[0]

    def want(mask):
        keep = mask.bool()[:, None, None, :]
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2)

    mask = torch.ones(2, 5, dtype=torch.long)
    for change in (None, (1, 3), (0, 0), None):          # none, right padding, left padding
        if change is not None:
            mask[change] = 0
        assert torch.allclose(run(mask), want(mask), atol=1e-12)
    other = torch.ones(2, 5, dtype=torch.long)           # another tensor, at the same version
    other[0, 2:] = 0
    other[1, 0] = 0
    assert other._version == mask._version
    assert torch.allclose(run(other), want(other), atol=1e-12)
    with torch.inference_mode():                         # no version counter: read every time
        mask = torch.ones(2, 5, dtype=torch.long)
        for change in (None, (1, 3), (0, 0)):
            if change is not None:
                mask[change] = 0
            assert torch.allclose(run(mask), want(mask), atol=1e-12)


def test_a_decoding_step_on_a_long_cache_reads_each_kv_head_once_in_parts(monkeypatch):
    """A generation step (one query row) against 5,000 cached keys, as transformers
    hands it over (8 heads on 2 kv heads) and on the flash rung, as real sizes run:
    each GQA group's heads are one unit's rows, every kv head is read by one unit, its
    keys cut into parts (split-KV), and out equals SDPA's (float64 ≤ 1e-12)."""
    import types

    from attnkit import flash
    monkeypatch.setattr(backends, "SMALL_TOTAL", 0)
    for kept in (api._KEPT, api._ONCE, attnkit.hf._LAYERS):   # (caches: the full path, not a call
        kept.clear()                                          # an earlier run of this test kept)
    seen, parts = [], []
    forward = flash._forward.forward

    def spy(call, *args):                                # the units, and each task's part count
        seen.extend(call.units)
        parts.extend(n for _, _, n, _, _ in flash._forward._plan(call)[1])
        return forward(call, *args)
    monkeypatch.setattr(flash._forward, "forward", spy)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 8, 1, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 5000, 16, generator=g, dtype=torch.float64) for _ in range(2))
    out, _ = attnkit.hf.attention_forward(types.SimpleNamespace(is_causal=True), q, k, v, None, scaling=0.25)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.25, enable_gqa=True).transpose(1, 2)
    assert seen and all(u.g == 4 for u in seen)
    assert sorted(u.h0 // 4 + i for u in seen for i in range(u.nk)) == [0, 1]
    assert parts and min(parts) > 1
    assert (out - want).abs().max() <= 1e-12

@pytest.mark.parametrize("name", ["llama", "gpt_oss", "gemma2"])
def test_generate_with_a_cache_matches_sdpa(name):
    """Greedy decoding, one query against a growing KV cache, left padding: the tokens
    of eager (and for llama of sdpa too)."""
    ids, mask = batch(2)
    mask[1] = torch.tensor([0, 0, 0] + [1] * 8)
    outs = []
    for impl in ("sdpa", "eager", "attnkit") if name == "llama" else ("eager", "attnkit"):
        with torch.no_grad():
            outs.append(decoder(name, impl, torch.float32).generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0))
    assert all(torch.equal(o, outs[-1]) for o in outs[:-1])


def test_gpt_oss_decoding_steps_give_eagers_logits(calls):
    """gpt-oss decoding (float32, no padding): sinks as ``s_aux`` and sliding layers on
    a sliding cache, whose one-row window mask the attention function reads as none;
    each step's logits are eager's. On the small rung each layer's step after the first
    runs its kept call (sinks read in place): the calls reaching attention are the
    prefill's and the first step's."""
    assert transformers.GptOssConfig(num_hidden_layers=2).layer_types == ["sliding_attention", "full_attention"]
    attnkit.hf._LAYERS.clear()       # (kept by id(module): a dead model's layer at a new one's address
    ids, _ = batch(2)                # would take its first step's call, the same call, uncounted)
    outs = []
    for impl in ("eager", "attnkit"):
        with torch.no_grad():
            outs.append(decoder("gpt_oss", impl, torch.float32).generate(
                input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                return_dict_in_generate=True))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert max((a - b).abs().max() for a, b in zip(outs[0].logits, outs[1].logits)) <= 1e-5
    assert all(c.get("sinks") is not None for c in calls)
    assert sum(c.get("keep") is not None for c in calls) == 1      # the prefill's sliding layer only
    assert len(calls) == (2 * 2 if backends.SMALL_TOTAL else 2 * 6)


def test_sink_parameters_get_eager_gradients():
    ids, mask = batch()
    grads = []
    for impl in ("eager", "attnkit"):
        model = decoder("gpt_oss", impl)
        model.zero_grad()
        out = model(input_ids=ids[:1], labels=ids[:1])       # no padding: eager is finite
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if n.endswith("sinks")})
    assert grads[0] and set(grads[0]) == set(grads[1])
    for n in grads[0]:
        assert (grads[0][n] - grads[1][n]).abs().max() <= 1e-10


def test_per_token_sinks_reach_the_softmax():
    """A model that hands per-token sinks (B, H, L, 1) to the attention function."""
    q, k, v = (torch.randn(2, 4, 5, 8, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(2, 4, 5, 1, dtype=torch.float64)
    module = torch.nn.Module()
    module.is_causal = True
    out, _ = attnkit.hf.attention_forward(module, q, k, v, None, scaling=0.35, sinks=sinks)
    scores = (q @ k.transpose(-1, -2) * 0.35).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    w = torch.softmax(torch.cat([scores, sinks], -1), -1)[..., :-1]
    assert (out - (w @ v).transpose(1, 2)).abs().max() <= 1e-12


def encoder_batch():
    ids, mask = batch()
    return dict(input_ids=ids, attention_mask=mask), mask.bool()


def test_bert_with_padding_and_attentions_matches_eager(calls):
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64)
    inputs, real = encoder_batch()
    outs = []
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = transformers.BertModel._from_config(cfg, attn_implementation=impl).double().eval()
        with torch.no_grad():
            outs.append(model(**inputs, output_attentions=True))
    assert (outs[0].last_hidden_state - outs[1].last_hidden_state)[real].abs().max() <= 1e-10
    pairs = real[:, None, :, None] & real[:, None, None, :]
    for a, b in zip(outs[0].attentions, outs[1].attentions):   # output_attentions: the exact weights
        assert (a - b).masked_fill(~pairs, 0).abs().max() <= 1e-10
    assert all(not c["causal"] and c.get("keep") is not None and c["keep"].shape[-2] == 1 for c in calls)


def test_gpt2_returns_attentions_although_it_does_not_pass_the_keyword():
    ids, _ = batch()
    outs = []
    for impl in ("eager", "attnkit"):
        with torch.no_grad():
            outs.append(decoder("gpt2", impl)(input_ids=ids, output_attentions=True).attentions)
    assert len(outs[1]) == 2 and all(a is not None for a in outs[1])
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= 1e-10


@pytest.mark.parametrize("name", ["t5", "bart", "whisper", "vit"])
def test_encoder_decoders_and_vision_match_sdpa(name):
    ids, mask = batch()
    dec = torch.randint(1, 97, (3, 6), generator=torch.Generator().manual_seed(2))
    if name == "t5":
        cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    decoder_start_token_id=0)
        cls, inputs = transformers.T5ForConditionalGeneration, dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    elif name == "bart":
        cfg = transformers.BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                      max_position_embeddings=64)
        cls, inputs = transformers.BartForConditionalGeneration, dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec)
    elif name == "whisper":
        cfg = transformers.WhisperConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                                         max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                         decoder_start_token_id=1)
        g = torch.Generator().manual_seed(3)
        cls, inputs = transformers.WhisperForConditionalGeneration, dict(
            input_features=torch.randn(3, 8, 32, generator=g, dtype=torch.float64), decoder_input_ids=dec)
    else:
        cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64)
        g = torch.Generator().manual_seed(3)
        cls, inputs = transformers.ViTModel, dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g, dtype=torch.float64))
    outs = []
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation=impl).double().eval()
        with torch.no_grad():
            o = model(**inputs)
        outs.append(o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state)
    assert (outs[0] - outs[1]).abs().max() <= 1e-10


def packed_sequences(lengths=(5, 3, 7)):
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(1, 97, (n,), generator=g) for n in lengths]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return seqs, torch.cat(seqs)[None], pos


@pytest.mark.parametrize("name, how", [("llama", "position_ids"), ("gemma3", "position_ids"),
                                       ("llama", "cu_seq_lens"), ("gemma3", "cu_seq_lens"), ("gpt_oss", "cu_seq_lens")])
def test_packed_batch_equals_the_sequences_unpacked(name, how, calls):
    """Padding-free training (no cache): three sequences packed into one row with
    restarting position_ids — or FlashAttention's cu_seq_lens keywords — give the
    logits of the same sequences one by one, sliding-window layers (window 5, the
    last sequence 7 long) and sinks included. (gpt_oss builds its masks without
    position_ids, so only the keywords pack it.)"""
    seqs, packed, pos = packed_sequences()
    model = decoder(name, "attnkit")
    kw = {}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 5, 8, 15])
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
    with torch.no_grad():
        logits_packed = model(input_ids=packed, position_ids=pos, use_cache=False, **kw).logits[0]
        assert calls and all(c.get("cu_seqlens_q") is not None for c in calls)
        start = 0
        for s in seqs:
            alone = model(input_ids=s[None]).logits[0]
            assert (logits_packed[start:start + len(s)] - alone).abs().max() <= 1e-10
            start += len(s)


@pytest.mark.parametrize("name, how", [("llama", "position_ids"), ("llama", "cu_seq_lens"),
                                       ("gpt_oss", "cu_seq_lens")])    # (gemma3 normalises in float32)
def test_training_packed_gives_the_loss_and_gradients_of_the_sequences_unpacked(name, how, calls):
    """A training step on three sequences packed into one row has the loss (next-token
    cross-entropy summed over each sequence's own tokens, in float64: transformers'
    own loss is float32 for some models) and every parameter's gradient of the same
    sequences run one by one (float64 ≤ 1e-10), attention running packed."""
    seqs, packed, pos = packed_sequences()
    model = decoder(name, "attnkit").train()
    kw = {}
    if how == "cu_seq_lens":
        cu = torch.tensor([0, 5, 8, 15])
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)

    def nll(logits, ids):                        # next-token loss within one sequence
        return torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum")
    params = [p for p in model.parameters() if p.requires_grad]
    out = model(input_ids=packed, position_ids=pos, use_cache=False, **kw).logits[0]
    assert calls and all(c.get("cu_seqlens_q") is not None for c in calls)
    ends = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0).tolist()
    loss = sum(nll(out[a:b], packed[0, a:b]) for a, b in zip([0] + ends[:-1], ends))
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    alone = sum(nll(model(input_ids=s[None], use_cache=False).logits[0], s) for s in seqs)
    want = torch.autograd.grad(alone, params, allow_unused=True)
    assert abs(float(loss - alone)) <= 1e-10
    for g, w in zip(grads, want):
        assert (g is None) == (w is None) and (g is None or (g - w).abs().max() <= 1e-10)

@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_restarting_positions_with_a_cache_are_not_packed(name, calls):
    """With a cache transformers builds no packed mask, and sdpa attends across the
    restarts: attnkit follows the mask it was given, in every layer alike."""
    _, packed, pos = packed_sequences()
    ours = logits(decoder(name, "attnkit"), input_ids=packed, position_ids=pos)
    assert calls and all(c.get("cu_seqlens_q") is None for c in calls)
    assert (ours - logits(decoder(name, "sdpa"), input_ids=packed, position_ids=pos)).abs().max() <= 1e-10


def test_a_static_cache_without_a_mask_matches_sdpa():
    """Prefill in two chunks into a StaticCache (its later slots empty) with no
    attention_mask: the causal diagonal is the tokens so far, not the cache's end."""
    ids, _ = batch(2)
    outs = []
    for impl in ("sdpa", "attnkit"):
        model = decoder("llama", impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            first = model(input_ids=ids[:, :6], cache=cache).logits
            second = model(input_ids=ids[:, 6:], cache=cache).logits
        outs.append(torch.cat([first, second], 1))
    assert (outs[0] - outs[1]).abs().max() <= 1e-10


@pytest.mark.parametrize("span", ["the cache", "16 slots", "fewer than the tokens"])
def test_a_static_cache_with_a_mask_over_other_slots_matches_sdpa(span):
    """A fixed-length 2-D mask on a StaticCache (ones on the tokens so far, zeros after:
    a loop that never reshapes its mask), or one shorter than the tokens so far (the
    missing slots padding, as transformers reads it): the causal diagonal stays at the
    tokens so far. Two chunks, left padding in one row."""
    ids, _ = batch(2)
    n = {"the cache": 32, "16 slots": 16, "fewer than the tokens": None}[span]
    outs = []
    for impl in ("sdpa", "attnkit"):
        model = decoder("llama", impl)
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        got = []
        for a, b in ((0, 6), (6, 8)):
            width = n or b - 2
            mask = torch.zeros(2, width, dtype=torch.long)
            mask[:, :min(b, width)] = 1
            mask[1, :3] = 0
            with torch.no_grad():
                got.append(model(input_ids=ids[:, a:b], attention_mask=mask, cache=cache).logits)
        outs.append(torch.cat(got, 1))
    real = torch.ones(2, 8, dtype=torch.bool)
    real[1, :3] = False
    assert (outs[0] - outs[1])[real].abs().max() <= 1e-10


@pytest.mark.parametrize("decoder_mask", [False, True])
def test_t5_on_a_static_cache_matches_sdpa(decoder_mask):
    """T5's position bias spans the static cache; the keys past the tokens so far are
    cut from it with the keys (with and without a decoder mask)."""
    cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0)
    ids, _ = batch(2)                            # (sdpa fails on a padded encoder here)
    dec = torch.randint(3, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    kw = dict(decoder_attention_mask=torch.ones(2, 5, dtype=torch.long)) if decoder_mask else {}
    outs = []
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        model = transformers.T5ForConditionalGeneration._from_config(cfg, attn_implementation=impl).double().eval()
        cache = transformers.EncoderDecoderCache(transformers.StaticCache(config=cfg, max_cache_len=16),
                                                 transformers.StaticCache(config=cfg, max_cache_len=16))
        with torch.no_grad():
            outs.append(model(input_ids=ids, decoder_input_ids=dec, cache=cache, use_cache=True, **kw).logits)
    assert (outs[0] - outs[1]).abs().max() <= 1e-10


def test_a_sliding_window_keyword_without_a_sliding_mask_is_ignored():
    """OLMoE passes sliding_window but builds a plain causal mask; sdpa and eager read
    the mask, so the window must not depend on whether the batch has padding."""
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = True
    plain, _ = attnkit.hf.attention_forward(module, q, k, v, None)
    windowed, _ = attnkit.hf.attention_forward(module, q, k, v, None, sliding_window=2)
    padded, _ = attnkit.hf.attention_forward(module, q, k, v, torch.ones(1, 6, dtype=torch.bool), sliding_window=2)
    assert torch.equal(plain, windowed) and torch.equal(plain, padded)


@pytest.mark.parametrize("name", ["xglm", "nllb_moe", "splinter", "align_text"])
def test_models_without_attention_backends_get_eager_masks(name):
    """Models that support neither attention backends nor sdpa (hand-written
    attention, or layers whose is_causal is not kept) get transformers' eager mask,
    and so eager's results: causal decoders stay causal, encoders bidirectional —
    towers of composite models too (ALIGN's text encoder has no model type of its own
    in transformers' auto tables)."""
    ids, mask = batch()
    if name == "xglm":
        cfg = transformers.XGLMConfig(vocab_size=97, d_model=32, num_layers=2, attention_heads=4, ffn_dim=64,
                                      max_position_embeddings=64)
        cls, kw = transformers.XGLMForCausalLM, dict(input_ids=ids, attention_mask=mask)
    elif name == "nllb_moe":
        cfg = transformers.NllbMoeConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_ffn_dim=64, num_experts=2, max_position_embeddings=64)
        dec = torch.randint(3, 97, (3, 6), generator=torch.Generator().manual_seed(2))
        cls, kw = transformers.NllbMoeForConditionalGeneration, dict(input_ids=ids, attention_mask=mask,
                                                                      decoder_input_ids=dec)
    elif name == "align_text":
        cfg = transformers.AlignTextConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=64, max_position_embeddings=64)
        cls, kw = transformers.AlignTextModel, dict(input_ids=ids, attention_mask=mask)
    else:
        cfg = transformers.SplinterConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                          intermediate_size=64, max_position_embeddings=64, question_token_id=5)
        cls, kw = transformers.SplinterModel, dict(input_ids=ids, attention_mask=mask)
    outs = []
    for impl in ("eager", "attnkit"):
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation=impl).eval()      # float32: XGLM's own
        with torch.no_grad():                                                # attention needs it
            o = model(**kw)
        outs.append(o.logits if getattr(o, "logits", None) is not None else o.last_hidden_state)
    real = mask.bool() if name != "nllb_moe" else torch.ones(outs[0].shape[:2], dtype=torch.bool)
    assert (outs[0] - outs[1])[real].abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_indexers_choose_the_keys(name):
    """DeepSeek-V3.2-style layers pass the indexer's top-k keys per query as
    ``indices`` to every implementation but eager and sdpa (which get them folded into
    the mask): attnkit folds them the same way (top 4 of up to 12 keys here). Their
    indexer reads the 4-D mask itself, decoding steps' too: generation gives sdpa's
    tokens."""
    cfg = transformers.AutoConfig.for_model(
        name, vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        n_group=1, topk_group=1, max_position_embeddings=64, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, head_dim=8, index_n_heads=2, index_head_dim=16,
        index_topk=4)
    ids, mask = batch(2, 12)
    outs, tokens = [], []
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl,
                                                              experts_implementation="eager").double().eval()
        outs.append(logits(model, input_ids=ids, attention_mask=mask))
        with torch.no_grad():
            tokens.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                         pad_token_id=0))
    assert (outs[0] - outs[1])[mask.bool()].abs().max() <= 1e-10
    assert torch.equal(tokens[0], tokens[1])


def test_a_block_sparse_indexer_chooses_the_key_blocks():
    """MiniMax-M3's sparse layers pass the indexer's top-k key blocks per query and
    index head as ``block_indices`` to every implementation but eager and sdpa (which
    get them built into the mask): attnkit keeps the same keys as sdpa (2 of up to 5
    blocks of 4 here, an index head for each pair of query heads), with left padding,
    and generates its tokens with a cache. (Eager is no reference here: its softmax is
    float32, and in float64 its padded rows overflow the model's mask to NaN. A padded
    batch's generate is not compared: the indexer scores padding keys too, from the
    outputs of fully masked rows — the mean of v in sdpa, 0 in attnkit.)"""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3
    cfg = m3.MiniMaxM3VLTextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=64, dense_intermediate_size=128,
        shared_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        rotary_dim=8, num_local_experts=4, num_experts_per_tok=2, mlp_layer_types=["dense", "dense"],
        index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2, index_local_blocks=1,
        layer_types=["minimax_m3_sparse", "full_attention"], initializer_range=0.15, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = m3.MiniMaxM3VLForCausalLM._from_config(cfg, attn_implementation="eager").double().eval()
    ids, mask = batch(2, 17)
    out = {}
    for impl in ("sdpa", "attnkit"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            out[impl] = (logits(model, input_ids=ids, attention_mask=mask),
                         model.generate(input_ids=ids, max_new_tokens=6, do_sample=False))
    assert (out["sdpa"][0] - out["attnkit"][0])[mask.bool()].abs().max() <= 1e-10
    assert torch.equal(out["sdpa"][1], out["attnkit"][1])


@pytest.mark.parametrize("name", ["bert", "gpt2", "t5"])
def test_training_with_dropout_runs_and_is_reproducible(name, calls):
    ids, mask = batch()
    if name == "bert":
        cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64)
        cls, kw = transformers.BertForMaskedLM, dict(input_ids=ids, attention_mask=mask, labels=ids)
    elif name == "gpt2":
        cfg, cls = DECODERS["gpt2"](), transformers.GPT2LMHeadModel
        kw = dict(input_ids=ids, labels=ids)
    else:
        cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                    decoder_start_token_id=0)
        cls, kw = transformers.T5ForConditionalGeneration, dict(input_ids=ids, attention_mask=mask, labels=ids[:, :6].contiguous())
    assert cfg.to_dict().get("attention_probs_dropout_prob", cfg.to_dict().get("attn_pdrop", cfg.to_dict().get("dropout_rate"))) > 0

    def losses(impl, seeds):
        torch.manual_seed(0)
        model = cls._from_config(cfg, attn_implementation=impl).train()
        out = []
        for s in seeds:
            torch.manual_seed(s)
            loss = model(**kw).loss
            out.append(loss.item())
        loss.backward()                                  # the query projections' gradients pass through dq
        wq = [p for n, p in model.named_parameters() if n.endswith(("query.weight", "c_attn.weight", "SelfAttention.q.weight"))]
        assert wq and all(p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in wq)
        return out

    a = losses("attnkit", [7, 7, 8])
    assert a[0] == a[1] and a[0] != a[2]                 # torch.manual_seed makes a step reproducible
    assert calls and all(c["dropout"] > 0 for c in calls)   # attention dropout itself, not only hidden dropout
    ours, eager = losses("attnkit", range(24)), losses("eager", range(24))
    mean = lambda x: sum(x) / len(x)
    sd = (sum((x - mean(eager)) ** 2 for x in eager) / (len(eager) - 1)) ** 0.5
    assert abs(mean(ours) - mean(eager)) <= 4 * sd / len(eager) ** 0.5 * 2 ** 0.5 + 1e-6


def test_a_model_compiles_whole_in_a_fresh_process(monkeypatch):
    """torch.compile(fullgraph=True) of a model whose first mask is built while
    tracing: the mask builder's lookups (model classes, a static cache's offset) trace."""
    monkeypatch.setattr(attnkit.hf, "_TRUSTED", {})         # as in a process that built no mask yet
    torch._dynamo.reset()
    ids, mask = batch(3)
    model = decoder("llama", "attnkit", torch.float32)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        assert (compiled(input_ids=ids).logits - model(input_ids=ids).logits).abs().max() <= 1e-5
        # a padding mask (left and right) and one of ones: no branch on the mask's values
        for m in (mask, torch.ones_like(mask)):
            assert (compiled(input_ids=ids, attention_mask=m).logits
                    - model(input_ids=ids, attention_mask=m).logits).abs().max() <= 1e-5


def test_autocast_runs_a_model_as_for_sdpa():
    """Under torch.autocast a Llama layer hands over float32 q and k (rotary) and a
    bfloat16 v: attnkit computes in bfloat16, as SDPA does, and gives its logits."""
    ids, mask = batch()
    out = {}
    for impl in ("sdpa", "attnkit"):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out[impl] = decoder("llama", impl, torch.float32)(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert out["attnkit"].dtype == out["sdpa"].dtype == torch.bfloat16
    assert (out["attnkit"] - out["sdpa"]).float()[real].abs().max() <= 0.05 * out["sdpa"].float().abs().max()


def test_unknown_keywords_that_change_the_result_are_refused():
    q = torch.randn(1, 2, 3, 4)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="^frobnicate"):
        attnkit.hf.attention_forward(module, q, q, q, None, frobnicate=True)
    with pytest.raises(ValueError, match="^head_mask"):
        attnkit.hf.attention_forward(module, q, q, q, None, head_mask=torch.ones(2))
    out, w = attnkit.hf.attention_forward(module, q, q, q, None, use_cache=True, frobnicate=None, layer_idx=0)
    assert out.shape == (1, 3, 2, 4) and w is None
