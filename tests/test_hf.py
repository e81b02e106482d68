"""Hugging Face transformers on attnkit: tiny random BERT and Llama built from configs
(no downloads) give the eager outputs with attn_implementation="attnkit"."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnkit.hf  # noqa: E402
from attnkit import api  # noqa: E402

TOL = 1e-5


@pytest.fixture(autouse=True)
def registered():
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


def build(kind, impl):
    torch.manual_seed(0)                         # same random weights for every impl
    if kind == "bert":
        cfg = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64)
        return transformers.BertModel(cfg) if impl is None else \
            transformers.AutoModel.from_config(cfg, attn_implementation=impl).eval()
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 7:] = 0                              # right padding
    mask[2, :4] = 0                              # left padding
    return ids, mask


def run(model, **kw):
    with torch.no_grad():
        attn = kw.pop("attn", False)
        out = model(**kw, output_attentions=attn)
    return out


def test_bert_with_padding_matches_eager(calls):
    ids, mask = batch()
    eager = run(build("bert", "eager"), input_ids=ids, attention_mask=mask, attn=True)
    ours_model = build("bert", "attnkit")
    assert ours_model.config._attn_implementation == "attnkit"
    ours = run(ours_model, input_ids=ids, attention_mask=mask, attn=True)
    real = mask.bool()
    assert (eager.last_hidden_state - ours.last_hidden_state)[real].abs().max() <= TOL
    assert len(calls) == 2 and all(c["keep"] is not None and not c["causal"] for c in calls)
    for a, b in zip(eager.attentions, ours.attentions):        # output_attentions: exact weights
        assert (a - b).abs().max() <= TOL
    no_pad = run(ours_model, input_ids=ids)                    # no padding: no mask at all
    assert calls[-1]["keep"] is None and not calls[-1]["causal"]
    assert (run(build("bert", "eager"), input_ids=ids).last_hidden_state
            - no_pad.last_hidden_state).abs().max() <= TOL


@pytest.mark.parametrize("padded", [False, True])
def test_llama_causal_gqa_matches_eager(calls, padded):
    ids, mask = batch()
    kw = {"input_ids": ids, "attention_mask": mask} if padded else {"input_ids": ids}
    eager = run(build("llama", "eager"), **kw).logits
    ours = run(build("llama", "attnkit"), **kw).logits
    real = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
    assert (eager - ours)[real].abs().max() <= TOL           # left-padded rows see no key: 0, not eager's mean
    assert calls and all(c["causal"] == (not padded) and (c["keep"] is not None) == padded for c in calls)


def test_llama_generate_with_cache_matches_eager():
    """Decoding one query against a growing KV cache (L = 1 < S) with padding."""
    ids, mask = batch()
    ids, mask = ids[:2], mask[:2].clone()
    mask[1] = torch.tensor([0, 0, 0] + [1] * 8)                # left padding for generation
    outs = []
    for impl in ("eager", "attnkit"):
        model = build("llama", impl)
        with torch.no_grad():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                       pad_token_id=0))
    assert torch.equal(outs[0], outs[1])


def test_dropout_in_training_is_refused():
    model = build("bert", "attnkit").train()
    ids, mask = batch()
    with pytest.raises(ValueError, match="dropout"):
        model(input_ids=ids, attention_mask=mask)
