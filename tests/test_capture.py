"""attnkit.hf.capture: a transformers model's attention calls recorded (q, k, v and
the keywords that reproduce each), the model computing as before and switched back."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnkit  # noqa: E402
import attnkit.hf  # noqa: E402
from attnkit.testing import max_error  # noqa: E402

CFG = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=64, max_position_embeddings=64)


def _model(impl="sdpa"):
    attnkit.hf.register()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG),
                                                         attn_implementation=impl).eval()


def _reproduces(c, real=None):
    """attnkit.attention on the recorded q, k, v with the recorded keywords gives the
    model's own output (B, L, H, Dv) (on the real query rows ``real`` (B, L))."""
    got = attnkit.attention(c.q, c.k, c.v, **c.options).transpose(1, 2)
    if real is not None:
        got, want = got[real], c.out[real]
    else:
        want = c.out
    return max_error(got.numpy(), want.numpy()) <= 1e-5


@pytest.mark.parametrize("impl", ["sdpa", "attnkit"])
def test_every_call_of_a_generate_is_recorded_and_reproduced(impl):
    """Prefill and decoding steps of a GQA model: one call per layer and forward, named
    by the layer, q/k/v of its shapes (the cache's keys), and attnkit.attention with
    the recorded keywords reproduces each; the model's tokens are unchanged and its
    implementation comes back."""
    model = _model(impl)
    own = transformers.AttentionInterface._global_mapping[impl]
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
        with attnkit.hf.capture(model) as calls:
            got = model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
            assert model.config._attn_implementation == impl      # (transformers branches on the name)
    assert torch.equal(got, want)
    assert transformers.AttentionInterface._global_mapping[impl] is own
    assert [c.name for c in calls] == ["model.layers.0.self_attn", "model.layers.1.self_attn"] * 3
    assert [tuple(c.k.shape) for c in calls[::2]] == [(2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 7, 8)]
    assert tuple(calls[0].q.shape) == (2, 4, 5, 8) and tuple(calls[-1].q.shape) == (2, 4, 1, 8)
    assert calls[0].options["causal"] is True
    assert all(_reproduces(c) for c in calls)


def test_a_padded_batch_records_its_mask():
    """Left padding: the recorded keywords carry the padding (sdpa's own mask, as keep),
    and reproduce the real tokens' rows."""
    model = _model()
    ids = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad(), attnkit.hf.capture(model) as calls:
        model(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2 and "keep" in calls[0].options
    assert all(_reproduces(c, real=mask.bool()) for c in calls)


def test_explain_shows_a_recorded_head():
    """The recorded call explained: every head's output is the model's."""
    model = _model()
    with torch.no_grad(), attnkit.hf.capture(model) as calls:
        model(input_ids=torch.tensor([[3, 1, 4, 1]]))
    c = calls[1]
    trace = attnkit.explain(c.q, c.k, c.v, **c.options)
    assert np.allclose(np.asarray(trace.out), c.out.transpose(1, 2).numpy(), atol=1e-5)


def test_the_function_comes_back_when_the_block_raises():
    model = _model()
    own = transformers.AttentionInterface._global_mapping["sdpa"]
    with pytest.raises(RuntimeError, match="stop"), attnkit.hf.capture(model):
        raise RuntimeError("stop")
    assert transformers.AttentionInterface._global_mapping["sdpa"] is own


def test_only_this_models_layers_those_named_and_the_first_calls():
    """Another model on the same function is not recorded; ``names`` and
    ``max_calls`` narrow the record; nested captures both record."""
    model, other = _model(), _model()
    ids = torch.tensor([[3, 1, 4, 1]])
    with torch.no_grad():
        with attnkit.hf.capture(model) as calls:
            other(input_ids=ids)
        assert calls == []
        with attnkit.hf.capture(model, names={"model.layers.1.self_attn"}) as one, \
                attnkit.hf.capture(model, max_calls=1) as first:
            model(input_ids=ids)
            model(input_ids=ids)
    assert [c.name for c in one] == ["model.layers.1.self_attn"] * 2
    assert [c.name for c in first] == ["model.layers.0.self_attn"]


def test_a_composite_model_keeps_each_towers_implementation():
    """CLIP with its text tower on sdpa and its vision tower on eager: the text
    tower's calls are recorded, the vision tower's are not (eager is no registered
    function), and both towers keep their implementations."""
    text = transformers.CLIPTextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=4, max_position_embeddings=16)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=16, patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16)
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(
        cfg, attn_implementation={"text_config": "sdpa", "vision_config": "eager", "": "sdpa"}).eval()
    towers = lambda: (model.text_model.config._attn_implementation, model.vision_model.config._attn_implementation)
    before = towers()
    with torch.no_grad(), attnkit.hf.capture(model) as calls:
        model(input_ids=torch.tensor([[1, 2, 3]]), pixel_values=torch.randn(1, 3, 16, 16))
    assert before == ("sdpa", "eager") and towers() == before
    assert [c.name for c in calls] == ["text_model.encoder.layers.0.self_attn"] and _reproduces(calls[0])


def test_what_it_cannot_capture_is_named():
    with pytest.raises(ValueError, match=r"\['eager'\] is not a registered attention function"), \
            attnkit.hf.capture(_model("eager")):
        pass
    with pytest.raises(TypeError, match="model: expected a transformers model, got int"), attnkit.hf.capture(3):
        pass


def test_a_keyword_attnkit_cannot_honour_is_recorded_not_raised():
    """A layer passing a keyword attnkit does not know: the model still runs (its own
    function computes), and the record says why it has no keywords."""
    model = _model()
    attend = transformers.AttentionInterface()["sdpa"]
    transformers.AttentionInterface.register(
        "sdpa_odd", lambda *a, **kw: attend(*a, **{n: x for n, x in kw.items() if n != "odd"}))
    transformers.AttentionMaskInterface.register("sdpa_odd", transformers.AttentionMaskInterface()["sdpa"])
    model.set_attn_implementation("sdpa_odd")
    layer = model.model.layers[0].self_attn
    forward = layer.forward
    layer.forward = lambda *a, **kw: forward(*a, odd=1, **kw)
    with torch.no_grad(), attnkit.hf.capture(model) as calls:
        model(input_ids=torch.tensor([[3, 1, 4]]))
    assert calls[0].options is None and calls[0].why.startswith("odd: attnkit's transformers integration")
    assert calls[1].options is not None and calls[1].why is None and _reproduces(calls[1])
