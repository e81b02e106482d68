"""The flash rung's kept call (attnkit.flash.direct): a call that repeats a signature —
lengths and offsets by value — runs the compiled tile loop on the first call's plan,
with the full path's bits, and takes the full path wherever it would differ."""

import copy
import gc

import numpy as np
import pytest

import attnkit
from attnkit import api, flash
from attnkit.flash import forward, plan

torch = pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def _fresh():
    api._KEPT.clear()
    api._ONCE.clear()
    yield
    api._KEPT.clear()
    api._ONCE.clear()


@pytest.fixture
def full(monkeypatch):
    """Counts the flash forwards that take the full path."""
    n = [0]
    inner = forward.forward

    def counted(*a, **kw):
        n[0] += 1
        return inner(*a, **kw)
    monkeypatch.setattr(forward, "forward", counted)
    return n


def _qkv(lib, B=3, H=4, A=2, L=80, S=80, D=16, Dv=8, seed=0, inner=True):
    """q, k, v in float32; ``inner``: transformers' layout (B, L, H, D) seen as (B, H, L, D)."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal((B, n, h, d), dtype=np.float32) for n, h, d in ((L, H, D), (S, A, D), (S, A, Dv))]
    xs = [x.transpose(0, 2, 1, 3) if inner else np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in xs]
    return xs if lib == "numpy" else [torch.from_numpy(x) for x in xs]


def _np(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def _strides(x):
    return x.strides if isinstance(x, np.ndarray) else x.stride()


def _same(got, want):
    for g, w in zip(got, want):
        assert type(g) is type(w) and g.shape == w.shape and _strides(g) == _strides(w)
        assert np.array_equal(_np(g), _np(w), equal_nan=True)


def _fresh_call(q, k, v, **kw):
    api._KEPT.clear()
    api._ONCE.clear()
    return attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)


def _lengths(lib, values):
    a = np.array(values, dtype=np.int64)
    return a if lib == "numpy" else torch.from_numpy(a)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(kv=[80, 17, 0]),
                                dict(kv=[80, 17, 3], causal=True, align="top_left"),
                                dict(kv=[73, 80, 9], q=[80, 70, 80], causal=True, window=(5, 0))])
def test_a_repeated_call_runs_kept_with_the_full_paths_bits(lib, kw, full):
    """From the second call of a key on, no full path; out (its layout too) and lse are
    the full path's on every call. Query rows past a sequence's length (padding, which
    the loop does not write): the full path every time."""
    kw = dict(kw)
    for name, key in (("kv", "kv_lengths"), ("q", "q_lengths")):
        if name in kw:
            kw[key] = _lengths(lib, kw.pop(name))
    first = 4 if "q_lengths" in kw else 2
    q, k, v = _qkv(lib)
    for i in range(4):
        got = attnkit.attention(q, k, v, return_lse=True, backend="flash", **kw)
        assert full[0] == min(i + 1, first), i
        plan._KEPT.clear()                               # the plan's arrays: the kept call's own
        gc.collect()
    assert len(api._KEPT) == (first < 4)
    _same(got, _fresh_call(q, k, v, **kw))
    q2, k2, v2 = _qkv(lib, seed=1, inner=False)                         # new arrays, C-ordered: kept too
    got = attnkit.attention(q2, k2, v2, return_lse=True, backend="flash", **kw)
    _same(got, _fresh_call(q2, k2, v2, **kw))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_other_lengths_are_another_call(lib):
    """The lengths' values are part of the key: a batch with other lengths gets its own
    plan (the kept one would attend keys past a length, or skip ones before it)."""
    q, k, v = _qkv(lib)
    for _ in range(3):
        attnkit.attention(q, k, v, kv_lengths=_lengths(lib, [80, 17, 3]), causal=True, backend="flash")
    for lengths in ([80, 30, 3], [12, 17, 80]):
        got = attnkit.attention(q, k, v, kv_lengths=_lengths(lib, lengths), causal=True, return_lse=True,
                                backend="flash")
        _same(got, _fresh_call(q, k, v, kv_lengths=_lengths(lib, lengths), causal=True))


def test_a_key_length_layout_or_setting_it_was_not_kept_for_takes_the_full_path(full, monkeypatch):
    """Another key length (no lengths given: S is not in the key), keys strided along
    D (BLAS cannot read them in place), or changed plan settings: the full path."""
    q, k, v = _qkv("torch")
    for _ in range(3):
        attnkit.attention(q, k, v, causal=True, backend="flash")
    assert full[0] == 2
    for q2, k2, v2 in [_qkv("torch", S=81), (q, torch.from_numpy(np.repeat(_np(k), 2, axis=-1)[..., ::2]), v)]:
        n = full[0]
        got = attnkit.attention(q2, k2, v2, causal=True, return_lse=True, backend="flash")
        assert full[0] == n + 1
        _same(got, _fresh_call(q2, k2, v2, causal=True))
    attnkit.attention(q, k, v, causal=True, backend="flash")
    attnkit.attention(q, k, v, causal=True, backend="flash")
    n = full[0]
    attnkit.attention(q, k, v, causal=True, backend="flash")
    assert full[0] == n
    sizes = plan.block_sizes
    for name, value in (("MIN_TASKS", 64), ("block_sizes", lambda *a, **kw: (64, 64) if len(a) < 3 else sizes(*a))):
        with monkeypatch.context() as m:
            m.setattr(plan, name, value)
            got = attnkit.attention(q, k, v, causal=True, return_lse=True, backend="flash")
            assert full[0] == n + 1
            _same(got, _fresh_call(q, k, v, causal=True))
        api._KEPT.clear()
        api._ONCE.clear()
        for _ in range(2):
            attnkit.attention(q, k, v, causal=True, backend="flash")
        n = full[0]


def test_each_key_length_is_kept_for_itself_and_only_when_it_comes_again(full):
    """A signature with two key lengths in turn (self- and cross-attention of one
    shape) keeps a call for each; key lengths that change at every call keep none
    (each would make a plan for one call)."""
    (q, k, v), (_, k2, v2) = _qkv("torch"), _qkv("torch", S=81, seed=1)
    for _ in range(2):
        attnkit.attention(q, k, v, causal=True, backend="flash")
        attnkit.attention(q, k2, v2, causal=True, backend="flash")
    n = full[0]
    for _ in range(2):
        got = attnkit.attention(q, k, v, causal=True, return_lse=True, backend="flash")
        got2 = attnkit.attention(q, k2, v2, causal=True, return_lse=True, backend="flash")
    assert full[0] == n and len(api._KEPT) == 2
    _same(got, _fresh_call(q, k, v, causal=True))
    _same(got2, _fresh_call(q, k2, v2, causal=True))
    api._KEPT.clear()
    for S in range(60, 66):
        _, k3, v3 = _qkv("torch", S=S)
        attnkit.attention(q, k3, v3, causal=True, backend="flash")
    assert not api._KEPT


def test_a_tensor_numpy_cannot_view_takes_the_full_path():
    """k with its negative bit set (a view NumPy cannot read): the full path, every
    time, with the bits of k resolved."""
    q, k, v = _qkv("torch")
    kc = torch.complex(torch.zeros_like(k), k).conj().imag          # −k as a negative-bit view
    assert kc.is_neg() and torch.equal(kc.resolve_neg(), -k)
    for _ in range(3):
        got = attnkit.attention(q, kc, v, causal=True, return_lse=True, backend="flash")
    _same(got, _fresh_call(q, kc.resolve_neg(), v, causal=True))


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_a_product_that_is_not_finite_takes_the_full_path(lib):
    """inf in a value row that the rows before it do not see (causal) but their tile
    holds: its product p v is not finite (0 · inf), which the full path's Python loop
    takes exactly (DESIGN: an excluded key never reaches out); the kept call hands the
    call over."""
    q, k, v = _qkv(lib)
    for _ in range(3):
        attnkit.attention(q, k, v, causal=True, backend="flash")
    bad = _np(v).copy()
    bad[1, :, 50] = np.inf
    bad = bad if lib == "numpy" else torch.from_numpy(bad)
    got = attnkit.attention(q, k, bad, causal=True, return_lse=True, backend="flash")
    assert np.isfinite(_np(got[0])[:, :, :50]).all()
    _same(got, _fresh_call(q, k, bad, causal=True))


def test_only_calls_the_loop_runs_whole_are_kept():
    """Sinks, a keep mask, float64, a split of the keys (few rows, many keys): no kept
    call (the full path each time)."""
    q, k, v = _qkv("numpy")
    rng = np.random.default_rng(0)
    for kw in (dict(sinks=rng.standard_normal(4).astype(np.float32)), dict(keep=np.ones((80, 80), bool))):
        for _ in range(3):
            attnkit.attention(q, k, v, backend="flash", **kw)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    attnkit.attention(q64, k64, v64, backend="flash")
    attnkit.attention(q64, k64, v64, backend="flash")
    assert not api._KEPT
    qd, kd, vd = _qkv("numpy", B=1, H=2, A=2, L=1, S=4096)
    spec = attnkit.spec.validate(qd, kd, vd)
    assert flash.direct(spec) is None


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_operands_without_a_batch_dim(lib):
    q, k, v = (x[0] for x in _qkv(lib))
    for _ in range(3):
        got = attnkit.attention(q, k, v, causal=True, return_lse=True, backend="flash")
    assert len(api._KEPT) == 1
    _same(got, _fresh_call(q, k, v, causal=True))


def test_a_padded_model_runs_its_layers_kept_with_the_same_outputs(full):
    """A BERT forward with a padding mask (transformers gives each layer the same
    kv_lengths): the first two layers take the full path, every later layer call and
    every later forward the kept call — the same outputs, bit for bit, forward after
    forward, and SDPA's up to rounding on the real tokens."""
    transformers = pytest.importorskip("transformers")
    import attnkit.hf
    attnkit.hf.register()
    cfg = transformers.BertConfig(vocab_size=97, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                  intermediate_size=64, max_position_embeddings=256)
    ids = torch.randint(1, 97, (3, 256), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 256, dtype=torch.long)
    mask[1, 150:] = 0
    mask[2, 20:] = 0
    outs = {}
    for impl in ("sdpa", "attnkit"):
        torch.manual_seed(0)
        model = transformers.AutoModel.from_config(copy.deepcopy(cfg), attn_implementation=impl).eval()
        with torch.no_grad():
            outs[impl] = [model(input_ids=ids, attention_mask=mask).last_hidden_state for _ in range(3)]
    assert full[0] == 2 and len(api._KEPT) == 1
    assert all(torch.equal(o, outs["attnkit"][0]) for o in outs["attnkit"])
    real = mask.bool()
    assert float((outs["attnkit"][0] - outs["sdpa"][0])[real].abs().max()) < 1e-5


class _Layer:
    """What transformers passes as ``module``: an encoder's attention layer."""
    is_causal = False


def _refuse(*a, **kw):
    raise AssertionError("the call took attention's steps")


def test_a_padded_layer_reruns_its_kept_call_for_its_padding_only(monkeypatch):
    """transformers' hook keeps a layer's call with a 2-D padding mask as one without a
    mask, the lengths' bytes in its key: a repeat runs without attention's steps and
    gives attention's bits; other lengths, the mask changed in place, left padding (a
    keep mask), a sliding window, or recording attentions take the full path and get
    their own result."""
    from attnkit import hf
    hf._LAYERS.clear()
    layer = _Layer()
    q, k, v = _qkv("torch", B=3, H=8, A=8, L=256, S=256, D=32, Dv=32)
    mask = torch.ones(3, 256, dtype=torch.long)
    mask[1, 150:] = 0

    def want(m, **kw):
        lengths = dict(kv_lengths=m.sum(-1), align="top_left") if bool((m.diff(dim=-1) <= 0).all()) else \
            dict(keep=m.bool()[:, None, None, :])
        return attnkit.attention(q, k, v, scale=0.2, **lengths, **kw).transpose(1, 2)

    for _ in range(4):
        hf.attention_forward(layer, q, k, v, mask, scaling=0.2, encoder_hidden_states=None, position_ids=None)
    with monkeypatch.context() as m:
        m.setattr(api, "attention", _refuse)
        got, weights = hf.attention_forward(layer, q, k, v, mask, scaling=0.2, encoder_hidden_states=None)
    assert weights is None and torch.equal(got, want(mask))
    other = mask.clone()
    other[2, 200:] = 0
    left = mask.clone()
    left[0, :10] = 0
    cases = [(other, {}), (left, {}), (mask, dict(sliding_window=64)), (mask, dict(output_attentions=True))]
    for m_, kw in cases:
        calls = []
        real = api.attention
        with monkeypatch.context() as m:
            m.setattr(api, "attention", lambda *a, **o: calls.append(1) or real(*a, **o))
            got, _ = hf.attention_forward(layer, q, k, v, m_, scaling=0.2, **kw)
        assert calls == [1], kw                          # (a sliding window with a 2-D mask: none, as
        assert torch.equal(got, want(m_)), kw            # without the fast path; see attnkit.hf)
    mask[2, 100:] = 0                                    # in place: a new version
    calls = []
    real = api.attention
    with monkeypatch.context() as m:
        m.setattr(api, "attention", lambda *a, **o: calls.append(1) or real(*a, **o))
        got, _ = hf.attention_forward(layer, q, k, v, mask, scaling=0.2)
    assert calls == [1] and torch.equal(got, want(mask))
